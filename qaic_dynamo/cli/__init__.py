"""Command line: ``qaic-dynamo <command>`` (or ``python -m qaic_dynamo <command>``).

qaic-dynamo demo [--compare] [...]      compile a transformer, compare with eager
qaic-dynamo cache info|list|clear       inspect or empty the persistent compile cache
qaic-dynamo export --model M --out DIR  export M for a Cloud AI 100 card (retained-state
                                        ONNX, custom_io.yaml, specializations.json)
qaic-dynamo serve MODEL [--port 8000]    an OpenAI-compatible HTTP server (completions,
                                        chat, streaming, /metrics)
qaic-dynamo serve-disagg --model M --prompts FILE
                                        serve a prompt file with prefill and decode in
                                        separate processes (zero-copy KV hand-off)
"""

from __future__ import annotations

import argparse
import sys

from qaic_dynamo import demo
from qaic_dynamo.cli.cache import add_cache_arguments, cache_command
from qaic_dynamo.cli.export import add_export_arguments, export_command
from qaic_dynamo.cli.serve import add_serve_arguments, serve_command
from qaic_dynamo.cli.serve_disagg import add_serve_disagg_arguments, serve_disagg_command

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="qaic-dynamo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(sub.add_parser("demo", help=demo.__doc__.splitlines()[0]))
    add_cache_arguments(sub.add_parser("cache", help="inspect or empty the persistent compile cache"))
    add_export_arguments(sub.add_parser("export", help="export a model for a Cloud AI 100 card"))
    add_serve_arguments(sub.add_parser("serve", help="an OpenAI-compatible HTTP server over LLM"))
    add_serve_disagg_arguments(
        sub.add_parser("serve-disagg", help="serve prompts with disaggregated prefill and decode")
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            return demo.run(args)
        except (ValueError, OSError) as e:  # bad flags for this model (a context past its positions), no model
            print(f"qaic-dynamo demo: {e}", file=sys.stderr)
            return 2
    if args.command == "export":
        return export_command(args)
    if args.command == "serve":
        return serve_command(args)
    if args.command == "serve-disagg":
        return serve_disagg_command(args)
    return cache_command(args)
