"""`wise serve`: an OpenAI-compatible server (completions, chat completions, tokenize) over either
engine, `wise_torch.LLM` or `wise_jax.LLM` (`--backend`), through the engine protocol
(`wise_core.engine.protocol.Engine`) only.

protocol (request validation, OpenAI response shapes), chat (chat templates), engine_loop (the
thread that drives `Engine.step` beside the event loop), metrics (Prometheus text), model
(`build_engine`, the one constructor of either backend's engine, which `wise generate` and the
benchmarks use too; the engine of --backend from command-line arguments; random weights for
benchmarks: the only module that imports a framework, lazily), server (the aiohttp application and its
lifecycle), args (the command-line arguments; imports nothing beyond argparse and wise_core), cli
(`wise serve`). Incremental detokenization and stop strings are wise_core.detokenize.
"""
