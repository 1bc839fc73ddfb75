"""wise_serve.model: the engine from `wise serve` arguments, and random weights for benchmarks."""

import argparse

import pytest
import torch

from wise_core.config import PRESETS
from wise_serve.args import add_serve_arguments
from wise_serve.model import build_llm, dummy_model


def args_of(*argv):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(["--device", "cpu", "--num-pages", "4", "--page-size", "32", "--max-model-len", "64",
                              "--max-num-seqs", "2", *argv])


def test_dummy_weights_are_those_of_the_throughput_benchmark():
    from benchmarks import throughput
    theirs = throughput.random_model(dict(dtype="float32", device="cpu", seed=3, std=0.02, q_scale=5.0),
                                      PRESETS["test-tiny"]).state_dict()
    ours = dummy_model("test-tiny", dtype=torch.float32, device=torch.device("cpu"), q_scale=5.0, seed=3).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_build_llm_follows_the_flags():
    llm = build_llm(args_of("--model", "test-tiny", "--load-format", "dummy", "--wise", "--eta", "0.8",
                            "--kernel", "reference", "--cuda-graphs", "off"))
    assert llm.wise_config.eta == 0.8 and llm.wise_config.kernel == "reference" and llm.tokenizer is None
    assert (llm.blocks.num_pages, llm.page_size, llm.max_model_len) == (4, 32, 64)
    assert llm.model.head_weight.dtype == torch.float32 and not llm.runner.use_graphs


@pytest.mark.parametrize("argv, message", [
    (("--eta", "0.9"), "--eta needs --wise"),
    (("--load-format", "dummy"), "--load-format dummy needs --model to be a preset"),
    (("--q-scale", "4"), "--q-scale applies to --load-format dummy only"),
    (("--model", "no-such-model"), "unknown model 'no-such-model'"),
])
def test_bad_flags_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        build_llm(args_of(*argv))


def test_speculative_flags():
    llm = build_llm(args_of("--model", "test-tiny", "--load-format", "dummy", "--speculative", "wise",
                            "--num-draft", "3", "--eta", "0.9", "--kernel", "reference"))
    assert llm.speculator.config.num_draft == 3 and llm.wise_config.eta == 0.9
    for argv, message in ((("--speculative", "loops", "--wise"), "--speculative loops decodes densely"),
                          (("--num-draft", "2"), "--num-draft and --draft-loops need --speculative")):
        with pytest.raises(ValueError, match=message):
            build_llm(args_of(*argv))
