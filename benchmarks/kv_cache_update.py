"""Throughput of qaic::reshape_and_cache against PyTorch, and its cost versus cache size.

Three ways to write the same K/V rows, timed side by side:
  * qaic      - torch.ops.qaic.reshape_and_cache (the C++ kernel),
  * index_put - pure PyTorch: cache[block, :, offset] = rows (advanced indexing). The
                cache layout [blocks, heads, block_size, dim] puts heads between block and
                offset, so a single index_copy_ cannot address a slot; index_put_ is the
                one-call PyTorch equivalent,
  * copy_     - Tensor.copy_ of the same number of bytes into a contiguous buffer: the
                memory-bandwidth floor no scatter can beat.
Target: qaic reaches >= 50% of copy_ bandwidth for decode- and prefill-sized writes.

Then the per-call cost of a decode-sized write at 1x, 16x and 256x cache capacity: it
must not grow, because the kernel touches only the written slots.

    python benchmarks/kv_cache_update.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, median_seconds, save_results  # noqa: E402

import qaic_dynamo  # noqa: E402,F401

HEADS, HEAD_SIZE, BLOCK = 8, 128, 16


def engine_slots(tokens: int, num_blocks: int, decode: bool, g: torch.Generator) -> torch.Tensor:
    """Slots as an engine produces them: blocks handed out in shuffled order; a prefill
    writes consecutive offsets of its blocks, a decode batch one token per sequence."""
    blocks = torch.randperm(num_blocks, generator=g)
    if decode:  # one token for each of `tokens` sequences, each at some offset of its block
        return blocks[:tokens] * BLOCK + torch.randint(0, BLOCK, (tokens,), generator=g)
    pos = torch.arange(tokens)
    return blocks[pos // BLOCK] * BLOCK + pos % BLOCK


def setup(tokens: int, num_blocks: int, dtype: torch.dtype, layout: str = "engine"):
    g = torch.Generator().manual_seed(0)
    kc = torch.zeros(num_blocks, HEADS, BLOCK, HEAD_SIZE, dtype=dtype)
    vc = torch.zeros_like(kc)
    if layout == "random":  # every token to an independent random slot: the worst case
        slots = torch.randperm(num_blocks * BLOCK, generator=g)[:tokens]
    else:
        slots = engine_slots(tokens, num_blocks, decode=tokens <= 64, g=g)
    k = torch.randn(tokens, HEADS, HEAD_SIZE, generator=g).to(dtype)
    v = torch.randn(tokens, HEADS, HEAD_SIZE, generator=g).to(dtype)
    return k, v, kc, vc, slots


def bench_case(label: str, tokens: int, dtype: torch.dtype, repeats: int, layout: str = "engine") -> dict:
    num_blocks = max(64, 2 * tokens // BLOCK)
    k, v, kc, vc, slots = setup(tokens, num_blocks, dtype, layout)
    blk, off = slots // BLOCK, slots % BLOCK
    heads = torch.arange(HEADS)
    kdst, vdst = torch.empty_like(k), torch.empty_like(v)
    nbytes = 2 * k.numel() * k.element_size()

    def qaic():
        torch.ops.qaic.reshape_and_cache(k, v, kc, vc, slots)

    def index_put():
        kc[blk[:, None], heads[None, :], off[:, None]] = k
        vc[blk[:, None], heads[None, :], off[:, None]] = v

    def copy():
        kdst.copy_(k)
        vdst.copy_(v)

    t = {name: median_seconds(fn, repeats) for name, fn in (("qaic", qaic), ("index_put", index_put), ("copy_", copy))}
    row = {
        "case": label,
        "slots": layout,
        "tokens": tokens,
        "dtype": str(dtype).replace("torch.", ""),
        "bytes": nbytes,
        **{f"{n}_us": s * 1e6 for n, s in t.items()},
        **{f"{n}_GBps": nbytes / s / 1e9 for n, s in t.items()},
        "qaic_tokens_per_s": tokens / t["qaic"],
        "qaic_vs_copy": t["copy_"] / t["qaic"],
        "qaic_vs_index_put": t["index_put"] / t["qaic"],
    }
    row["meets_50pct_of_copy"] = row["qaic_vs_copy"] >= 0.5
    print(
        f"  {label:>8} {layout:>6} {row['dtype']:>8} {tokens:5d} tok: qaic {row['qaic_us']:8.1f} us "
        f"({row['qaic_GBps']:6.2f} GB/s)  index_put {row['index_put_us']:8.1f} us  "
        f"copy_ {row['copy__us']:8.1f} us  -> qaic/copy_ bandwidth {row['qaic_vs_copy']:.2f}, "
        f"{row['qaic_vs_index_put']:.1f}x faster than index_put",
        flush=True,
    )
    return row


def bench_capacity(repeats: int) -> list[dict]:
    rows = []
    for mult in (1, 16, 256):
        k, v, kc, vc, slots = setup(8, 16 * mult, torch.float16)
        s = median_seconds(lambda: torch.ops.qaic.reshape_and_cache(k, v, kc, vc, slots), repeats)
        cache_mb = 2 * kc.numel() * kc.element_size() / 2**20
        rows.append({"capacity": f"{mult}x", "cache_MiB": cache_mb, "decode_write_us": s * 1e6})
        print(
            f"  capacity {mult:>3}x ({cache_mb:7.1f} MiB of K+V): decode write of 8 tokens {s * 1e6:6.1f} us",
            flush=True,
        )
    for r in rows:
        r["vs_1x"] = r["decode_write_us"] / rows[0]["decode_write_us"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer cases and repeats (smoke test)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--results-dir", type=Path, default=None, help="default: benchmarks/results")
    args = ap.parse_args()
    repeats = 2 if args.quick else args.repeats
    print(
        f"reshape_and_cache: {HEADS} kv heads x {HEAD_SIZE} head_size, block {BLOCK}, "
        f"{torch.get_num_threads()} threads, median of {repeats} runs",
        flush=True,
    )
    cases = (
        [("decode", 8), ("prefill", 2048)]
        if args.quick
        else [("decode", 1), ("decode", 8), ("decode", 64), ("prefill", 512), ("prefill", 2048)]
    )
    dtypes = [torch.float16] if args.quick else [torch.float32, torch.float16]
    rows = [bench_case(label, n, dt, repeats) for dt in dtypes for label, n in cases]
    rows.append(bench_case("prefill", 2048, torch.float16, repeats, layout="random"))
    cap = bench_capacity(repeats)

    md = "### reshape_and_cache throughput\n\n" + markdown_table(
        [
            "case",
            "slots",
            "dtype",
            "tokens",
            "qaic us",
            "qaic GB/s",
            "index_put us",
            "copy_ us",
            "qaic/copy_ bw",
            "vs index_put",
            ">=50% copy",
        ],
        [
            [
                r["case"],
                r["slots"],
                r["dtype"],
                r["tokens"],
                r["qaic_us"],
                r["qaic_GBps"],
                r["index_put_us"],
                r["copy__us"],
                r["qaic_vs_copy"],
                r["qaic_vs_index_put"],
                "yes" if r["meets_50pct_of_copy"] else "NO",
            ]
            for r in rows
        ],
    )
    md += "\n### decode write (8 tokens, fp16) versus cache capacity\n\n" + markdown_table(
        ["capacity", "K+V MiB", "us per call", "vs 1x"],
        [[r["capacity"], r["cache_MiB"], r["decode_write_us"], r["vs_1x"]] for r in cap],
    )
    print("\n" + md)
    # The target is about the writes an engine makes; the random-scatter row is reported
    # for information (each 256-byte row lands on its own cache line run).
    missed = [
        f"{r['case']}/{r['dtype']}/{r['tokens']}"
        for r in rows
        if r["slots"] == "engine" and not r["meets_50pct_of_copy"]
    ]
    print("target >= 50% of copy_ bandwidth:", "met for every case" if not missed else f"MISSED for {missed}")
    path = save_results(
        "kv_cache_update" + ("_quick" if args.quick else ""),
        {"throughput": rows, "capacity": cap, "repeats": repeats},
        md,
        args.results_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
