"""Command line: ``qaic-dynamo <command>`` (or ``python -m qaic_dynamo <command>``).

    qaic-dynamo demo [--compare] [...]      compile a transformer, compare with eager
    qaic-dynamo cache info|list|clear       inspect or empty the persistent compile cache
"""

from __future__ import annotations

import argparse
import sys
import time


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def cache_command(args: argparse.Namespace) -> int:
    from qaic_dynamo.cache import DiskCache
    from qaic_dynamo.config import CompilationConfig

    cfg = CompilationConfig.from_options({"cache_dir": args.cache_dir} if args.cache_dir else {})
    cache = DiskCache(cfg.resolved_cache_dir(), cfg.cache_size_limit)
    if args.action == "info":
        entries = cache.entries()
        print(f"location  {cache.root}")
        print(f"entries   {len(entries)}")
        print(f"size      {_human(sum(e.size for e in entries))} (limit {_human(cfg.cache_size_limit)})")
        last = cache.last_run()
        if last:
            print(f"last run  {last['misses']} misses, {last['hits']} hits, {last['writes']} written "
                  f"(pid {last['pid']}, {_when(last['time'])})")
        else:
            print("last run  unknown")
    elif args.action == "list":
        print(f"{'key':<12}  {'size':>10}  {'created':<19}  last used")
        for e in sorted(cache.entries(), key=lambda e: e.last_used, reverse=True):
            print(f"{e.key[:12]:<12}  {_human(e.size):>10}  {_when(e.created):<19}  {_when(e.last_used)}")
    else:
        print(f"removed {cache.clear()} entries from {cache.root}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qaic-dynamo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    from qaic_dynamo import demo

    demo.add_arguments(sub.add_parser("demo", help=demo.__doc__.splitlines()[0]))
    cache = sub.add_parser("cache", help="inspect or empty the persistent compile cache")
    cache.add_argument("action", choices=["info", "list", "clear"])
    cache.add_argument("--cache-dir", help="cache root (default: the backend's, see docs)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    return cache_command(args)


if __name__ == "__main__":
    sys.exit(main())
