"""Helpers of the tests that run each engine behaviour once per framework (a module, not a test
file): one model of random weights per framework, its engine, its full forward and its
`generate` of a prompt alone, and the check that an engine has let everything go."""

from __future__ import annotations

from wise_core.checkpoint import random_tensors

FRAMEWORKS = ("torch", "jax")


class Framework:
    """`name`'s model of `config` in float32 with random weights (`random_tensors(config, seed,
    std)`), or with `tensors` (a checkpoint's) where given."""

    def __init__(self, name: str, config, *, seed: int = 0, std: float = 0.08, tensors=None):
        tensors = random_tensors(config, seed=seed, std=std) if tensors is None else tensors
        self.name, self.config = name, config
        if name == "torch":
            import wise_torch
            self.lib, self.model = wise_torch, wise_torch.from_tensors(config, tensors)
        else:
            import wise_jax
            self.lib, self.model = wise_jax, wise_jax.from_checkpoint_tensors(config, tensors)

    def engine(self, **engine_args):
        """The framework's LLM over the model."""
        if self.name == "torch":
            return self.lib.LLM(self.model, **engine_args)
        return self.lib.LLM(self.model, self.config, **engine_args)

    def engine_at(self, path, **engine_args):
        """The framework's LLM over the checkpoint directory `path`, loaded as a model of this
        class is built: float32 (torch: on the CPU; JAX: on its default device)."""
        if self.name == "torch":
            return self.lib.LLM(str(path), device="cpu", **engine_args)
        return self.lib.LLM(str(path), dtype="float32", **engine_args)

    def cache(self, llm):
        """The engine's paged pool (a `PagedKVCache` of the framework)."""
        return llm.runner.cache if self.name == "torch" else llm.cache

    def forward(self, ids: list[int]):
        """The model's full-sequence forward of `ids` -> logits float32[len(ids), vocab] (numpy)."""
        import numpy as np
        if self.name == "torch":
            import torch
            with torch.no_grad():
                return self.model(torch.tensor([ids]))[0].numpy()
        import jax.numpy as jnp
        return np.asarray(self.lib.forward(self.model, self.config, jnp.asarray([ids], jnp.int32))[0])

    def alone(self, prompt: list[int], n: int, wise_config, *, page_size: int = 32) -> list[int]:
        """The framework's `generate` of `prompt` alone: n greedy tokens, no eos, reference kernel."""
        extra = () if self.name == "torch" else (self.config,)
        return self.lib.generate(self.model, *extra, [prompt], max_new_tokens=n, eos_token_id=None,
                                 page_size=page_size, wise_config=wise_config, attention_backend="reference").tokens[0]


def drained(llm):
    """llm's stats, asserting that no request is left and every page is back."""
    stats = llm.stats()
    assert stats.free_pages == stats.total_pages and stats.running == stats.waiting == 0
    assert not llm.has_unfinished()
    return stats
