"""Where backend="qaic" spends its time, for one model.

Cold compile, split into Dynamo tracing and the backend's stages (split, fake
propagation, fingerprint, lowering per unique piece - prepare, aten trace, translation,
checks, save - and session creation); the per-call
overhead of a compiled piece (binding + dispatch) against its compute; and a decode step
at 1x and 8x KV capacity with the same live tokens (it must not grow: the cache is
updated in place).

Target: fingerprinting and reuse cost under 5% of the cold compile.

    python benchmarks/backend_stages.py [--quick] [--layers 16] [--hidden-size 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, piece_call_costs, save_results  # noqa: E402

from qaic_dynamo import build_attention_metadata, set_forward_context  # noqa: E402
from qaic_dynamo.cache import Source  # noqa: E402
from qaic_dynamo.compiler import last_compile_report  # noqa: E402
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM  # noqa: E402


class Batch:
    """Sequences in a paged cache of `num_blocks` blocks (spare capacity stays unused)."""

    def __init__(self, model, prompt_lens, num_blocks, block_size=16):
        self.model, self.block_size = model, block_size
        per_seq = num_blocks // len(prompt_lens)
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompt_lens))]
        shape = model.kv_cache_shape(num_blocks, block_size)
        self.caches = {n: (torch.zeros(shape), torch.zeros(shape)) for n in model.kv_cache_layers}
        self.prompt_lens = prompt_lens
        self.seq_lens = [0] * len(prompt_lens)

    def inputs(self, q_lens):
        self.seq_lens = [s + q for s, q in zip(self.seq_lens, q_lens)]
        ids = torch.randint(0, self.model.config.vocab_size, (sum(q_lens),))
        pos = torch.cat([torch.arange(s - q, s) for s, q in zip(self.seq_lens, q_lens)])
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        md = build_attention_metadata(self.seq_lens, q_lens, self.tables, self.block_size)
        return ids, pos, md

    def run(self, fn, q_lens):
        ids, pos, md = self.inputs(q_lens)
        with set_forward_context(md, self.caches, self.model.kv_cache_layers):
            return fn(ids, pos)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--results-dir", type=Path, default=None)
    args = ap.parse_args()
    layers, hidden = (4, 128) if args.quick else (args.layers, args.hidden_size)
    repeats = 2 if args.quick else 5
    torch.manual_seed(0)
    cfg = QaicLlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
    )
    model = QaicLlamaForCausalLM(cfg).eval()
    print(
        f"model: {layers} layers, hidden {hidden}, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} kv heads",
        flush=True,
    )

    # -- cold compile ------------------------------------------------------------------------
    prompts = [37, 64, 20, 90]
    compiled = torch.compile(model, backend="qaic")
    batch = Batch(model, prompts, num_blocks=64)
    with torch.no_grad():
        t0 = time.perf_counter()
        batch.run(compiled, prompts)
        first_call = time.perf_counter() - t0
        batch2 = Batch(model, prompts, num_blocks=64)
        t0 = time.perf_counter()
        batch2.run(compiled, prompts)  # same shapes, warm: the run itself
        warm_call = time.perf_counter() - t0
    rep = last_compile_report()
    backend_s = rep.seconds["total"]
    dynamo_s = first_call - backend_s - warm_call
    unique = [p for p in rep.pieces if p.source is Source.LOWERED]
    stages = {
        "dynamo trace (first call - backend - one warm run)": dynamo_s,
        "split": rep.seconds["split"],
        "fake propagation": rep.seconds["propagate"],
        "fingerprint (all pieces)": rep.seconds["fingerprint"],
        "lowering: export + checks (unique pieces)": sum(p.compile_seconds for p in unique),
        "session creation (unique pieces)": sum(p.load_seconds for p in unique),
        "backend total": backend_s,
        "cold compile (first call - one warm run)": first_call - warm_call,
    }
    reuse_s = sum(p.seconds for p in rep.pieces if p.source is Source.MEMORY)  # lookups + runner creation
    fp_share = (rep.seconds["fingerprint"] + reuse_s) / (first_call - warm_call)
    print(
        f"cold compile {first_call - warm_call:.2f}s: {len(rep.pieces)} pieces, {len(unique)} compiled, "
        f"{rep.reused} reused",
        flush=True,
    )
    for name, s in stages.items():
        print(f"  {name:<52} {s:8.3f} s")
    steps = ("prepare", "aten_trace", "translate", "checks", "save")
    split_rows = []
    for p in unique:
        sec = json.loads((Path(p.artifact) / "layout.json").read_text())["stats"].get("seconds", {})
        split_rows.append([p.index, p.key] + [sec.get(k, 0.0) * 1e3 for k in steps] + [p.load_seconds * 1e3])
        print(
            f"  piece {p.index:>2} ({p.key}): "
            + ", ".join(f"{k} {sec.get(k, 0.0) * 1e3:.0f} ms" for k in steps)
            + f", session {p.load_seconds * 1e3:.1f} ms"
        )
    print(
        f"fingerprint + reuse = {fp_share * 100:.2f}% of cold compile (target < 5%): "
        + ("met" if fp_share < 0.05 else "MISSED"),
        flush=True,
    )

    # -- per-call overhead of one middle piece -------------------------------------------------
    captured = {}
    runners = rep.runners()
    middle = runners[1]
    handle = middle.register_forward_pre_hook(lambda mod, a: captured.__setitem__("args", a))
    decode = Batch(model, prompts, num_blocks=64)
    with torch.no_grad():
        decode.run(compiled, prompts)
        ids, pos, md = decode.inputs([1] * len(prompts))
        with set_forward_context(md, decode.caches, model.kv_cache_layers) as ctx:
            compiled(ids, pos)
    handle.remove()
    with torch.no_grad(), set_forward_context(md, decode.caches, model.kv_cache_layers) as ctx:
        t_runner, t_bare, t_eager = piece_call_costs(middle, captured["args"], ctx, repeats)
    overhead = t_runner - t_bare
    print(
        f"middle piece, decode batch of {len(prompts)}: runner {t_runner * 1e6:.1f} us = ORT run {t_bare * 1e6:.1f} us "
        f"+ binding/dispatch {overhead * 1e6:.1f} us ({overhead / t_runner * 100:.0f}%); "
        f"eager PyTorch {t_eager * 1e6:.1f} us",
        flush=True,
    )

    # -- decode step versus KV capacity --------------------------------------------------------
    cap = {}
    for mult in (1, 8):
        b = Batch(model, prompts, num_blocks=64 * mult)
        with torch.no_grad():
            b.run(compiled, prompts)
            times = []
            for _ in range(3 if args.quick else 15):
                ids, pos, md = b.inputs([1] * len(prompts))
                with set_forward_context(md, b.caches, model.kv_cache_layers):
                    t0 = time.perf_counter()
                    compiled(ids, pos)
                    times.append(time.perf_counter() - t0)
        cap[f"{mult}x"] = statistics.median(times[1:] if len(times) > 1 else times)
        kv_mib = 2 * len(b.caches) * b.caches[model.kv_cache_layers[0]][0].numel() * 4 / 2**20
        print(
            f"decode step at {mult}x capacity ({kv_mib:.0f} MiB of KV): {cap[f'{mult}x'] * 1e3:.2f} ms (median)",
            flush=True,
        )
    ratio = cap["8x"] / cap["1x"]
    print(f"decode 8x / 1x capacity: {ratio:.2f}")

    md_out = markdown_table(["stage", "seconds"], [[k, v] for k, v in stages.items()])
    md_out += "\n" + markdown_table(["piece", "key"] + [f"{k} (ms)" for k in steps] + ["session (ms)"], split_rows)
    md_out += "\n" + markdown_table(
        ["measure", "value"],
        [
            ["fingerprint + reuse share of cold compile", f"{fp_share * 100:.2f}%"],
            ["middle piece runner (us)", t_runner * 1e6],
            ["ORT run alone (us)", t_bare * 1e6],
            ["binding + dispatch (us)", overhead * 1e6],
            ["eager PyTorch piece (us)", t_eager * 1e6],
            ["decode step 1x capacity (ms)", cap["1x"] * 1e3],
            ["decode step 8x capacity (ms)", cap["8x"] * 1e3],
            ["8x / 1x", ratio],
        ],
    )
    path = save_results(
        "backend_stages" + ("_quick" if args.quick else ""),
        {
            "layers": layers,
            "hidden": hidden,
            "stages": stages,
            "fingerprint_reuse_share": fp_share,
            "unique_pieces": [
                {"index": p.index, "key": p.key, "export_s": p.compile_seconds, "session_s": p.load_seconds}
                for p in unique
            ],
            "lowering_split_ms": [dict(zip(["index", "key", *steps, "session"], row)) for row in split_rows],
            "piece_call_us": {
                "runner": t_runner * 1e6,
                "ort_run": t_bare * 1e6,
                "overhead": overhead * 1e6,
                "eager": t_eager * 1e6,
            },
            "decode_step_ms": {k: v * 1e3 for k, v in cap.items()},
            "decode_8x_over_1x": ratio,
        },
        md_out,
        args.results_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
