"""A decode step at a short compute-context length (CCL) against the full context, on
ONNX Runtime at ctx_len 4096, side by side in one run.

Two continuous-batching exports of one model (--layers layers of the demo's Llama,
hidden 512, random weights; --slots rows, ctx_len 4096):

  full   no CCL: every decode step reads all 4096 cached positions of each row
  ccl    comp_ctx_lengths_decode [1024, 2048] (specializations 1024, 2048, 4096): a step
         whose highest position fits 1024 runs the 1024 specialization, reading a quarter
         of the KV

Each is driven the way the served decode session runs it (``OrtSession``: KV bound in
place, no copies in or out), with every row decoding at position --position (900 by
default, inside CCL 1024). Steps alternate between the two sessions, --steps each; the
medians are reported with the KV bytes each step reads.

    python benchmarks/ccl_decode.py [--quick] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import demo_llama, markdown_table, save_results  # noqa: E402

CTX = 4096


def session(export_dir: Path, slots: int):
    """The decode session of an export, on zeroed KV buffers of ``slots`` rows."""
    import torch

    from qaic_dynamo.deploy.serving import ExportedModel, OrtSession

    model = ExportedModel(export_dir)
    s = OrtSession(model, "decode", threads=2)
    buffers = {n: torch.zeros(shape, dtype=model.dtype) for n, shape in model.buffer_shapes(slots).items()}
    s.set_data_with_slices(buffers, {})
    kv_bytes_per_position = sum(t[0, :, 0].numel() * t.element_size() for t in buffers.values())
    return s, kv_bytes_per_position


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers, 5 steps (tests)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--position", type=int, default=900)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--results-dir", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.vocab, args.steps = 2, 512, 5

    from qaic_dynamo.deploy.export import export_for_qaic
    from qaic_dynamo.engine import Request

    model = demo_llama(args.layers, args.hidden_size, args.vocab, max_position_embeddings=CTX)
    common = dict(full_batch_size=args.slots, prefill_seq_len=128, ctx_len=CTX, run_compiler=False)
    with tempfile.TemporaryDirectory(prefix="qaic-ccl-") as tmp:
        full = export_for_qaic(model, Path(tmp) / "full", **common)
        ccl = export_for_qaic(model, Path(tmp) / "ccl", comp_ctx_lengths_decode=[1024, 2048], **common)
        sessions = {"full": session(full.export_dir, args.slots), "ccl": session(ccl.export_dir, args.slots)}
        lengths = {
            "full": CTX,
            "ccl": sessions["ccl"][0].model.ccl(ccl.comp_ctx_lengths_decode, args.position + 1, CTX, "decode"),
        }
        requests = [
            Request(i, [1] * args.position, 2, output_token_ids=[1], block_ids=[i], num_computed_tokens=args.position)
            for i in range(args.slots)
        ]
        times: dict[str, list[float]] = {k: [] for k in sessions}
        for name, (s, _) in sessions.items():
            s.decode(requests)  # warm-up
        for _ in range(args.steps):  # interleaved: drift hits both alike
            for name, (s, _) in sessions.items():
                t0 = time.perf_counter()
                s.decode(requests)
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    read = {k: lengths[k] * sessions[k][1] * args.slots for k in sessions}
    rows = [[k, lengths[k], f"{read[k] / 2**20:.1f}", med[k] * 1e3] for k in sessions]
    ratio = med["full"] / med["ccl"]
    md = (
        f"### Decode step at a short compute-context length (ONNX Runtime, ctx_len {CTX}, {args.slots} rows at "
        f"position {args.position}, {args.layers}-layer Llama hidden {args.hidden_size}; median of {args.steps} "
        "steps)\n\n"
        + markdown_table(["export", "context read", "KV read per step (MiB)", "decode step (ms)"], rows)
        + f"\nfull / ccl decode step time = {ratio:.2f} (KV read {read['full'] / read['ccl']:.0f}x less)\n"
    )
    print("\n" + md)
    path = save_results(
        "ccl_decode" + ("_quick" if args.quick else ""),
        {
            "layers": args.layers,
            "hidden": args.hidden_size,
            "slots": args.slots,
            "position": args.position,
            "ctx_len": CTX,
            "context_read": lengths,
            "kv_bytes_read": read,
            "median_s": med,
            "steps_s": times,
        },
        md,
        args.results_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
