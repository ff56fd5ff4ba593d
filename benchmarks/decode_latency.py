"""Per-step latency of qaic (regional, the engine's default), qaic-whole (one
torch.compile of the whole model), eager and inductor on the same model and inputs.

One engine step (``LLM.execute_model``: build metadata, set the forward context, run the
model, slice the logits) for:
  * prefill: batch 1 x 128 tokens,
  * decode: batch 1 and batch 8, each sequence 128 tokens deep,
as the median of many steps after warm-up (and of several interleaved rounds). Also, for qaic:
the per-piece overhead (binding + dispatch against the ONNX Runtime run) of a middle
piece, and a batch-8 decode step at 1x and 8x KV capacity with the same live tokens,
which must not grow (the cache is updated in place).

Also the cost of entering a compiled region once per layer: (regional - whole) / layers
per step; what the guarded region dispatch saves against entering through torch.compile's
wrapper on every block call (qaic-dynamo-entry - qaic) / layers; and, for both qaic compiles, the effect of releasing PyTorch's OpenMP workers
before each ONNX Runtime run (the ``-spin`` variants leave them spinning).

Target: decode latency at batch 8, qaic <= 1.0 x eager; regional no slower than whole.

    python benchmarks/decode_latency.py [--quick] [--layers 16] [--hidden-size 512]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import demo_llama, markdown_table, median_seconds, piece_call_costs, save_results  # noqa: E402

CONTEXT = 128

#: LLM arguments of each measured configuration.
BACKENDS = {
    "qaic": dict(backend="qaic"),
    "qaic-whole": dict(backend="qaic", regional=False),
    "qaic-dynamo-entry": dict(backend="qaic", compile_options={"region_dispatch": "dynamo"}),
    "qaic-spin": dict(backend="qaic", compile_options={"release_openmp_workers": False}),
    "qaic-whole-spin": dict(backend="qaic", regional=False, compile_options={"release_openmp_workers": False}),
    "eager": dict(backend="eager"),
    "inductor": dict(backend="inductor"),
}


@contextlib.contextmanager
def case_batch(llm, kind: str, batch: int) -> Iterator[list]:
    """Requests as the engine holds them for one step, with blocks reserved for the block."""
    from qaic_dynamo.engine import Request

    requests = []
    try:
        for i in range(batch):
            if kind == "prefill":
                r = Request(i, [7] * CONTEXT, max_new_tokens=1)
            else:  # decoding the 128th token: 127 cached + this one
                r = Request(
                    i, [7] * (CONTEXT - 1), max_new_tokens=8, output_token_ids=[9], num_computed_tokens=CONTEXT - 1
                )
            if not llm.reserve_blocks(r):
                raise RuntimeError(f"{kind} x{batch}: the engine has only {llm.num_free_blocks} free KV blocks")
            requests.append(r)
        yield requests
    finally:
        for r in requests:
            llm.release_blocks(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model, fewer repeats")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument(
        "--backends",
        nargs="+",
        choices=list(BACKENDS),
        default=["qaic", "qaic-whole", "qaic-dynamo-entry", "qaic-spin", "qaic-whole-spin", "eager", "inductor"],
        help="qaic = regional (LLM's default), qaic-whole = regional=False; qaic-dynamo-entry: "
        "regional, every block call entering through torch.compile's wrapper "
        "(region_dispatch='dynamo'); -spin: without releasing PyTorch's OpenMP workers "
        "before each ONNX Runtime run",
    )
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--results-dir", type=Path, default=None)
    args = ap.parse_args()
    from qaic_dynamo import LLM, set_forward_context
    from qaic_dynamo.compiler import compile_reports

    layers, hidden, vocab, repeats = args.layers, args.hidden_size, args.vocab, args.repeats
    if args.quick:
        layers, hidden, vocab, repeats = 2, 64, 512, 2
    model = demo_llama(layers, hidden, vocab)
    cases = [("prefill b1x128", "prefill", 1), ("decode b1", "decode", 1), ("decode b8", "decode", 8)]
    print(
        f"model: {layers} layers, hidden {hidden}, vocab {vocab}; median of {repeats} interleaved timing rounds",
        flush=True,
    )

    engines, reports = {}, {}
    for backend in args.backends:  # compile and warm up every configuration first
        llm = LLM(model, max_num_seqs=8, max_model_len=CONTEXT + 8, block_size=16, **BACKENDS[backend])
        engines[backend] = llm
        n_reports = len(compile_reports())
        for name, kind, b in cases:
            with case_batch(llm, kind, b) as batch:
                for _ in range(2):  # the first call compiles
                    llm.execute_model(batch)
        reports[backend] = compile_reports()[n_reports:]
    # Interleaved: every round times every configuration and case once, so a drift in the
    # machine's speed (large on this shared host) moves all of them alike.
    samples: dict[str, dict[str, list[float]]] = {b: {name: [] for name, _, _ in cases} for b in args.backends}
    for _ in range(repeats):
        for backend, llm in engines.items():
            for name, kind, b in cases:
                with case_batch(llm, kind, b) as batch:
                    llm.execute_model(batch)
                    samples[backend][name].append(median_seconds(lambda: llm.execute_model(batch), 1))
    results = {b: {name: statistics.median(v) for name, v in per.items()} for b, per in samples.items()}
    for backend in args.backends:
        for name, _, _ in cases:
            print(f"  {backend:>15} {name:<15} {results[backend][name] * 1e3:8.2f} ms", flush=True)

    rows = [[name] + [results[b][name] * 1e3 for b in args.backends] for name, _, _ in cases]
    md = "### Step latency, ms (median)\n\n" + markdown_table(["case"] + [f"{b} (ms)" for b in args.backends], rows)
    payload = {
        "layers": layers,
        "hidden": hidden,
        "vocab": vocab,
        "repeats": repeats,
        "step_ms": {b: {k: v * 1e3 for k, v in r.items()} for b, r in results.items()},
    }

    if "qaic" in engines and "eager" in results:
        ratio = results["qaic"]["decode b8"] / results["eager"]["decode b8"]
        payload["decode_b8_qaic_over_eager"] = ratio
        verdict = f"decode b8 qaic / eager = {ratio:.2f} (target <= 1.0: {'met' if ratio <= 1.0 else 'MISSED'})"
        print(verdict)
        md += "\n" + verdict + "\n"

    if "qaic" in results and "qaic-whole" in results:
        entry = {name: (results["qaic"][name] - results["qaic-whole"][name]) / layers for name, _, _ in cases}
        payload["region_entry_us_per_layer"] = {k: v * 1e6 for k, v in entry.items()}
        line = (
            "entering a compiled region, per layer and step: "
            + ", ".join(f"{k} {v * 1e6:+.0f} us" for k, v in entry.items())
            + " (regional - whole, / layers)"
        )
        print(line)
        md += "\n" + line + "\n"

    if "qaic" in results and "qaic-dynamo-entry" in results:
        saved = {name: (results["qaic-dynamo-entry"][name] - results["qaic"][name]) / layers for name, _, _ in cases}
        payload["guarded_dispatch_saves_us_per_layer"] = {k: v * 1e6 for k, v in saved.items()}
        line = (
            "guarded region dispatch saves, per layer and step: "
            + ", ".join(f"{k} {v * 1e6:+.0f} us" for k, v in saved.items())
            + " (qaic-dynamo-entry - qaic, / layers)"
        )
        print(line)
        md += "\n" + line + "\n"

    for on, off in (("qaic", "qaic-spin"), ("qaic-whole", "qaic-whole-spin")):
        if on in results and off in results:
            gain = {name: results[off][name] / results[on][name] for name, _, _ in cases}
            payload.setdefault("openmp_release_speedup", {})[on] = gain
            line = (
                f"{on}: releasing PyTorch's OpenMP workers before each ONNX Runtime run, step time without / with: "
                + ", ".join(f"{k} {v:.2f}x" for k, v in gain.items())
            )
            print(line)
            md += "\n" + line + "\n"

    if "qaic" in engines:
        llm = engines["qaic"]
        # Per-piece overhead of the piece that holds a layer's cache update, at decode b8.
        with case_batch(llm, "decode", 8) as batch:
            llm.execute_model(batch)
            runners = [r for rep in reports["qaic"] for r in rep.runners() if r.artifact.layout.kv_updates]
            middle = runners[-1]
            captured = {}
            handle = middle.register_forward_pre_hook(lambda mod, a: captured.__setitem__("args", a))
            llm.execute_model(batch)
            handle.remove()
            from qaic_dynamo import build_attention_metadata

            md_ = build_attention_metadata([CONTEXT] * 8, [1] * 8, [r.block_ids for r in batch], llm.block_size)
            with torch.no_grad(), set_forward_context(md_, llm.kv_caches, llm.kv_cache_layers) as ctx:
                t_runner, t_bare, t_eager = piece_call_costs(middle, captured["args"], ctx, repeats)
        over = t_runner - t_bare
        payload["middle_piece_us"] = {
            "runner": t_runner * 1e6,
            "ort_run": t_bare * 1e6,
            "binding_dispatch": over * 1e6,
            "eager": t_eager * 1e6,
        }
        line = (
            f"cache-update piece at decode b8: runner {t_runner * 1e6:.0f} us = ORT {t_bare * 1e6:.0f} us + "
            f"binding/dispatch {over * 1e6:.0f} us ({over / t_runner * 100:.0f}%); eager piece {t_eager * 1e6:.0f} us"
        )
        print(line)
        md += "\n" + line + "\n"

        # Capacity: same live tokens, 8x the blocks.
        cap = {}
        for mult in (1, 8):
            e = LLM(
                model,
                backend="qaic",
                max_num_seqs=8,
                max_model_len=CONTEXT + 8,
                block_size=16,
                num_blocks=8 * mult * (-(-(CONTEXT + 8) // 16)),
            )
            with case_batch(e, "decode", 8) as b:
                e.execute_model(b)
                cap[f"{mult}x"] = median_seconds(lambda: e.execute_model(b), repeats)
        payload["capacity_decode_b8_ms"] = {k: v * 1e3 for k, v in cap.items()}
        payload["capacity_8x_over_1x"] = cap["8x"] / cap["1x"]
        line = (
            f"decode b8 at 1x / 8x KV capacity: {cap['1x'] * 1e3:.2f} / {cap['8x'] * 1e3:.2f} ms "
            f"(ratio {cap['8x'] / cap['1x']:.2f})"
        )
        print(line)
        md += line + "\n"

    print("\n" + md)
    path = save_results("decode_latency" + ("_quick" if args.quick else ""), payload, md, args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
