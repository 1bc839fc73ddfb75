"""wise_serve.model: the engine of either backend from `wise serve` arguments, random weights for
benchmarks; the flags of one backend's features refused with the other; one backend's engine
built without importing the other framework."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wise_core.engine.protocol import Engine
from wise_core.presets import PRESETS
from wise_serve.args import add_serve_arguments
from wise_serve.model import build_llm, dummy_model


ROOT = Path(__file__).resolve().parents[2]
DEVICE_ARGV = ["--device", "cpu", "--num-pages", "4", "--page-size", "32", "--max-model-len", "64",
               "--max-num-seqs", "2"]


def args_of(*argv):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args([*DEVICE_ARGV, *argv])


def test_dummy_weights_are_those_of_the_throughput_benchmark():
    from benchmarks.engine import workload
    theirs = workload.random_model(dict(dtype="float32", device="cpu", seed=3, std=0.02, q_scale=5.0),
                                      PRESETS["test-tiny"]).state_dict()
    ours = dummy_model("test-tiny", dtype=torch.float32, device=torch.device("cpu"), q_scale=5.0, seed=3).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_build_llm_follows_the_flags():
    llm = build_llm(args_of("--model", "test-tiny", "--load-format", "dummy", "--wise", "--eta", "0.8",
                            "--attention-backend", "reference", "--cuda-graphs", "off"))
    assert llm.wise_config.eta == 0.8 and llm.args.attention_backend == "reference" and llm.tokenizer is None
    assert llm.attention_plan.kernel == "reference"
    assert (llm.blocks.num_pages, llm.page_size, llm.max_model_len) == (4, 32, 64)
    assert llm.model.head_weight.dtype == torch.float32 and not llm.runner.use_graphs
    assert isinstance(llm, Engine) and llm.args.enable_prefix_caching


def test_build_llm_jax_follows_the_flags():
    import wise_jax

    llm = build_llm(args_of("--backend", "jax", "--model", "test-tiny", "--load-format", "dummy", "--wise", "--eta",
                            "0.8", "--attention-backend", "reference", "--no-enable-prefix-caching"))
    assert isinstance(llm, wise_jax.LLM) and isinstance(llm, Engine)
    assert llm.wise_config.eta == 0.8 and llm.kernel == "reference" and llm.get_tokenizer() is None
    assert (llm.stats().total_pages, llm.page_size, llm.max_model_len) == (4, 32, 64)
    assert llm.cache.k.dtype == "float32" and not llm.args.enable_prefix_caching
    [out] = llm.generate([[1, 2, 3]], wise_jax.SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 3


def test_a_jax_server_compiles_ahead_so_its_first_requests_never_wait_for_a_compile():
    """By default the jax engine of `wise serve` compiles its start-up set before the server
    listens (background compiles on, even on a CPU), so a first request of each length finds its
    programs: no step waits for a compile. --no-compile-ahead leaves the engine's own default,
    which on a CPU compiles on the step path: its first request waits."""
    import wise_jax

    blocked = {}
    for ahead in ("--compile-ahead", "--no-compile-ahead"):
        llm = build_llm(args_of("--backend", "jax", "--model", "test-tiny", "--load-format", "dummy",
                                "--attention-backend", "reference", ahead))
        for prompt in ([1, 2, 3], list(range(1, 41))):      # one page, then two
            llm.generate([prompt], wise_jax.SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        blocked[ahead] = llm.stats().compile_blocked_steps
        llm.close()
    assert blocked["--compile-ahead"] == 0 and blocked["--no-compile-ahead"] > 0, blocked


def test_compile_ahead_is_refused_with_torch():
    with pytest.raises(ValueError, match="--compile-ahead is a jax engine feature"):
        build_llm(args_of("--model", "test-tiny", "--load-format", "dummy", "--no-compile-ahead"))


@pytest.mark.parametrize("argv, message", [
    (("--speculative", "wise"), "--speculative is a torch engine feature"),
    (("--cuda-graphs", "off"), "--cuda-graphs is a torch engine feature"),
    (("--attention-backend", "triton"), "--attention-backend triton is not one of the jax engine's"),
])
def test_torch_only_flags_are_refused_with_jax(argv, message):
    with pytest.raises(ValueError, match=message):
        build_llm(args_of("--backend", "jax", "--model", "test-tiny", "--load-format", "dummy", *argv))


@pytest.mark.parametrize("backend, other", [("jax", "torch"), ("torch", "jax")])
def test_one_backend_serves_without_importing_the_other(backend, other):
    argv = [*DEVICE_ARGV, "--backend", backend, "--model", "test-tiny", "--load-format", "dummy"]
    code = (f"import argparse, sys; from wise_serve.args import add_serve_arguments; "
            f"from wise_serve.model import build_llm; import wise_serve.server, wise_serve.cli; "
            f"p = argparse.ArgumentParser(); add_serve_arguments(p); "
            f"build_llm(p.parse_args({argv!r})).generate([[1, 2]], use_tqdm=False); "
            f"assert '{other}' not in sys.modules, sorted(m for m in sys.modules if m.startswith('{other}'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


REFUSED = [
    ("tensorflow", {}, "unknown backend 'tensorflow': the engines are 'torch', 'jax'"),
    ("jax", {"cuda_graphs": False}, "cuda_graphs is an option of the torch engine; the jax engine does not take it"),
    ("torch", {"mesh": None}, "mesh is an option of the jax engine; the torch engine does not take it"),
    ("torch", {"num_page": 4}, "unknown engine option 'num_page' for the torch engine"),
    ("jax", {"dtype": "int8"}, "dtype 'int8' is not one an engine loads"),
    ("torch", {"attention_backend": "pallas"}, "attention_backend 'pallas' is not one of the torch engine's"),
    ("torch", {"prefill_attention": "fa4"}, "unknown engine option 'prefill_attention' for the torch engine"),
]


def test_build_engine_names_what_it_refuses_before_a_framework_loads():
    """Each refusal is a ValueError naming the backend or option, raised before any framework is
    imported (one fresh process for all of them)."""
    code = ("import sys; from wise_serve.model import build_engine\n"
            f"for backend, options in {[(b, o) for b, o, _ in REFUSED]!r}:\n"
            "    try:\n        build_engine(backend, 'test-tiny', **options)\n"
            "    except ValueError as e:\n        print(e)\n"
            "print(sorted({'torch', 'jax'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == len(REFUSED) + 1 and lines[-1] == "[]", done.stdout + done.stderr
    for line, (_, _, message) in zip(lines, REFUSED):
        assert message in line, (line, message)


def test_the_backend_options_are_the_engines_own_arguments():
    """BACKEND_OPTIONS (what build_engine checks before a framework loads) lists exactly the
    keyword arguments of each LLM beside its model and EngineArgs'."""
    import inspect

    import wise_jax
    import wise_torch
    from wise_core.engine.backends import BACKEND_OPTIONS

    for backend, llm in (("torch", wise_torch.LLM), ("jax", wise_jax.LLM)):
        own = [name for name, p in inspect.signature(llm.__init__).parameters.items()
               if p.kind is p.KEYWORD_ONLY or name == "config"]
        assert sorted(own) == sorted(BACKEND_OPTIONS[backend]), backend


@pytest.mark.parametrize("argv, message", [
    (("--eta", "0.9"), "--eta needs --wise"),
    (("--load-format", "dummy"), "--load-format dummy needs --model to be a preset"),
    (("--q-scale", "4"), "--q-scale applies to --load-format dummy only"),
    (("--model", "no-such-model"), "unknown model 'no-such-model'"),
    (("--attention-backend", "pallas"), "--attention-backend pallas is not one of the torch engine's"),
])
def test_bad_flags_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        build_llm(args_of(*argv))


def test_speculative_flags():
    llm = build_llm(args_of("--model", "test-tiny", "--load-format", "dummy", "--speculative", "wise",
                            "--num-draft", "3", "--eta", "0.9", "--attention-backend", "reference"))
    assert llm.speculator.config.num_draft == 3 and llm.wise_config.eta == 0.9
    for argv, message in ((("--speculative", "loops", "--wise"), "--speculative loops decodes densely"),
                          (("--num-draft", "2"), "--num-draft and --draft-loops need --speculative")):
        with pytest.raises(ValueError, match=message):
            build_llm(args_of(*argv))
