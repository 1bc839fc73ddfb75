"""The `wise` command line, run as a subprocess on CPU."""

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import wise_core

ROOT = Path(__file__).resolve().parents[2]


def wise(*args, timeout=300, interpret=True, stdin=""):
    """`wise ARGS` in a subprocess; interpret=False leaves TRITON_INTERPRET unset."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    if not interpret:
        env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "wise", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout, input=stdin)


@pytest.mark.parametrize("extra", [(), ("--wise", "--eta", "0.9", "--attention-backend", "reference")])
def test_generate_torch_on_cpu(extra):
    result = wise("generate", "--prompt", "def fib(n):", "--max-new-tokens", "3", "--device", "cpu", *extra)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def fib(n):")
    assert "[torch] prefill: 11 tokens in" in result.stderr and "decode: 2 tokens in" in result.stderr
    assert ("fallbacks 0, density loop 2:" in result.stderr) == bool(extra)


def test_generate_jax_on_cpu():
    result = wise("generate", "--backend", "jax", "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hi") and "[jax] prefill: 2 tokens in" in result.stderr
    assert "step program(s) built in" in result.stderr     # compilation, reported on its own


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_logprobs_are_printed_per_token_and_match_json(backend):
    """--logprobs: one row per generated token (id, log p, text) after the text; --json gives the
    same values in full; each is a log probability (finite, <= 0)."""
    args = ("generate", "--prompt", "def fib(n):", "--device", "cpu", "--max-new-tokens", "5", "--backend", backend,
            "--logprobs")
    text, js = wise(*args), wise(*args, "--json")
    assert text.returncode == js.returncode == 0, text.stderr + js.stderr
    out = json.loads(js.stdout)
    logprobs, ids = out["logprobs"], out["token_ids"]
    assert len(logprobs) == len(ids) == 5 and all(math.isfinite(x) and x <= 0 for x in logprobs)
    lines = text.stdout.splitlines()
    header = lines.index("# token id, log p, text")
    assert "\n".join(lines[:header]) == "def fib(n):" + out["text"]
    rows = [line.split(maxsplit=2) for line in lines[header + 1:]]
    assert [int(r[0]) for r in rows] == ids
    # The table rounds to 4 decimals: each row is within 5e-5 of the full value.
    assert all(abs(float(r[1]) - x) <= 5e-5 for r, x in zip(rows, logprobs))
    assert "".join(ast.literal_eval(r[2]) for r in rows) == out["text"]       # each token's text, quoted


def test_errors_and_help():
    result = wise("generate", "--prompt", "x", "--model", "no-such-model")
    assert result.returncode == 1 and "unknown model 'no-such-model'" in result.stderr
    result = wise("generate", "--help")
    help_text = " ".join(result.stdout.split())
    assert result.returncode == 0 and "built-in model name: huginn-py-3m, ouro-py-3m, random-tiny" in help_text
    assert "'ouro-py-3m' is a small model trained on Python source" in help_text
    assert "sampling temperature; 0 is greedy, the default" in help_text
    assert "--logprobs print each generated token's log p" in help_text
    assert wise().returncode == 2  # a command is required


def test_batch_json_and_stream_from_stdin_agree(tmp_path):
    prompts = ["def add(a, b):\n    return", "    def __init__(self"]
    batch = tmp_path / "prompts.jsonl"
    batch.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
    result = wise("generate", "--prompt-file", str(batch), "--max-new-tokens", "8", "--device", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == prompts and [r["index"] for r in rows] == [0, 1]
    for r in rows:
        assert len(r["token_ids"]) == r["stats"]["completion_tokens"] == 8 and r["finish_reason"] == "length"
        assert r["text"] == bytes(r["token_ids"]).decode()          # the byte-level tokenizer, no special ids
        assert r["stats"]["ttft_s"] <= r["stats"]["latency_s"] and r["stats"]["batch"]["prefill_tokens"] == 46
    assert "[torch] 2 prompts; prefill: 46 tokens in" in result.stderr
    result = wise("generate", "--prompt", "-", "--max-new-tokens", "8", "--device", "cpu", "--stream",
                  stdin=prompts[0])
    assert result.returncode == 0, result.stderr
    assert result.stdout == prompts[0] + rows[0]["text"] + "\n"


def test_prompt_file_of_lines_prints_each_completion(tmp_path):
    batch = tmp_path / "prompts.txt"
    batch.write_text("import os\n\nclass A:\n")
    result = wise("generate", "--prompt-file", str(batch), "--max-new-tokens", "2", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out[0] == "### prompt 1 of 2 (length)" and out[1].startswith("import os")
    assert "### prompt 2 of 2 (length)" in out


def test_bad_prompt_sources_are_named(tmp_path):
    result = wise("generate", "--prompt-file", str(tmp_path / "missing.txt"))
    assert result.returncode == 1 and "--prompt-file" in result.stderr and "missing.txt" in result.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    result = wise("generate", "--prompt-file", str(bad))
    assert result.returncode == 1 and 'line 2: expected an object with a non-empty string "prompt"' in result.stderr
    result = wise("generate", "--prompt", "-")
    assert result.returncode == 1 and "the prompt is empty (nothing on standard input)" in result.stderr
    two = tmp_path / "two.txt"
    two.write_text("a\nb\n")
    result = wise("generate", "--prompt-file", str(two), "--stream")
    assert result.returncode == 1 and "--stream prints one prompt's tokens as they come" in result.stderr
    assert wise("generate", "--prompt", "a", "--stream", "--json").returncode == 2   # argparse: not both


def test_version_and_serve_help():
    result = wise("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"wise {wise_core.__version__}"
    result = wise("serve", "--help")
    help_text = " ".join(result.stdout.split())
    assert result.returncode == 0 and "--num-pages" in help_text and "--shutdown-timeout" in help_text


def test_cli_module_does_not_import_a_framework():
    code = ("import sys, wise.cli; wise.cli.build_parser(); "
            "print(sorted({'torch', 'jax', 'aiohttp'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize("args, message", [
    (("--eta", "0.5"), "--eta set WISE decode; add --wise"),
    (("--attention-backend", "pallas"), "--attention-backend pallas is not one of the torch engine's (auto, triton, "
                                        "fa4, reference)"),
    (("--backend", "jax", "--attention-backend", "fa4"), "--attention-backend fa4 is not one of the jax engine's"),
    (("--seed", str(2 ** 70)), r"seed must be in [0, 2**63), got 1180591620717411303424"),
    (("--temperature", "nan"), "temperature must be finite and >= 0"),
    (("--top-p", "0"), "top_p must be in (0, 1], got 0.0"),
    (("--wise", "--eta", "1.5"), "WiseConfig.eta must be in (0, 1], got 1.5"),
    (("--threads", "0"), "--threads must be a positive integer, got 0"),
    (("--top-k", "-2"), "top_k must be an integer >= -1"),
    (("--min-p", "2"), "min_p must be in [0, 1], got 2.0"),
    (("--max-new-tokens", "-5"), "--max-new-tokens must be a positive integer, got -5"),
    (("--max-new-tokens", "0"), "--max-new-tokens must be a positive integer, got 0"),
    (("--top-p", "0.9"), "--top-p set sampling; add --temperature T > 0 (greedy decoding, the default, does not "
                         "use it)"),
    (("--seed", "3"), "--seed set sampling; add --temperature T > 0"),
    (("--top-k", "2", "--min-p", "0.1", "--seed", "1", "--temperature", "0"),
     "--top-k and --min-p and --seed set sampling; add --temperature T > 0"),
])
def test_generate_argument_errors_before_any_framework_loads(args, message):
    """Named errors, exit status 1; dense decode never silently ignores WISE settings."""
    result = wise("generate", "--prompt", "x", "--device", "cpu", *args)
    assert result.returncode == 1 and message in result.stderr, result.stderr


def test_generate_errors_that_need_the_model():
    """A lone surrogate (undecodable bytes in argv) and Triton without CUDA: named errors."""
    result = wise("generate", "--prompt", "ab\udcff", "--device", "cpu", "--max-new-tokens", "1")
    assert result.returncode == 1 and "--prompt holds a lone surrogate '\\udcff' at index 2" in result.stderr, \
        result.stderr
    env_free = wise("generate", "--prompt", "x", "--device", "cpu", "--attention-backend", "triton",
                    "--max-new-tokens", "1", interpret=False)
    assert env_free.returncode == 1, env_free.stderr
    assert "the Triton kernel needs a CUDA device or TRITON_INTERPRET=1" in env_free.stderr


def test_threads_sets_the_torch_threads_and_defaults_to_the_physical_cores():
    """--threads N runs torch on N threads (the same greedy text); the default is the physical
    cores, which --help names."""
    from wise.cli import physical_cores

    cores = physical_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    assert f"{cores} here" in " ".join(wise("generate", "--help").stdout.split())
    args = ("generate", "--prompt", "def f(", "--device", "cpu", "--max-new-tokens", "4", "--json")
    one, default = wise(*args, "--threads", "1"), wise(*args)
    assert one.returncode == default.returncode == 0, one.stderr + default.stderr
    one, default = json.loads(one.stdout), json.loads(default.stdout)
    assert one["text"] == default["text"]
    assert (one["stats"]["batch"]["threads"], default["stats"]["batch"]["threads"]) == (1, cores)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_top_k_one_samples_the_greedy_text(backend):
    args = ("generate", "--prompt", "def f(", "--device", "cpu", "--max-new-tokens", "6", "--json",
            "--backend", backend)
    greedy, top1 = wise(*args), wise(*args, "--temperature", "1.3", "--top-k", "1", "--seed", "5")
    assert greedy.returncode == top1.returncode == 0, greedy.stderr + top1.stderr
    assert json.loads(top1.stdout)["text"] == json.loads(greedy.stdout)["text"]


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_stop_ends_the_text_before_it(backend):
    args = ("generate", "--prompt", "def add(a, b):", "--device", "cpu", "--max-new-tokens", "16", "--json",
            "--backend", backend)
    full = wise(*args)
    assert full.returncode == 0, full.stderr
    text = json.loads(full.stdout)["text"]
    stop = text[4:6]
    cut = wise(*args, "--stop", stop, "--stop", "\x01")
    assert cut.returncode == 0, cut.stderr
    out = json.loads(cut.stdout)
    assert out["text"] == text[:text.find(stop)] and out["finish_reason"] == "stop"


def test_max_new_tokens_past_the_models_positions_names_the_flag():
    result = wise("generate", "--prompt", "def f(", "--device", "cpu", "--max-new-tokens", "100000")
    assert result.returncode == 1, result.stderr
    assert ("--max-new-tokens 100000: --prompt holds 6 tokens, and with 100000 new tokens they pass the model's "
            "4096 positions (max_position_embeddings); ask for at most 4090") in result.stderr, result.stderr


def test_a_prompt_file_with_a_bom_blank_lines_and_max_tokens_per_line(tmp_path):
    """The BOM is not part of the first prompt, a JSONL line's max_tokens is its length, and
    "index" is each prompt's line (blank lines do not renumber the prompts after them)."""
    batch = tmp_path / "prompts.jsonl"
    rows = ['{"prompt": "def f(", "max_tokens": 3}', "", "   ", '{"prompt": "import os", "id": 7}',
            '{"prompt": "class A:", "max_tokens": 5}']
    batch.write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode() + b"\n")
    result = wise("generate", "--prompt-file", str(batch), "--max-new-tokens", "2", "--device", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    out = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["index"], r["prompt"], len(r["token_ids"])) for r in out] == [
        (0, "def f(", 3), (3, "import os", 2), (4, "class A:", 5)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": "b", "max_tokens": 0}\n')
    result = wise("generate", "--prompt-file", str(bad), "--device", "cpu")
    assert result.returncode == 1 and f'--prompt-file {bad} line 3: "max_tokens" must be a positive integer, ' \
        "got 0" in result.stderr, result.stderr
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "ab", "max_tokens": 5000}\n')
    result = wise("generate", "--prompt-file", str(long), "--device", "cpu")
    assert result.returncode == 1 and f'{long} line 1\'s "max_tokens" 5000: ' in result.stderr, result.stderr


