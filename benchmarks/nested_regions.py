"""Regional compilation against torch.compiler.nested_compile_region, by measurement.

Both avoid re-tracing the repeated decoder block. Each depth runs in a fresh process and
measures the first call (a prefill of 2 x 32 tokens) of the demo's Llama (hidden 512):

  floor     torch.compile(model, backend="eager"): Dynamo traces every layer
  nested    the decoder layer's forward wrapped in nested_compile_region, the whole model
            compiled with backend="eager" (Dynamo traces the block once, then matches it)
  regional  qaic_dynamo.compile (backend="qaic"): the block traced and lowered once

``nested`` and ``floor`` run with backend="eager": the qaic backend does not take the
invoke_subgraph graphs nested regions produce, so their figures are Dynamo's cost alone,
while ``regional`` also pays for lowering its pieces and creating their sessions. The
comparison therefore favours nested regions.

    python benchmarks/nested_regions.py [--layers 2 8 32] [--repeats 3]
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
METHODS = ["floor", "nested", "regional"]


def child(method: str, layers: int) -> dict:
    import torch

    from qaic_dynamo import LLM, build_attention_metadata, set_forward_context
    from qaic_dynamo.demo import DEFAULT_LLAMA
    from qaic_dynamo.models import hf_config, hf_model_from_config

    model = hf_model_from_config(hf_config(dict(DEFAULT_LLAMA, num_hidden_layers=layers)))
    llm = LLM(model, backend="eager", max_num_seqs=2, max_model_len=64)
    if method == "regional":
        import qaic_dynamo

        fn = qaic_dynamo.compile(llm.model)
    else:
        if method == "nested":
            cls = type(llm.model.hf.model.layers[0])
            cls.forward = torch.compiler.nested_compile_region(cls.forward)
        fn = torch.compile(llm.model, backend="eager")
    ids = torch.randint(0, 1000, (64,))
    pos = torch.cat([torch.arange(32), torch.arange(32)])
    idx = torch.tensor([31, 63])
    for t in (ids, pos, idx):
        torch._dynamo.mark_dynamic(t, 0)
    md = build_attention_metadata([32, 32], [32, 32], [[0, 1], [2, 3]], 16)
    with set_forward_context(md, llm.kv_caches, llm.kv_cache_layers), torch.no_grad():
        t0 = time.perf_counter()
        out = fn(ids, pos, idx)
        first = time.perf_counter() - t0
    from torch._dynamo.utils import counters

    return {
        "method": method,
        "layers": layers,
        "first_call_s": first,
        "graphs": counters["stats"]["unique_graphs"],
        "ok": bool(torch.isfinite(out).all()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results-dir", type=Path, default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers[0])))
        return
    from common import markdown_table, save_results

    samples: dict[str, dict[int, list[dict]]] = {m: {L: [] for L in args.layers} for m in METHODS}
    for _ in range(args.repeats):
        for L in args.layers:
            for m in METHODS:
                with tempfile.TemporaryDirectory() as tmp:
                    env = dict(os.environ, QAIC_DYNAMO_CACHE_DIR=f"{tmp}/qaic", TMPDIR=tmp)
                    proc = subprocess.run(
                        [sys.executable, __file__, "--child", m, "--layers", str(L)],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=1800,
                    )
                if proc.returncode != 0:
                    raise RuntimeError(f"{m} at {L} layers failed:\n{proc.stderr[-3000:]}")
                s = json.loads(proc.stdout.strip().splitlines()[-1])
                samples[m][L].append(s)
                print(f"  {m:>8} L={L:<3} first call {s['first_call_s']:6.2f} s, {s['graphs']} graphs", flush=True)
    med = {m: {L: statistics.median(x["first_call_s"] for x in samples[m][L]) for L in args.layers} for m in METHODS}
    rows = [[L] + [med[m][L] for m in METHODS] for L in args.layers]
    lo, hi = min(args.layers), max(args.layers)
    growth = {m: med[m][hi] / med[m][lo] for m in METHODS}
    md = (
        "### Nested compile regions vs regional compilation: first call (s, median)\n\n"
        + markdown_table(["layers"] + [f"{m} (s)" for m in METHODS], rows)
        + "\n"
        + ", ".join(f"{m}({hi})/{m}({lo}) = {g:.2f}" for m, g in growth.items())
        + "\n"
    )
    print("\n" + md)
    path = save_results(
        "nested_regions",
        {"layers": args.layers, "median_first_call_s": med, "growth": growth, "samples": samples},
        md,
        args.results_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
