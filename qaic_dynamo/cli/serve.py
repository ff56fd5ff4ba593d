"""``qaic-dynamo serve MODEL``: an OpenAI-compatible HTTP server over ``LLM``.

MODEL is a local model directory (its tokenizer and chat template are used) or a
built-in model name (random weights, with the byte-level tokenizer of
``qaic_dynamo.models.tokenizer``). The server binds ``--host`` (127.0.0.1 by default).
"""

from __future__ import annotations

import argparse
import signal
import sys

from qaic_dynamo.cli.common import model_arg
from qaic_dynamo.demo import positive_int

__all__ = ["add_serve_arguments", "serve_command"]


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="llama | qwen2 | mistral | mla (built-in, random weights) or a local model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients pass (default: MODEL)")
    p.add_argument("--layers", type=positive_int, default=None, help="built-in models: number of layers")
    p.add_argument("--hidden-size", type=positive_int, default=None, help="built-in models: hidden size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["qaic", "eager"], default="qaic")
    p.add_argument("--max-num-seqs", type=positive_int, default=8)
    p.add_argument("--max-model-len", type=positive_int, default=None)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None)


def build_llm(args: argparse.Namespace):
    """The LLM the server runs, or None (after printing why) if the arguments are bad."""
    from qaic_dynamo.engine import LLM
    from qaic_dynamo.models.tokenizer import byte_tokenizer

    model = model_arg(args)
    if model is None:
        return None
    tokenizer = None
    if not isinstance(model, str):  # a built-in model: give it a tokenizer
        tokenizer = byte_tokenizer(model.config.vocab_size if hasattr(model, "config") else model.vocab_size)
    return LLM(
        model,
        args.backend,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tokenizer=tokenizer,
    )


def serve_command(args: argparse.Namespace) -> int:
    import uvicorn

    from qaic_dynamo.deploy.api_server import build_app

    try:
        llm = build_llm(args)
    except (ValueError, OSError) as e:
        print(f"qaic-dynamo serve: {e}", file=sys.stderr)
        return 2
    if llm is None:
        return 2
    name = args.served_model_name or args.model
    print(f"serving {name} at http://{args.host}:{args.port}/v1 (backend {args.backend})", flush=True)
    stopped_by: list[signal.Signals] = []

    def stop(signum: int, frame: object) -> None:
        # uvicorn handles the signal itself (a graceful shutdown), then raises it again
        # with the previous handler back: this one, which ends the command quietly.
        stopped_by.append(signal.Signals(signum))
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.run(build_app(llm, name), host=args.host, port=args.port, log_level="warning")
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    why = f" by {stopped_by[0].name}" if stopped_by else ""
    print(f"qaic-dynamo serve: stopped{why}", flush=True)
    return 0