def test_a_bom_on_standard_input_is_not_part_of_the_prompt():
    result = wise("generate", "--prompt", "-", "--max-new-tokens", "2", "--device", "cpu", "--json",
                  stdin="\ufeffdef f(")
    assert result.returncode == 0 and json.loads(result.stdout)["prompt"] == "def f(", result.stderr


def test_train_help_describes_every_option_with_its_default():
    result = wise("train", "--help")
    text = " ".join(result.stdout.split())
    assert result.returncode == 0
    for words in ("--seq-len SEQ_LEN tokens per window (each window reads seq_len + 1 tokens) (default: 2048)",
                  "--lr LR peak learning rate (AdamW) (default: 0.002)", "--objective {ouro,last,huginn}",
                  "this last fraction of --data is held out (default: 0.05)", "--remat recompute"):
        assert words in text, words


def test_train_on_too_small_a_text_names_the_flag_to_change(tmp_path):
    text = tmp_path / "small.txt"
    text.write_text("x = 1\n" * 160)                      # 960 bytes: 912 training, 48 held out
    result = wise("train", "--data", str(text), "--out", str(tmp_path / "out"), "--max-steps", "1")
    assert result.returncode == 1
    assert (f"the training (--data {text}) stream holds 912 tokens, fewer than one window of --seq-len 2048 + 1: "
            f"pass --seq-len 911 or less, or more text in --data") in result.stderr, result.stderr
    result = wise("train", "--data", str(text), "--out", str(tmp_path / "out"), "--max-steps", "1",
                  "--seq-len", "64")
    assert result.returncode == 1
    assert ("the held-out (the last --heldout-fraction 0.05 of --data) stream holds 48 tokens, fewer than one "
            "window of --seq-len 64 + 1: pass --seq-len 47 or less, or a larger --heldout-fraction") in result.stderr
