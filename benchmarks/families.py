"""Cold start and unique compilations of the families that need more than plain
attention (issue 13): Gemma2 (soft-capping, alternating windows), GPT-OSS (sinks,
mixture of experts) and Qwen2-MoE, at 2 and 8 layers, side by side in one run.

Each figure is one fresh process (an empty qaic cache) running ``LLM(model,
backend="qaic")`` (regional compile) on two prompts for one token: the seconds of that
first call, the Dynamo graphs and the unique pieces lowered. Medians over --repeats.
Models are built from small configs (hidden 256, random weights).

    python benchmarks/families.py [--quick] [--repeats 3] [--layers 2 8]
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
from common import markdown_table, save_results  # noqa: E402

FAMILIES = ["gemma2", "gpt_oss", "qwen2_moe", "llama"]


def build(family: str, layers: int, hidden: int):
    import transformers

    from qaic_dynamo.models import hf_model_from_config

    small = dict(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
    )
    cfg = {
        "llama": lambda: transformers.LlamaConfig(**small),
        "gemma2": lambda: transformers.Gemma2Config(head_dim=hidden // 4, sliding_window=64, **small),
        "gpt_oss": lambda: transformers.GptOssConfig(
            head_dim=hidden // 4, num_local_experts=8, num_experts_per_tok=2, sliding_window=64, **small
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden,
            shared_expert_intermediate_size=hidden,
            **small,
        ),
    }[family]()
    return hf_model_from_config(cfg)


def child(family: str, layers: int, hidden: int) -> dict:
    from qaic_dynamo import LLM, compilation_counter

    model = build(family, layers, hidden)
    llm = LLM(model, backend="qaic", max_num_seqs=2, max_model_len=128)
    before = compilation_counter.snapshot()
    t0 = time.perf_counter()
    llm.generate([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]], 1)
    seconds = time.perf_counter() - t0
    return {
        "first_call_s": seconds,
        "graphs": compilation_counter.num_graphs_seen - before.num_graphs_seen,
        "unique_pieces": compilation_counter.num_backend_compilations - before.num_backend_compilations,
        "eager_fallbacks": compilation_counter.num_eager_fallbacks - before.num_eager_fallbacks,
    }


def run_child(family: str, layers: int, hidden: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="qaic-families-") as tmp:
        env = dict(os.environ, QAIC_DYNAMO_CACHE_DIR=f"{tmp}/qaic", TMPDIR=tmp)
        proc = subprocess.run(
            [sys.executable, __file__, "--child", family, "--layers", str(layers), "--hidden-size", str(hidden)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{family} at {layers} layers failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=FAMILIES, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="hidden 64, depths 2 and 3, one repeat (tests)")
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=FAMILIES)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results-dir", type=Path, default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers[0], args.hidden_size)))
        return
    if args.quick:
        args.layers, args.repeats, args.hidden_size = [2, 3], 1, 64
    samples: dict[str, dict[int, list[dict]]] = {f: {L: [] for L in args.layers} for f in args.families}
    for rep in range(args.repeats):
        for L in args.layers:
            for f in args.families:
                r = run_child(f, L, args.hidden_size)
                samples[f][L].append(r)
                print(
                    f"  [{rep + 1}] {f:>9} L={L}: first call {r['first_call_s']:.2f} s, {r['graphs']} graphs, "
                    f"{r['unique_pieces']} unique pieces, {r['eager_fallbacks']} eager fallbacks",
                    flush=True,
                )
    rows = []
    for f in args.families:
        for L in args.layers:
            s = samples[f][L]
            rows.append(
                [
                    f,
                    L,
                    statistics.median(x["first_call_s"] for x in s),
                    s[0]["graphs"],
                    s[0]["unique_pieces"],
                    max(x["eager_fallbacks"] for x in s),
                ]
            )
    md = (
        f"### Families: cold start of LLM(backend='qaic') (median of {args.repeats} fresh processes, hidden "
        f"{args.hidden_size})\n\n"
        + markdown_table(
            ["family", "layers", "first call (s)", "Dynamo graphs", "unique pieces lowered", "eager fallbacks"], rows
        )
    )
    print("\n" + md)
    path = save_results(
        "families" + ("_quick" if args.quick else ""),
        {
            "layers": args.layers,
            "hidden": args.hidden_size,
            "repeats": args.repeats,
            "samples": {f: {str(L): v for L, v in d.items()} for f, d in samples.items()},
        },
        md,
        args.results_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
