"""Command line: ``qaic-dynamo <command>`` (or ``python -m qaic_dynamo <command>``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qaic-dynamo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from qaic_dynamo import demo

    demo.add_arguments(sub.add_parser("demo", help=demo.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2


if __name__ == "__main__":
    sys.exit(main())
