"""Cold-start compile time against model depth, side by side, in one run.

For each depth L and method, one *fresh process* compiles the demo's Llama-architecture
transformers model (hidden 512, GQA, random weights) with every cache (torch inductor,
Triton, qaic_dynamo) pointed at a new empty directory, and measures the wall seconds from
the first compiled call to its first output (a prefill of 2 x 32 tokens), split into
Dynamo tracing and backend time. Methods:

  regional   qaic_dynamo.compile (what LLM(backend="qaic") does): the decoder block is
             traced and lowered once, embeddings / norm / head are regions of their own
  qaic       torch.compile(model, backend="qaic") on the whole model (Dynamo traces every
             layer; the backend lowers 3 unique pieces)
  per-layer  the whole-model compile with per-layer names (layer_agnostic_kv_update=False)
  inductor   backend="inductor" on the same model
  floor      backend="eager": Dynamo alone, the floor no backend can beat
  onnx       a whole-model torch.onnx.export(dynamo=True) at the same depth (plain
             transformers with SDPA): what a QEfficient-style flow pays to get ONNX
  regional-traced  regional without saved traces (precompile=False): the cold start
             before precompiled regions, against which ``regional``'s extra cost is read
  warm       regional-traced in a second fresh process whose persistent cache a first
             (unmeasured) regional-traced process filled: a restart that traces every
             region with Dynamo again and loads the pieces from disk
  regional-unfrozen  regional with LLM(freeze_gc_heap=False): the start-up heap left in
             the cyclic collector's generations, so each full collection re-scans it
  aot-warm   regional in a second fresh process after a first regional one: a restart
             that loads each region's saved Dynamo trace (precompile) and traces nothing;
             after its measured calls it also times the compiled and the eager forward
             and the forward's matmul floor (``forward_floor.forward_floors``)

Figures are medians over --repeats fresh processes; per-layer, inductor and onnx run only
at --expensive-layers. Prints a table and the ratios of the targets of issues 10 and 39,
writes JSON + markdown to benchmarks/results/ and a PNG plot (log axes).

"Dynamo trace" is what is left of the first call after the backend and one forward (the
second call's time), so it includes Dynamo's guards and the regions' dispatch.

    python benchmarks/cold_start.py [--quick] [--repeats 3] [--layers 2 8 32 64 128]

To re-render the report of an earlier run without measuring: ``--repeats 0 --merge
RUN.json`` with that run's ``--layers``, ``--methods`` and ``--tag``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

METHODS = [
    "regional",
    "regional-traced",
    "regional-unfrozen",
    "qaic",
    "warm",
    "aot-warm",
    "per-layer",
    "inductor",
    "floor",
    "onnx",
]
REGIONAL = ("regional", "regional-traced", "regional-unfrozen", "warm", "aot-warm")
#: The regional methods that save and load traces (precompile) and the ones that do not.
PRECOMPILED = ("regional", "regional-unfrozen", "aot-warm")
EXPENSIVE = {"per-layer", "inductor", "onnx"}
TARGETS = {  # name: (description, predicate on the figure)
    "flat_32": ("regional(32)/regional(2) <= 1.2", lambda r: r <= 1.2),
    "flat_128": ("regional(128)/regional(2) <= 1.5", lambda r: r <= 1.5),
    "vs_floor": ("regional(32)/floor(32) <= 0.25", lambda r: r <= 0.25),
    "inductor": ("inductor(32)/regional(32) >= 15", lambda r: r >= 15),
    "per_layer": ("per-layer(32)/regional(32) >= 20", lambda r: r >= 20),
    "piece": ("one unique piece's lowering, median <= 0.3 s", lambda r: r <= 0.3),
    "backend": ("qaic(32) - floor(32) <= 1.5 s", lambda r: r <= 1.5),
    "warm": ("warm(32) <= 1.5 s", lambda r: r <= 1.5),
    "aot_warm": ("aot-warm(32) <= 0.3 s", lambda r: r <= 0.3),
    "aot_warm_128": ("aot-warm(128) <= 0.35 s", lambda r: r <= 0.35),
    "aot_vs_cold": ("aot-warm(32)/regional(32) <= 0.15", lambda r: r <= 0.15),
    "aot_cold_cost_2": ("regional(2)/regional-traced(2) <= 1.05", lambda r: r <= 1.05),
    "aot_cold_cost": ("regional(32)/regional-traced(32) <= 1.05", lambda r: r <= 1.05),
    "aot_cold_cost_128": ("regional(128)/regional-traced(128) <= 1.05", lambda r: r <= 1.05),
}


# --- the child: one measurement in a clean process ------------------------------------------


def child(method: str, layers: int, hidden: int, vocab: int) -> dict:
    import torch

    from qaic_dynamo.demo import DEFAULT_LLAMA
    from qaic_dynamo.models import hf_config, hf_model_from_config

    cfg = dict(
        DEFAULT_LLAMA,
        num_hidden_layers=layers,
        hidden_size=hidden,
        vocab_size=vocab,
        intermediate_size=hidden * 11 // 4,
    )
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
        torch.onnx.export(
            Logits(model).eval(),
            (ids.unsqueeze(0),),
            dynamo=True,
            optimize=False,
            verbose=False,
            dynamic_shapes=({1: torch.export.Dim.DYNAMIC},),
        )
        result.update(first_call_s=time.perf_counter() - t0, backend_s=None, dynamo_s=None)
        return result

    from qaic_dynamo import build_attention_metadata, compilation_counter, set_forward_context
    from qaic_dynamo.engine import LLM

    llm = LLM(
        model,
        backend="eager",
        layer_agnostic_kv_update=(method != "per-layer"),
        max_num_seqs=2,
        max_model_len=64,
        freeze_gc_heap=(method != "regional-unfrozen"),
    )
    backend_s = [0.0]
    qaic_methods = ("qaic", "per-layer", *REGIONAL)

    def timed(inner):
        def backend(gm, example_inputs):
            t = time.perf_counter()
            out = inner(gm, example_inputs)
            backend_s[0] += time.perf_counter() - t
            return out

        return backend

    if method in REGIONAL:
        import qaic_dynamo

        compiled = qaic_dynamo.compile(llm.model, precompile=method in PRECOMPILED)
    else:
        if method in ("qaic", "per-layer"):
            from qaic_dynamo.compiler import qaic_backend

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
    collections = []  # [start, end, generation] of each cyclic collection in the first call

    def on_gc(phase, info):
        if phase == "start":
            collections.append([time.perf_counter(), None, info["generation"]])
        elif collections:
            collections[-1][1] = time.perf_counter()

    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    try:
        call(compiled)
    finally:
        first = time.perf_counter() - t0
        gc.callbacks.remove(on_gc)
    t0 = time.perf_counter()
    call(compiled)
    run = time.perf_counter() - t0
    if method == "aot-warm":  # what a first call that loads can cost at best: one forward
        from forward_floor import forward_floors

        result.update(forward_floors(llm.model, call, compiled, tokens=len(ids), rows=len(idx)))
    if method in REGIONAL:  # the backend calls of every region
        from qaic_dynamo.compiler import compile_reports

        backend_s[0] = sum(r.seconds["total"] for r in compile_reports())
    result.update(
        first_call_s=first,
        backend_s=backend_s[0],
        run_s=run,
        compile_s=first - run,  # the first call less one forward: what compiling added
        gc_s=sum(end - start for start, end, _ in collections if end is not None),
        full_collections=sum(1 for c in collections if c[2] == 2),
        dynamo_s=max(0.0, first - backend_s[0] - run),
        unique_pieces=compilation_counter.num_backend_compilations - before.num_backend_compilations,
        onnx_exports=compilation_counter.num_onnx_exports - before.num_onnx_exports,
        disk_hits=compilation_counter.num_disk_cache_hits - before.num_disk_cache_hits,
        precompiled_loads=compilation_counter.num_precompiled_loads - before.num_precompiled_loads,
        gc_freeze_s=llm.gc_freeze_seconds,  # before the measured call: in LLM(...), once per process
    )
    if method in qaic_methods:
        from qaic_dynamo.cache import Source
        from qaic_dynamo.compiler import compile_reports

        pieces = [p for r in compile_reports() for p in r.pieces]
        lowered = [p.compile_seconds for p in pieces if p.source is Source.LOWERED]  # export + checks + save
        result["piece_lowering_s"] = lowered
        result["median_piece_lowering_s"] = statistics.median(lowered) if lowered else None
        result["pieces"] = len(pieces)
        result["graphs"] = compilation_counter.num_graphs_seen - before.num_graphs_seen
        result["exporter_fallbacks"] = compilation_counter.num_exporter_fallbacks - before.num_exporter_fallbacks
    return result


def run_child(method: str, layers: int, hidden: int, vocab: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="qaic-cold-") as tmp:
        env = dict(os.environ)
        env.update(
            TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor",
            TRITON_CACHE_DIR=f"{tmp}/triton",
            QAIC_DYNAMO_CACHE_DIR=f"{tmp}/qaic",
            XDG_CACHE_HOME=f"{tmp}/xdg",
            TMPDIR=tmp,
        )

        def cmd(m):
            return [
                sys.executable,
                __file__,
                "--child",
                m,
                "--layers",
                str(layers),
                "--hidden-size",
                str(hidden),
                "--vocab",
                str(vocab),
            ]

        if method in ("warm", "aot-warm"):  # a first process fills the cache; the measured one restarts
            filler = "regional" if method == "aot-warm" else "regional-traced"
            first = subprocess.run(cmd(filler), env=env, capture_output=True, text=True, timeout=timeout)
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
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 64, 128])
    ap.add_argument(
        "--expensive-layers",
        type=int,
        nargs="+",
        default=[32],
        help="depths at which per-layer, inductor and onnx are measured",
    )
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--expensive-repeats",
        type=int,
        default=None,
        help="repeats for per-layer, inductor and onnx (default: --repeats)",
    )
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--results-dir", type=Path, default=None)
    ap.add_argument("--tag", default="", help="suffix for the result files (e.g. 'warm')")
    ap.add_argument(
        "--merge",
        type=Path,
        default=None,
        help="an earlier result JSON whose samples are added; a (method, depth) measured now keeps the new samples",
    )
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers[0], args.hidden_size, args.vocab)))
        return

    from common import markdown_table, plot_by_depth, save_results

    layers, repeats, hidden, vocab = args.layers, args.repeats, args.hidden_size, args.vocab
    expensive_layers = set(args.expensive_layers)
    if args.quick:
        layers, repeats, expensive_layers = [2, 8], 1, {8}
    if args.smoke:
        layers, repeats, hidden, vocab, expensive_layers = [1, 2], 1, 64, 512, {2}
    print(
        f"cold start: layers {layers}, methods {args.methods}, hidden {hidden}, vocab {vocab}, median of "
        f"{repeats} fresh process(es) each ({args.expensive_repeats or repeats} for per-layer, inductor, onnx)",
        flush=True,
    )
    samples: dict[str, dict[int, list[dict]]] = {m: {L: [] for L in layers} for m in args.methods}
    expensive = EXPENSIVE
    exp_repeats = args.expensive_repeats if args.expensive_repeats is not None else repeats
    for r in range(max(repeats, exp_repeats)):
        for L in layers:
            for m in args.methods:
                if r >= (exp_repeats if m in expensive else repeats) or (m in expensive and L not in expensive_layers):
                    continue
                t0 = time.perf_counter()
                s = run_child(m, L, hidden, vocab, args.timeout)
                samples[m][L].append(s)
                extra = ""
                if m in ("qaic", "per-layer", *REGIONAL):
                    extra = (
                        f", {s['graphs']} graphs, {s['unique_pieces']} lowered, {s['disk_hits']} from disk, "
                        f"{s['exporter_fallbacks']} exporter fallbacks"
                    )
                print(
                    f"  [{r + 1}] {m:>9} L={L:<3} first call {s['first_call_s']:7.2f} s"
                    f"{extra} (process {time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )

    methods = list(args.methods)
    if args.merge is not None:  # e.g. add a separate warm-start run to the full run
        old = json.loads(args.merge.read_text())
        if max(repeats, exp_repeats) == 0:  # only re-rendering: the run's own repeat counts
            repeats, exp_repeats = old["repeats"], old["expensive_repeats"]
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
        for m in ("regional", "qaic"):
            q = samples.get(m, {}).get(L)
            row.append(f"{median_of(q, 'graphs'):.0f} / {median_of(q, 'unique_pieces'):.0f}" if q else "-")
        w = samples.get("warm", {}).get(L)
        row.append(median_of(w, "onnx_exports") if w else "-")
        rows.append(row)
    table = markdown_table(
        ["layers"]
        + [f"{m} (s)" for m in methods]
        + ["regional graphs / pieces lowered", "qaic graphs / pieces lowered", "warm ONNX exports"],
        rows,
    )
    split_rows = []
    for m in METHODS:
        if m in samples and m != "onnx":  # no Dynamo, no backend: nothing to split
            for L in layers:
                if samples[m][L]:
                    split_rows.append(
                        [
                            m,
                            L,
                            median_of(samples[m][L], "dynamo_s"),
                            median_of(samples[m][L], "backend_s"),
                            median_of(samples[m][L], "run_s"),
                            _or_dash(median_of(samples[m][L], "gc_s")),
                            _or_dash(median_of(samples[m][L], "full_collections")),
                            median_of(samples[m][L], "median_piece_lowering_s") or "-",
                        ]
                    )
    # The first call also runs the model once: the second call's time says how much of a
    # first call's growth with depth is the forward itself, not compilation.
    split_table = markdown_table(
        [
            "method",
            "layers",
            "Dynamo trace (s)",
            "backend (s)",
            "second call (s)",
            "GC in first call (s)",
            "full collections",
            "median piece lowering (s)",
        ],
        split_rows,
    )

    # The targets are stated at 2, 32 and 128 layers; a run without a depth skips its rows.
    figures, verdicts = {}, {}

    def figure(name, value):
        if value is not None:
            figures[name] = value
            verdicts[name] = TARGETS[name][1](value)

    def at(m, L):
        return med.get(m, {}).get(L)

    def div(a, b):
        return a / b if a is not None and b else None

    figure("flat_32", div(at("regional", 32), at("regional", 2)))
    figure("flat_128", div(at("regional", 128), at("regional", 2)))
    figure("vs_floor", div(at("regional", 32), at("floor", 32)))
    figure("inductor", div(at("inductor", 32), at("regional", 32)))
    figure("per_layer", div(at("per-layer", 32), at("regional", 32)))
    lowered = [
        t
        for m in ("regional", "qaic")
        for by_l in samples.get(m, {}).values()
        for s in by_l
        for t in s.get("piece_lowering_s", [])
    ]
    figure("piece", statistics.median(lowered) if lowered else None)
    if at("qaic", 32) is not None and at("floor", 32) is not None:
        figure("backend", at("qaic", 32) - at("floor", 32))
    figure("warm", at("warm", 32))
    figure("aot_warm", at("aot-warm", 32))
    figure("aot_warm_128", at("aot-warm", 128))
    figure("aot_vs_cold", div(at("aot-warm", 32), at("regional", 32)))
    figure("aot_cold_cost_2", div(at("regional", 2), at("regional-traced", 2)))
    figure("aot_cold_cost", div(at("regional", 32), at("regional-traced", 32)))
    figure("aot_cold_cost_128", div(at("regional", 128), at("regional-traced", 128)))
    ratio_lines = [
        f"{TARGETS[k][0].split(' <=')[0].split(' >=')[0]:<45} {v:7.2f}   target {TARGETS[k][0]}: "
        f"{'met' if verdicts[k] else 'MISSED'}"
        for k, v in figures.items()
    ]
    ratios = figures
    # Not targets: the same depth ratios with the forward (the second call's time) and the
    # cyclic collector's pauses taken out of each sample. A full collection costs about the
    # same at any depth (the heap is mostly torch and transformers) and lands wherever the
    # allocation count crosses its threshold, inside the first call or just after it.
    diag = {}
    for name, key in (("compile", "compile_s"), ("compile less GC", "compile_less_gc_s")):

        def mid(m, L, key=key):
            vals = [
                (s["compile_s"] - s["gc_s"]) if key == "compile_less_gc_s" else s["compile_s"]
                for s in samples.get(m, {}).get(L, [])
                if s.get("compile_s") is not None and s.get("gc_s") is not None
            ]
            return statistics.median(vals) if vals else None

        for deep in (32, 128):
            v = div(mid("regional", deep), mid("regional", 2))
            if v is not None:
                diag[f"{name}: regional({deep})/regional(2)"] = v
    # What freezing the start-up heap (the engine's default) changes, side by side, and
    # what the full collection before it costs when the engine is made (not in the call).
    freezes = [s["gc_freeze_s"] for by_l in samples.get("regional", {}).values() for s in by_l if s.get("gc_freeze_s")]
    if freezes:
        diag["regional: collect + freeze in LLM(...), median (s)"] = statistics.median(freezes)
    for deep in (32, 128):
        v = div(at("regional-unfrozen", deep), at("regional-unfrozen", 2))
        if v is not None:
            diag[f"unfrozen: regional-unfrozen({deep})/regional-unfrozen(2)"] = v
    for L in layers:
        v = div(at("regional-unfrozen", L), at("regional", L))
        if v is not None:
            diag[f"regional-unfrozen({L})/regional({L})"] = v
    ratio_lines += [f"{k:<45} {v:7.2f}   (diagnostic, not a target)" for k, v in diag.items()]
    # An aot-warm first call is a load plus one forward: how far can the forward go down?
    floor_rows = []
    for L in layers:
        q = [s for s in samples.get("aot-warm", {}).get(L, []) if s.get("matmul_floor_s") is not None]
        if q:
            first, fwd = median_of(q, "first_call_s"), median_of(q, "compiled_run_s")
            floor = median_of(q, "matmul_floor_s")
            floor_rows.append(
                [
                    L,
                    first,
                    fwd,
                    first - fwd,
                    median_of(q, "eager_run_s"),
                    median_of(q, "matmul_gflop"),
                    median_of(q, "gemm_peak_gflops"),
                    floor,
                    floor + first - fwd,
                ]
            )
    floor_md = ""
    if floor_rows:
        floor_md = (
            "\n### aot-warm: the load and the forward (median)\n\n"
            + markdown_table(
                [
                    "layers",
                    "first call (s)",
                    "compiled forward (s)",
                    "load = first - forward (s)",
                    "eager forward (s)",
                    "matmul GFLOP",
                    "2048^3 GEMM (GFLOP/s)",
                    "matmul floor (s)",
                    "floor + load (s)",
                ],
                floor_rows,
            )
            + "\nThe matmul floor is the forward's matrix multiplications at the best rate this "
            "CPU gives one large square GEMM; no forward here is faster.\n"
        )
    md = (
        "### Cold start: seconds from the first compiled call to its first output (median)\n\n"
        + table
        + "\n### Where the time goes (median)\n\n"
        + split_table
        + floor_md
        + "\n### Targets (issues 10 and 39)\n\n```\n"
        + "\n".join(ratio_lines)
        + "\n```\n"
    )
    print("\n" + md)
    suffix = ("_smoke" if args.smoke else ("_quick" if args.quick else "")) + (f"_{args.tag}" if args.tag else "")
    out_dir = args.results_dir
    path = save_results(
        f"cold_start{suffix}",
        {
            "layers": layers,
            "methods": methods,
            "repeats": repeats,
            "expensive_repeats": exp_repeats,
            "hidden": hidden,
            "vocab": vocab,
            "median_first_call_s": med,
            "ratios": ratios,
            "targets_met": verdicts,
            "diagnostics": diag,
            "samples": samples,
        },
        md,
        out_dir,
    )
    plot_by_depth(
        path.with_suffix(".png"),
        layers,
        [(m, by_l, {}) for m, by_l in med.items()],
        "Cold-start compile time vs depth",
        "seconds to first output (median)",
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _or_dash(value: float | None) -> float | str:
    return "-" if value is None else value


if __name__ == "__main__":
    main()
