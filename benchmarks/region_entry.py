"""Where a decode step's time goes, regional against whole-model compile, per layer.

Issue 10 asks that regional compilation (LLM's default) not make decode slower than the
whole-model compile; at batch 8 it still is (docs/benchmarks.md). This profile says where
the difference is, with both engines built side by side in one process on the same model:

* ONNX Runtime time per artifact (``PieceRunner.run_bound``): a regional layer runs two
  pieces (pre-attention with the KV update, post-attention), a whole-model layer one
  (post-attention of layer i fused with pre-attention of layer i+1);
* the Python around each run: binding (``PieceRunner.bind``) and the rest of the
  runner's call;
* for regional only, entering a block: ``GuardedDispatch.lookup`` and, inside it,
  Dynamo's guard check (``GuardManagerWrapper.check``);
* the same lookup and guard check timed in a tight loop on one layer's captured frame
  locals ("hot"), against their median inside steps ("in step"), where every layer's
  weights have just streamed through the caches.

Each method is wrapped with a timer (about 0.1 us per call) only during the timed steps.
Figures are medians over the calls of --rounds interleaved rounds of --steps steps.

With ``--dict-tags`` the regional engine is compiled with Dynamo's
``use_recursive_dict_tags_for_guards`` (off by default; made for regional compilation: a
block's guard subtrees pass on the unchanged dict version tags of up to 256 recorded
modules). Both engines of a process share Dynamo's cache of the block's code, so that is
a run of its own, not a third engine beside these two.

    python benchmarks/region_entry.py [--layers 16] [--batch 8] [--rounds 5] [--steps 40] [--dict-tags]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, save_results  # noqa: E402
from decode_latency import CONTEXT, build, case_batch  # noqa: E402


class Timers:
    """Wraps methods with per-call timers, on only while :attr:`on`."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, list[int]] = collections.defaultdict(list)

    def wrap(self, cls: type, name: str, key, restore: list) -> None:
        orig = getattr(cls, name)
        restore.append((cls, name, orig))

        def timed(*a, **k):
            if not self.on:
                return orig(*a, **k)
            t = time.perf_counter_ns()
            try:
                return orig(*a, **k)
            finally:
                self.calls[key(a) if callable(key) else key].append(time.perf_counter_ns() - t)

        setattr(cls, name, timed)


