"""`wise serve`: an OpenAI-compatible server (completions, chat completions, tokenize) over the
PyTorch engine (`wise_torch.LLM`).

protocol (request validation, OpenAI response shapes), chat (chat templates), engine_loop (the thread that drives
`LLM.step` beside the event loop), metrics (Prometheus text), model (building the engine from
command-line arguments, random weights for benchmarks), server (the aiohttp application and its
lifecycle), args (the command-line arguments; imports nothing beyond argparse and wise_core), cli
(`wise serve`). Incremental detokenization and stop strings are wise_core.detokenize.
"""
