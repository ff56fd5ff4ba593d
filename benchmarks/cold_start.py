"""Cold-start compile time against model depth, side by side, in one run.

For each depth L and method, one *fresh process* compiles the demo's Llama-architecture
transformers model (hidden 512, GQA, random weights) with every cache (torch inductor,
Triton, qaic_dynamo) pointed at a new empty directory, and measures the wall seconds from
the first compiled call to its first output (a prefill of 2 x 32 tokens), split into
Dynamo tracing and backend time. Methods:

  qaic       backend="qaic", layer-agnostic KV update (the default)
  per-layer  backend="qaic" with per-layer names (layer_agnostic_kv_update=False)
  inductor   backend="inductor" on the same model
  floor      backend="eager": Dynamo alone, the floor no backend can beat
  onnx       a whole-model torch.onnx.export(dynamo=True) at the same depth (plain
             transformers with SDPA): what a QEfficient-style flow pays to get ONNX
  warm       backend="qaic" in a second fresh process whose persistent cache a first
             (unmeasured) qaic process filled: a restart of the same model

Figures are medians over --repeats fresh processes. Prints a table and the ratios
qaic(Lmax)/qaic(Lmin), per-layer/qaic, inductor/qaic, onnx/qaic and qaic/floor at the
deepest L, with the targets; writes JSON + markdown to benchmarks/results/ and a PNG plot.

    python benchmarks/cold_start.py [--quick] [--repeats 3] [--layers 1 2 4 8 16 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

METHODS = ["qaic", "warm", "per-layer", "inductor", "floor", "onnx"]
TARGETS = {  # name: (description, predicate on the ratio)
    "flatness": ("qaic(Lmax)/qaic(Lmin) <= 1.5", lambda r: r <= 1.5),
    "per_layer": ("per-layer/qaic >= 8", lambda r: r >= 8),
    "inductor": ("inductor/qaic >= 5", lambda r: r >= 5),
    "onnx": ("onnx/qaic >= 10", lambda r: r >= 10),
    "floor": ("qaic <= 1.3 x (floor + one unique piece's lowering)", lambda r: r <= 1.3),
    "warm": ("warm <= 1.15 x floor", lambda r: r <= 1.15),
}


# --- the child: one measurement in a clean process ------------------------------------------


def child(method: str, layers: int, hidden: int, vocab: int) -> dict:
    import torch

    from qaic_dynamo.demo import DEFAULT_LLAMA
    from qaic_dynamo.models import hf_config, hf_model_from_config

    cfg = dict(DEFAULT_LLAMA, num_hidden_layers=layers, hidden_size=hidden, vocab_size=vocab,
               intermediate_size=hidden * 11 // 4)
    model = hf_model_from_config(hf_config(cfg))
    ids = torch.randint(0, vocab, (64,))
    pos = torch.cat([torch.arange(32), torch.arange(32)])
    result = {"method": method, "layers": layers}

    if method == "onnx":
        class Logits(torch.nn.Module):  # plain transformers forward, logits only, no cache
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, input_ids):
                return self.m(input_ids=input_ids, use_cache=False).logits

        t0 = time.perf_counter()
        torch.onnx.export(Logits(model).eval(), (ids.unsqueeze(0),), dynamo=True, optimize=False, verbose=False,
                          dynamic_shapes=({1: torch.export.Dim.DYNAMIC},))
        result.update(first_call_s=time.perf_counter() - t0, backend_s=None, dynamo_s=None)
        return result

    from qaic_dynamo import build_attention_metadata, compilation_counter, set_forward_context
    from qaic_dynamo.engine import LLM

    llm = LLM(model, backend="eager", layer_agnostic_kv_update=(method != "per-layer"), max_num_seqs=2,
              max_model_len=64)
    backend_s = [0.0]

    def timed(inner):
        def backend(gm, example_inputs):
            t = time.perf_counter()
            out = inner(gm, example_inputs)
            backend_s[0] += time.perf_counter() - t
            return out
        return backend

    if method in ("qaic", "per-layer", "warm"):
        from qaic_dynamo.backend import qaic_backend
        inner = qaic_backend
    elif method == "inductor":
        from torch._inductor.compile_fx import compile_fx
        inner = compile_fx
    else:
        inner = lambda gm, ex: gm.forward  # noqa: E731  Dynamo alone
    compiled = torch.compile(llm.model, backend=timed(inner))

    md = build_attention_metadata([32, 32], [32, 32], [[0, 1], [2, 3]], 16)
    idx = torch.tensor([31, 63])
    for t in (ids, pos, idx):
        torch._dynamo.mark_dynamic(t, 0)

    def call(fn):
        with set_forward_context(md, llm.kv_caches, llm.kv_cache_layers), torch.no_grad():
            return fn(ids, pos, idx)

    before = compilation_counter.snapshot()
    t0 = time.perf_counter()
    call(compiled)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    call(compiled)
    run = time.perf_counter() - t0
    result.update(
        first_call_s=first, backend_s=backend_s[0], run_s=run,
        dynamo_s=max(0.0, first - backend_s[0] - run),
        unique_pieces=compilation_counter.num_backend_compilations - before.num_backend_compilations,
        onnx_exports=compilation_counter.num_onnx_exports - before.num_onnx_exports,
        disk_hits=compilation_counter.num_disk_cache_hits - before.num_disk_cache_hits,
    )
    if method in ("qaic", "per-layer", "warm"):
        from qaic_dynamo.backend import last_compile_report
        from qaic_dynamo.cache import Source

        rep = last_compile_report()
        exports = [p.compile_seconds + p.load_seconds for p in rep.pieces if p.source is Source.LOWERED]
        result["max_piece_lowering_s"] = max(exports) if exports else 0.0
        result["pieces"] = len(rep.pieces)
    return result


def run_child(method: str, layers: int, hidden: int, vocab: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="qaic-cold-") as tmp:
        env = dict(os.environ)
        env.update(
            TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor", TRITON_CACHE_DIR=f"{tmp}/triton",
            QAIC_DYNAMO_CACHE_DIR=f"{tmp}/qaic", XDG_CACHE_HOME=f"{tmp}/xdg", TMPDIR=tmp,
        )
        def cmd(m):
            return [sys.executable, __file__, "--child", m, "--layers", str(layers), "--hidden-size", str(hidden),
                    "--vocab", str(vocab)]

        if method == "warm":  # a first process fills the cache; the measured one restarts
            first = subprocess.run(cmd("qaic"), env=env, capture_output=True, text=True, timeout=timeout)
            if first.returncode != 0:
                raise RuntimeError(f"warm-up of warm at {layers} layers failed:\n{first.stderr[-3000:]}")
        proc = subprocess.run(cmd(method), env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} at {layers} layers failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the parent: schedule, aggregate, report -------------------------------------------------


def median_of(samples: list[dict], key: str) -> float | None:
    vals = [s[key] for s in samples if s.get(key) is not None]
    return statistics.median(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="depths 2 and 8, one repeat")
    ap.add_argument("--smoke", action="store_true", help="tiny model, depths 1 and 2 (tests)")
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--expensive-repeats", type=int, default=None,
                    help="repeats for per-layer, inductor and onnx (default: --repeats)")
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--results-dir", type=Path, default=None)
    ap.add_argument("--tag", default="", help="suffix for the result files (e.g. 'warm')")
    ap.add_argument("--merge", type=Path, default=None,
                    help="an earlier result JSON whose samples are added; a (method, depth) measured now keeps the new samples")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers[0], args.hidden_size, args.vocab)))
        return

    from common import markdown_table, save_results

    layers, repeats, hidden, vocab = args.layers, args.repeats, args.hidden_size, args.vocab
    if args.quick:
        layers, repeats = [2, 8], 1
    if args.smoke:
        layers, repeats, hidden, vocab = [1, 2], 1, 64, 512
    print(f"cold start: layers {layers}, methods {args.methods}, hidden {hidden}, vocab {vocab}, median of "
          f"{repeats} fresh process(es) each ({args.expensive_repeats or repeats} for per-layer, inductor, onnx)",
          flush=True)
    samples: dict[str, dict[int, list[dict]]] = {m: {L: [] for L in layers} for m in args.methods}
    expensive = {"per-layer", "inductor", "onnx"}
    exp_repeats = args.expensive_repeats if args.expensive_repeats is not None else repeats
    for r in range(max(repeats, exp_repeats)):
        for L in layers:
            for m in args.methods:
                if r >= (exp_repeats if m in expensive else repeats):
                    continue
                t0 = time.perf_counter()
                s = run_child(m, L, hidden, vocab, args.timeout)
                samples[m][L].append(s)
                extra = ""
                if m in ("qaic", "per-layer", "warm"):
                    extra = f", {s['unique_pieces']} lowered, {s['disk_hits']} from disk"
                print(f"  [{r + 1}] {m:>9} L={L:<3} first call {s['first_call_s']:7.2f} s"
                      f"{extra} (process {time.perf_counter() - t0:.0f} s)", flush=True)

    methods = list(args.methods)
    if args.merge is not None:  # e.g. add a separate warm-start run to the full run
        old = json.loads(args.merge.read_text())
        layers = sorted(set(layers) | {int(L) for by_l in old["samples"].values() for L in by_l})
        for m, by_l in old["samples"].items():
            mine = samples.setdefault(m, {})
            for L, v in by_l.items():
                if not mine.get(int(L)):  # a (method, depth) measured now keeps its new samples
                    mine[int(L)] = v
            if m not in methods:
                methods.append(m)
        for m in samples:
            for L in layers:
                samples[m].setdefault(L, [])
        methods = [m for m in METHODS if m in methods]
    med = {m: {L: median_of(samples[m][L], "first_call_s") for L in layers} for m in methods}
    rows = []
    for L in layers:
        row = [L]
        for m in methods:
            row.append(med[m][L] if med[m][L] is not None else "-")
        q = samples.get("qaic", {}).get(L)
        row.append(median_of(q, "unique_pieces") if q else "-")
        row.append(median_of(q, "onnx_exports") if q else "-")
        w = samples.get("warm", {}).get(L)
        row.append(median_of(w, "onnx_exports") if w else "-")
        rows.append(row)
    table = markdown_table(["layers"] + [f"{m} (s)" for m in methods] + ["qaic unique pieces", "qaic ONNX exports", "warm ONNX exports"],
                           rows)
    split_rows = []
    for m in ("qaic", "warm", "per-layer", "inductor", "floor"):
        if m in samples:
            for L in layers:
                if samples[m][L]:
                    split_rows.append([m, L, median_of(samples[m][L], "dynamo_s"), median_of(samples[m][L], "backend_s")])
    split_table = markdown_table(["method", "layers", "Dynamo trace (s)", "backend (s)"], split_rows)

    # Flatness is measured from 2 layers (the definition), else the shallowest.
    hi = max(layers)
    lo = 2 if 2 in layers and hi > 2 else min(layers)
    ratios, verdicts = {}, {}

    def ratio(name, num, den):
        if num is not None and den is not None and den > 0:
            ratios[name] = num / den
            verdicts[name] = TARGETS[name][1](ratios[name])

    if "qaic" in med:
        ratio("flatness", med["qaic"][hi], med["qaic"][lo])
        ratio("per_layer", med.get("per-layer", {}).get(hi), med["qaic"][hi])
        ratio("inductor", med.get("inductor", {}).get(hi), med["qaic"][hi])
        ratio("onnx", med.get("onnx", {}).get(hi), med["qaic"][hi])
        if "floor" in med and med["floor"][hi] is not None:
            piece = median_of(samples["qaic"][hi], "max_piece_lowering_s") or 0.0
            ratio("floor", med["qaic"][hi], med["floor"][hi] + piece)
    if "warm" in med and "floor" in med:
        ratio("warm", med["warm"][hi], med["floor"][hi])
    names = {"flatness": f"qaic({hi})/qaic({lo})", "per_layer": f"per-layer({hi})/qaic({hi})",
             "inductor": f"inductor({hi})/qaic({hi})", "onnx": f"onnx_export({hi})/qaic({hi})",
             "floor": f"qaic({hi})/(floor({hi}) + one piece's lowering)", "warm": f"warm({hi})/floor({hi})"}
    ratio_lines = [f"{names[k]:<45} {v:6.2f}   target {TARGETS[k][0]}: {'met' if verdicts[k] else 'MISSED'}"
                   for k, v in ratios.items()]
    md = ("### Cold start: seconds from the first compiled call to its first output (median)\n\n" + table +
          "\n### Where the time goes (median)\n\n" + split_table + "\n### Ratios\n\n```\n" + "\n".join(ratio_lines) +
          "\n```\n")
    print("\n" + md)
    suffix = ("_smoke" if args.smoke else ("_quick" if args.quick else "")) + (f"_{args.tag}" if args.tag else "")
    out_dir = args.results_dir
    path = save_results(f"cold_start{suffix}", {
        "layers": layers, "methods": methods, "repeats": repeats, "expensive_repeats": exp_repeats, "hidden": hidden, "vocab": vocab,
        "median_first_call_s": med, "ratios": ratios, "targets_met": verdicts,
        "samples": samples}, md, out_dir)
    plot(med, layers, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(med: dict, layers: list[int], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, by_l in med.items():
        xs = [L for L in layers if by_l.get(L) is not None]
        if not xs:
            continue
        ax.plot(xs, [by_l[L] for L in xs], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xticks(layers, [str(L) for L in layers])
    ax.set_xlabel("layers")
    ax.set_ylabel("seconds to first output (median)")
    ax.set_title("Cold-start compile time vs depth")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