def hot_lookup_costs(llm, batch, repeats: int = 2000) -> dict[str, float]:
    """Median us of one middle block's lookup and guard check, repeated back to back."""
    from qaic_dynamo import build_attention_metadata, set_forward_context
    from qaic_dynamo.compiler.regions import CompiledRegion

    blocks = [
        m for m in llm.model.modules() if isinstance(m, CompiledRegion) and m.dispatch is not None and m.dispatch.method
    ]
    block = blocks[len(blocks) // 2]
    d = block.dispatch
    seen = {}
    orig = d._frame_locals

    def capture(args, kwargs):
        seen["args"], seen["f_locals"] = (args, kwargs), orig(args, kwargs)
        return seen["f_locals"]

    d._frame_locals = capture  # instance attribute: this block only
    try:
        llm.execute_model(batch)
    finally:
        del d._frame_locals
    entry = next(e for e in d._internals.cache_entries(d.code, d.isolate_recompiles_id) if e.backend is not None)
    md = build_attention_metadata(
        [CONTEXT] * len(batch), [1] * len(batch), [r.block_ids for r in batch], llm.block_size
    )
    # Subtrees Dynamo skips on matching dict tags (none unless compiled with --dict-tags).
    out = {"tag_safe_roots": str(entry.guard_manager).count("tag_safe=(True, True)")}
    with torch.no_grad(), set_forward_context(md, llm.kv_caches, llm.kv_cache_layers):
        assert entry.guard_manager.check(seen["f_locals"]), "the captured frame's guards must pass"
        assert d.lookup(*seen["args"]) is not None, "the captured call must be dispatched"
        for name, fn in (
            ("guard check", lambda: entry.guard_manager.check(seen["f_locals"])),
            ("lookup", lambda: d.lookup(*seen["args"])),
        ):
            ts = []
            for _ in range(repeats):
                t = time.perf_counter_ns()
                fn()
                ts.append(time.perf_counter_ns() - t)
            out[name] = statistics.median(ts) / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="small model, few steps (a smoke run)")
    ap.add_argument("--results-dir", type=Path, default=None)
    ap.add_argument("--tag", default="", help="suffix for the result files (region_entry_<tag>.*)")
    ap.add_argument(
        "--dict-tags",
        action="store_true",
        help="compile the regional engine with Dynamo's use_recursive_dict_tags_for_guards",
    )
    args = ap.parse_args()
    import torch._dynamo.guards as dynamo_guards

    from qaic_dynamo import LLM
    from qaic_dynamo.compiler.regions import GuardedDispatch
    from qaic_dynamo.runtime import PieceRunner

    layers, hidden, vocab, rounds, steps = args.layers, args.hidden_size, args.vocab, args.rounds, args.steps
    if args.quick:
        layers, hidden, vocab, rounds, steps = 2, 64, 512, 2, 5
        args.tag = args.tag or "quick"
    model = build(layers, hidden, vocab)
    engines = {
        name: LLM(
            model, max_num_seqs=args.batch, max_model_len=CONTEXT + 8, block_size=16, backend="qaic", regional=regional
        )
        for name, regional in (("regional", True), ("whole", False))
    }
    print(
        f"model: {layers} layers, hidden {hidden}, vocab {vocab}; decode batch {args.batch} at {CONTEXT} tokens; "
        f"{rounds} rounds x {steps} steps",
        flush=True,
    )

    timers = {name: Timers() for name in engines}  # each engine's calls
    restore: list = []
    one = Timers()  # the wrappers; their calls go to the engine being timed

    def key_of_run(a):
        runner = a[0]
        return ("ORT run", runner.artifact.path.name[:8], bool(runner.artifact.layout.kv_updates))

    for cls, name, key in (
        (PieceRunner, "run_bound", key_of_run),
        (PieceRunner, "bind", "bind"),
        (PieceRunner, "forward", "runner call"),
        (GuardedDispatch, "lookup", "lookup"),
        (dynamo_guards.GuardManagerWrapper, "check", "guard check"),
    ):
        one.wrap(cls, name, key, restore)
    samples = {name: [] for name in engines}
    hot = {}
    try:
        with contextlib.ExitStack() as stack:
            batches = {
                name: stack.enter_context(case_batch(llm, "decode", args.batch)) for name, llm in engines.items()
            }
            for name, llm in engines.items():
                # Dynamo reads the flag when it builds a frame's guards, i.e. while compiling.
                with torch._dynamo.config.patch(
                    use_recursive_dict_tags_for_guards=args.dict_tags and name == "regional"
                ):
                    for _ in range(3):  # compile, then warm up
                        llm.execute_model(batches[name])
            hot = hot_lookup_costs(engines["regional"], batches["regional"])
            for _ in range(rounds):
                for name, llm in engines.items():
                    one.calls = timers[name].calls
                    one.on = True
                    for _ in range(steps):
                        t = time.perf_counter_ns()
                        llm.execute_model(batches[name])
                        samples[name].append(time.perf_counter_ns() - t)
                    one.on = False
    finally:
        for cls, name, orig in reversed(restore):
            setattr(cls, name, orig)

    n_steps = rounds * steps
    rows, payload = (
        [],
        {
            "dict_tags": args.dict_tags,
            "layers": layers,
            "hidden": hidden,
            "vocab": vocab,
            "batch": args.batch,
            "rounds": rounds,
            "steps": steps,
            "hot_us": hot,
            "engines": {},
        },
    )
    for name in engines:
        step_ms = statistics.median(samples[name]) / 1e6
        per = {}
        rows.append([name, "step", "", f"{step_ms:.2f} ms", ""])
        for key, ts in sorted(timers[name].calls.items(), key=lambda kv: str(kv[0])):
            label = key if isinstance(key, str) else f"ORT run {key[1]}" + (" (KV update)" if key[2] else "")
            calls, med, total = len(ts) / n_steps, statistics.median(ts) / 1e3, sum(ts) / n_steps / 1e6
            per[label] = {"calls_per_step": calls, "median_us": med, "ms_per_step": total}
            rows.append([name, label, f"{calls:.0f}", f"{med:.0f} us", f"{total:.2f}"])
        payload["engines"][name] = {"step_ms": step_ms, "per_call": per}
    md = (
        f"### Decode batch {args.batch} step, regional against whole-model compile ({layers} layers, hidden "
        f"{hidden}; medians over {rounds} x {steps} steps)\n\n"
        + markdown_table(["engine", "what", "calls/step", "median per call", "ms/step"], rows)
    )
    reg, whole = payload["engines"]["regional"], payload["engines"]["whole"]
    ort = {
        n: sum(v["ms_per_step"] for k, v in e["per_call"].items() if k.startswith("ORT run"))
        for n, e in (("regional", reg), ("whole", whole))
    }
    payload["ort_ms_per_step"] = ort
    lines = [
        f"step: regional {reg['step_ms']:.2f} ms, whole {whole['step_ms']:.2f} ms "
        f"(regional / whole {reg['step_ms'] / whole['step_ms']:.3f})",
        f"ONNX Runtime per step: regional {ort['regional']:.2f} ms, whole {ort['whole']:.2f} ms",
    ]
    if hot and "lookup" in reg["per_call"]:
        lines.append(
            f"block lookup: {reg['per_call']['lookup']['median_us']:.0f} us in step vs {hot['lookup']:.1f} us hot; "
            f"its guard check {reg['per_call']['guard check']['median_us']:.0f} us in step vs "
            f"{hot['guard check']:.1f} us hot; {hot['tag_safe_roots']} tag-safe guard subtrees"
        )
    for line in lines:
        print(line)
    md += "\n" + "\n\n".join(lines) + "\n"
    print(md)
    save_results("region_entry" + (f"_{args.tag}" if args.tag else ""), payload, md, args.results_dir)


if __name__ == "__main__":
    main()
