"""`wise serve`: build the engine of --backend from the arguments and serve until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging


def run(args: argparse.Namespace) -> int:
    """`wise serve ARGS` (wise_serve.args) -> the exit status once the server has shut down."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp").setLevel(max(logging.WARNING, logging.getLogger().level))
    from wise_serve.chat import load_chat_template
    from wise_serve.model import build_llm, describe, engine_context, model_config
    from wise_serve.server import Limits, serve

    limits = Limits(args.max_request_sequences, args.max_request_tokens, args.read_timeout)   # before the model loads
    llm = build_llm(args)
    config, tokenizer = model_config(args), llm.get_tokenizer()
    template = load_chat_template(
        args.model, args.chat_template, tokenizer=tokenizer, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id)
    if template is not None and tokenizer is None:
        raise ValueError("--chat-template needs a model with a tokenizer (a chat is text)")
    asyncio.run(serve(llm, host=args.host, port=args.port, model_name=args.served_model_name or args.model,
                      shutdown_timeout=args.shutdown_timeout, chat_template=template, description=describe(args),
                      engine_context=engine_context(args.backend), limits=limits))
    return 0
