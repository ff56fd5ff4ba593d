"""What the commands share: the ``--model`` argument."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qaic_dynamo import demo

__all__ = ["model_arg"]


def model_arg(args: argparse.Namespace) -> object | None:
    if Path(args.model).is_dir():
        if args.layers is not None or args.hidden_size is not None:
            print(
                f"qaic-dynamo: --layers and --hidden-size resize the built-in models; the model in {args.model} is "
                "used as it is, so drop them",
                file=sys.stderr,
            )
            return None
        # As a path, never a bare name: a directory called "llama" is that model, not the
        # built-in one.
        return str(Path(args.model).resolve())
    if args.model not in ("llama", "qwen2", "mistral", "mla"):
        print(
            f"qaic-dynamo: --model {args.model!r} is neither a built-in model (llama, qwen2, mistral, mla) "
            "nor a local directory",
            file=sys.stderr,
        )
        return None
    try:
        return demo.build_model(
            argparse.Namespace(
                model=args.model, config=None, layers=args.layers, hidden_size=args.hidden_size, seed=args.seed
            )
        )
    except ValueError as e:  # a shape the model cannot have
        print(f"qaic-dynamo: {e}", file=sys.stderr)
        return None
