"""``qaic-dynamo cache info|list|clear``: inspect or empty the persistent compile cache."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from qaic_dynamo.cache import DiskCache
from qaic_dynamo.config import CompilationConfig

__all__ = ["add_cache_arguments", "cache_command"]


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["info", "list", "clear"])
    p.add_argument("--cache-dir", help="cache root (default: the backend's, see docs)")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def cache_command(args: argparse.Namespace) -> int:
    cfg = CompilationConfig.from_options({"cache_dir": args.cache_dir} if args.cache_dir else {})
    root = Path(cfg.resolved_cache_dir())
    if args.cache_dir is not None and not root.is_dir():
        # A typo would otherwise read as an empty cache (0 entries, success).
        what = "is a file, not a directory" if root.exists() else "does not exist"
        print(f"qaic-dynamo cache: --cache-dir {root} {what}", file=sys.stderr)
        return 2
    try:
        rc = _run(args, cfg, DiskCache(str(root), cfg.cache_size_limit))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return rc
    except BrokenPipeError:  # `cache list | head`: the reader has what it wanted
        # Python would report the pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(args: argparse.Namespace, cfg: CompilationConfig, cache: DiskCache) -> int:
    if args.action == "info":
        entries = cache.entries()
        print(f"location  {cache.root}")
        print(f"entries   {len(entries)}")
        print(f"size      {_human(sum(e.size for e in entries))} (limit {_human(cfg.cache_size_limit)})")
        last = cache.last_run()
        if last:
            print(
                f"last run  {last['misses']} misses, {last['hits']} hits, {last['writes']} written "
                f"(pid {last['pid']}, {_when(last['time'])})"
            )
        else:
            print("last run  unknown")
    elif args.action == "list":
        print(f"{'key':<12}  {'size':>10}  {'created':<19}  last used")
        for e in sorted(cache.entries(), key=lambda e: e.last_used, reverse=True):
            print(f"{e.key[:12]:<12}  {_human(e.size):>10}  {_when(e.created):<19}  {_when(e.last_used)}")
    else:
        print(f"removed {cache.clear()} entries from {cache.root}")
    return 0
