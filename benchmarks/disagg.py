"""Disaggregated serving on one workload, side by side in one run:

  slicing   DisaggregatedServer(transport="shm"): prefill writes the decode slot itself
  copying   DisaggregatedServer(transport="copy"): prefill writes its own buffers and the
            slot's retained state is copied into the decode buffers at the hand-off
  gloo      DisaggregatedServer(transport="gloo"): the slot is sent over torch.distributed
            (loopback here; the transport for prefill and decode on different hosts)
  colocated one LLM doing prefill and decode in one process (LLM.generate)
  exported  DisaggregatedServer.from_export: the prefill-only and decode-only artifacts of
            export_prefill_decode (continuous batching, --slots rows, prefill_seq_len 64)
            on ONNX Runtime, slicing over shared memory; exported once before the clock

The workload: --requests requests (prompt lengths 1-200, 1-16 new tokens, fixed seed),
more than the decode slots. For each: time to first token (median, p90; for colocated,
the time until its first token), decode tokens/s over the run, and KV bytes moved per
hand-off. Workers warm up (compile) before the clock starts. Medians over --repeats runs.

    python benchmarks/disagg.py [--quick] [--repeats 3] [--requests 24]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import demo_llama, markdown_table, save_results  # noqa: E402

from qaic_dynamo.deploy.serving import percentile  # noqa: E402  (the servers' own definition)

METHODS = ["slicing", "copying", "gloo", "colocated", "exported"]


def workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 200))] for _ in range(n)]
    return prompts, [rng.randint(1, 16) for _ in range(n)]


def colocated(model, prompts, max_tokens, slots: int, ctx: int, backend: str) -> dict:
    """One engine, continuous batching over the same requests; TTFT per request is when
    its first token is chosen."""
    from qaic_dynamo import LLM
    from qaic_dynamo.engine import Request

    llm = LLM(model, backend, max_num_seqs=slots, max_model_len=ctx, block_size=16)
    llm.generate([prompts[0][:4]], 2)  # warm-up (compile)
    start = time.perf_counter()
    waiting = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    running, ttft, decode_tokens = [], {}, 0
    while waiting or running:
        while waiting and len(running) < slots and llm.reserve_blocks(waiting[0]):
            running.append(waiting.pop(0))
        logits = llm.execute_model(running)
        now = time.perf_counter()
        for r, row in zip(running, logits):
            if r.output_token_ids:
                decode_tokens += 1
            else:
                ttft[r.request_id] = now - start
            r.num_computed_tokens = r.num_tokens
            r.output_token_ids.append(int(row.argmax()))
        for r in [r for r in running if r.is_finished]:
            running.remove(r)
            llm.release_blocks(r)
    wall = time.perf_counter() - start
    t = sorted(ttft.values())
    return {
        "ttft_median_s": statistics.median(t),
        "ttft_p90_s": percentile(t, 0.9),
        "decode_tokens_per_s": decode_tokens / wall,
        "kv_bytes_per_handoff": 0.0,
        "wall_s": wall,
    }


def disaggregated(model, prompts, max_tokens, slots: int, ctx: int, backend: str, transport: str) -> dict:
    from qaic_dynamo.deploy.serving import DisaggregatedServer, summarize

    with DisaggregatedServer(
        model, decode_slots=slots, ctx_len=ctx, chunk_size=64, transport=transport, backend=backend
    ) as server:
        server.generate([prompts[0][:4]], 2)  # warm-up: both workers compile
        results = server.generate(prompts, max_tokens)
        for r in results:
            if r.error:
                raise RuntimeError(r.error)
    return summarize(results)


def export_pair(model, slots: int, ctx: int, out: Path) -> Path:
    from qaic_dynamo.deploy.export import export_prefill_decode

    pair = export_prefill_decode(
        model, out, full_batch_size=slots, prefill_seq_len=64, ctx_len=ctx, kv_cache_prefix="kv", run_compiler=False
    )
    return pair.prefill.export_dir.parent


def served_export(pair_dir: Path, prompts, max_tokens) -> dict:
    from qaic_dynamo.deploy.serving import DisaggregatedServer, summarize

    with DisaggregatedServer.from_export(pair_dir) as server:
        server.generate([prompts[0][:4]], 2)  # the same warm-up as the engine-served methods
        results = server.generate(prompts, max_tokens)
        for r in results:
            if r.error:
                raise RuntimeError(r.error)
    return summarize(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 requests, one repeat (tests)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--backend", default="qaic")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results-dir", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.layers, args.hidden_size, args.vocab, args.repeats = 8, 2, 64, 512, 1
    ctx = 256
    model = demo_llama(args.layers, args.hidden_size, args.vocab)
    prompts, max_tokens = workload(args.requests, args.vocab)
    runs: dict[str, list[dict]] = {m: [] for m in args.methods}
    tmp = tempfile.TemporaryDirectory(prefix="qaic-disagg-")
    pair_dir = export_pair(model, args.slots, ctx, Path(tmp.name)) if "exported" in args.methods else None
    for rep in range(args.repeats):
        for m in args.methods:
            if m == "exported":
                r = served_export(pair_dir, prompts, max_tokens)
            elif m == "colocated":
                r = colocated(model, prompts, max_tokens, args.slots, ctx, args.backend)
            else:
                transport = {"slicing": "shm", "copying": "copy", "gloo": "gloo"}[m]
                r = disaggregated(model, prompts, max_tokens, args.slots, ctx, args.backend, transport)
            runs[m].append(r)
            print(
                f"  [{rep + 1}] {m:>9}: TTFT median {r['ttft_median_s'] * 1e3:7.1f} ms, p90 {r['ttft_p90_s'] * 1e3:7.1f} ms, "
                f"decode {r['decode_tokens_per_s']:7.1f} tok/s, KV moved per hand-off {r['kv_bytes_per_handoff']:,.0f} B",
                flush=True,
            )
    med = {
        m: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
        for m, rs in runs.items()
    }
    rows = [
        [
            m,
            med[m]["ttft_median_s"] * 1e3,
            med[m]["ttft_p90_s"] * 1e3,
            med[m]["decode_tokens_per_s"],
            f"{med[m]['kv_bytes_per_handoff']:,.0f}",
        ]
        for m in args.methods
    ]
    md = (
        f"### Disaggregated serving ({args.requests} requests, prompts 1-200 tokens, {args.slots} decode slots, "
        f"{args.layers}-layer Llama hidden {args.hidden_size}, backend {args.backend} (exported: ONNX Runtime); "
        f"median of {args.repeats})\n\n"
        + markdown_table(
            ["method", "TTFT median (ms)", "TTFT p90 (ms)", "decode tokens/s", "KV bytes moved per hand-off"], rows
        )
    )
    print("\n" + md)
    path = save_results(
        "disagg" + ("_quick" if args.quick else ""),
        {
            "requests": args.requests,
            "slots": args.slots,
            "layers": args.layers,
            "hidden": args.hidden_size,
            "backend": args.backend,
            "median": med,
            "runs": runs,
        },
        md,
        args.results_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
