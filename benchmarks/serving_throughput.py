"""Serving throughput: the scheduler against static batching, side by side in one run.

A workload of --requests requests (default 64) of mixed prompt lengths (8-256 tokens) and
output lengths (4-160 tokens, most short, a few long), arriving as a Poisson stream at
--rate requests/s (fixed seed). Engines, each on the demo's Llama architecture
(--layers layers, hidden 512, random weights):

  scheduler        LLM(backend="qaic"): requests join the running batch as they arrive
                   and as others finish (continuous batching, chunked prefill)
  scheduler-eager  the same with backend="eager" (no compiler)
  static           LLM(backend="qaic") called the way the engine had to be before: a
                   batch of at most max_num_seqs requests at a time, each batch run to
                   its longest request before the next starts

For each: requests/s and output tokens/s over the run (first arrival to last token),
TTFT and time per output token (p50 / p90). Every engine is compiled and warmed up
before its clock starts. Medians over --repeats runs, engines interleaved.

    python benchmarks/serving_throughput.py [--quick] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import demo_llama, markdown_table, save_results  # noqa: E402

from qaic_dynamo.deploy.serving import percentile  # noqa: E402  (the servers' own definition)

METHODS = ["scheduler", "scheduler-eager", "static"]


def workload(n: int, vocab: int, rate: float, seed: int = 0) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt, max_tokens) per request."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 256))]
        max_tokens = min(160, max(4, int(rng.expovariate(1 / 40))))
        out.append((t, prompt, max_tokens))
    return out


def summary(arrivals, firsts, lasts, counts, start, end) -> dict:
    ttft = [f - a for a, f in zip(arrivals, firsts)]
    tpot = [(last - f) / (n - 1) for f, last, n in zip(firsts, lasts, counts) if n > 1]
    wall = end - start
    return {
        "requests_per_s": len(arrivals) / wall,
        "output_tokens_per_s": sum(counts) / wall,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p90_s": percentile(tpot, 0.9),
        "wall_s": wall,
    }


def drive(llm, work, timeout: float, static: bool) -> dict:
    """Add requests at their arrival times (``static``: a batch of max_num_seqs at a time,
    once all of it has arrived and the previous batch is done, as callers of a static
    ``generate`` had to) and step while anything runs; the engine core directly, so that
    every token is timed when its step ends."""
    from qaic_dynamo import SamplingParams

    core, n = llm.core, len(work)
    firsts, lasts, counts = [0.0] * n, [0.0] * n, [0] * n
    start = time.perf_counter()
    arrivals = [start + a for a, _, _ in work]
    added = done = 0
    while done < n:
        now = time.perf_counter()
        if now > start + timeout:
            raise TimeoutError(f"not finished after {timeout} s")
        if static:
            batch_end = min(n, added + llm.max_num_seqs)
            if added == done and added < n and arrivals[batch_end - 1] <= now:
                for i in range(added, batch_end):
                    _, prompt, max_tokens = work[i]
                    core.add_request(
                        str(i), None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                    )
                added = batch_end
        else:
            while added < n and arrivals[added] <= now:
                _, prompt, max_tokens = work[added]
                core.add_request(
                    str(added), None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                )
                added += 1
        if not core.has_unfinished():
            time.sleep(0.001)
            continue
        core.step()
        now = time.perf_counter()
        for rid in list(core.dirty):
            out = core.output(rid, delta=True)
            i, new = int(rid), len(out.outputs[0].token_ids)
            if new and counts[i] == 0:
                firsts[i] = now
            counts[i] += new
            lasts[i] = now
            if out.finished:
                core.release(rid)
                done += 1
    return summary(arrivals, firsts, lasts, counts, start, max(lasts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 12 requests, one repeat (tests)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=16.0, help="mean arrivals per second")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    ap.add_argument("--results-dir", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.layers, args.hidden_size, args.vocab, args.repeats, args.rate = 12, 2, 64, 512, 1, 20.0

    from qaic_dynamo import LLM

    model = demo_llama(args.layers, args.hidden_size, args.vocab)
    work = workload(args.requests, args.vocab, args.rate)
    engines = {}
    for m in args.methods:
        llm = LLM(
            model, "eager" if m == "scheduler-eager" else "qaic", max_num_seqs=args.max_num_seqs, max_model_len=512
        )
        llm.generate([[5] * 40, [6] * 3], 4)  # compile and warm up before any clock
        engines[m] = llm
    runs: dict[str, list[dict]] = {m: [] for m in args.methods}
    for rep in range(args.repeats):
        for m in args.methods:
            r = drive(engines[m], work, args.timeout, static=m == "static")
            runs[m].append(r)
            print(
                f"  [{rep + 1}] {m:>15}: {r['output_tokens_per_s']:7.1f} output tok/s, {r['requests_per_s']:5.2f} req/s, "
                f"TTFT p50 {r['ttft_p50_s'] * 1e3:7.0f} ms p90 {r['ttft_p90_s'] * 1e3:7.0f} ms, "
                f"TPOT p50 {r['tpot_p50_s'] * 1e3:6.1f} ms p90 {r['tpot_p90_s'] * 1e3:6.1f} ms",
                flush=True,
            )
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    rows = [
        [
            m,
            med[m]["requests_per_s"],
            med[m]["output_tokens_per_s"],
            med[m]["ttft_p50_s"] * 1e3,
            med[m]["ttft_p90_s"] * 1e3,
            med[m]["tpot_p50_s"] * 1e3,
            med[m]["tpot_p90_s"] * 1e3,
        ]
        for m in args.methods
    ]
    md = (
        f"### Serving throughput ({args.requests} requests, Poisson arrivals at {args.rate:g}/s, prompts 8-256 "
        f"tokens, outputs 4-160; {args.layers}-layer Llama hidden {args.hidden_size}, max_num_seqs "
        f"{args.max_num_seqs}; median of {args.repeats})\n\n"
        + markdown_table(
            [
                "engine",
                "requests/s",
                "output tokens/s",
                "TTFT p50 (ms)",
                "TTFT p90 (ms)",
                "TPOT p50 (ms)",
                "TPOT p90 (ms)",
            ],
            rows,
        )
    )
    if "scheduler" in med and "static" in med:
        ratio = med["scheduler"]["output_tokens_per_s"] / med["static"]["output_tokens_per_s"]
        md += f"\nscheduler / static output tokens/s = {ratio:.2f} (target >= 1.5: {'met' if ratio >= 1.5 else 'MISSED'})\n"
    print("\n" + md)
    path = save_results(
        "serving_throughput" + ("_quick" if args.quick else ""),
        {
            "requests": args.requests,
            "rate": args.rate,
            "layers": args.layers,
            "hidden": args.hidden_size,
            "max_num_seqs": args.max_num_seqs,
            "median": med,
            "runs": runs,
        },
        md,
        args.results_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
