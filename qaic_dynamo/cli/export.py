"""``qaic-dynamo export``: export a model for a Cloud AI 100 card, and validate it."""

from __future__ import annotations

import argparse
import sys
import time

from qaic_dynamo.cli.common import model_arg
from qaic_dynamo.demo import positive_int

__all__ = ["add_export_arguments", "export_command", "onnx_vocab", "validate"]


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="llama",
        help="llama | qwen2 | mistral | mla (built-in configs, random weights) or a local model directory",
    )
    p.add_argument("--out", required=True, help="output root; the export goes to OUT/<hash>/")
    p.add_argument("--layers", type=positive_int, default=None, help="built-in models: number of layers (default 16)")
    p.add_argument(
        "--hidden-size",
        type=positive_int,
        default=None,
        help="built-in models: hidden size (default 512; a multiple of the 8 attention heads)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1, help="decode batch size")
    p.add_argument("--prefill-seq-len", type=int, default=32)
    p.add_argument("--ctx-len", type=int, default=128)
    p.add_argument("--kv-cache-prefix", default=None, help="alphanumeric infix for the KV buffer names")
    p.add_argument(
        "--layerwise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lower one decoder block and stitch it (default) or export the whole model",
    )
    p.add_argument(
        "--kv-precision",
        choices=["float16", "bfloat16", "mxint8"],
        default=None,
        help="custom_io precision of the KV buffers (default: the exported dtype's on the card)",
    )
    p.add_argument("--mxint8-kv", action="store_true", help="mxint8 KV buffers (--kv-precision mxint8)")
    p.add_argument(
        "--hw",
        choices=["ai100", "ai200"],
        default="ai100",
        help="card generation (-aic-hw-version); ai100 exports a bfloat16 checkpoint in float32, ai200 keeps it",
    )
    p.add_argument(
        "--full-batch-size",
        type=positive_int,
        default=None,
        help="continuous batching: KV rows for this many sequences, a batch_index input names each call's",
    )
    only = p.add_mutually_exclusive_group()
    only.add_argument("--prefill-only", action="store_true", help="the Prefill specializations only")
    only.add_argument("--decode-only", action="store_true", help="the Decode specializations only")
    only.add_argument(
        "--disagg",
        action="store_true",
        help="both, as a prefill/ and decode/ pair over one model (for serve-disagg --export-dir)",
    )
    p.add_argument("--retain-full-kv", action="store_true", help="QEfficient's retain_full_kv (recorded)")
    p.add_argument(
        "--comp-ctx-lengths-prefill",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="N",
        help="compute-context lengths of the Prefill specializations",
    )
    p.add_argument(
        "--comp-ctx-lengths-decode",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="N",
        help="compute-context lengths of the Decode specializations",
    )
    p.add_argument(
        "--ccl-min-length",
        type=positive_int,
        default=1024,
        help="CCL lengths below this are raised to it (QEfficient: 1024)",
    )
    p.add_argument("--num-cores", type=positive_int, default=16, help="-aic-num-cores")
    p.add_argument(
        "--num-devices",
        type=positive_int,
        default=1,
        help="devices to tensor-slice over; > 1 writes mdp_ts_N.json (-mdp-load-partition-config)",
    )
    p.add_argument("--mxfp6-matmul", action="store_true", help="-mxfp6-matmul")
    p.add_argument("--mos", type=int, default=None, help="-mos=N")
    p.add_argument("--aic-enable-depth-first", action="store_true", help="-aic-enable-depth-first")
    p.add_argument(
        "--specializations-format",
        choices=["named", "legacy"],
        default="named",
        help="named: QEfficient >= 1.22's {name, symbols}; legacy: <= 1.21's flat entries",
    )
    p.add_argument(
        "--validate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the export on ONNX Runtime and compare greedy tokens with eager PyTorch",
    )


def export_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from qaic_dynamo.deploy.export import export_for_qaic, export_prefill_decode
    from qaic_dynamo.errors import ExportError

    model = model_arg(args)
    if model is None:
        return 2
    bars: dict[str, tqdm] = {}

    def progress(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(
                total=total, desc=f"{stage:<8}", unit="layer" if stage == "layers" else "step", leave=False
            )
        bar.update(done - bar.n)

    if args.mxint8_kv and args.kv_precision not in (None, "mxint8"):
        print(f"qaic-dynamo export: --mxint8-kv and --kv-precision {args.kv_precision} disagree", file=sys.stderr)
        return 2
    compiler_options = {
        "mxfp6_matmul": args.mxfp6_matmul or None,
        "mos": args.mos,
        "aic_enable_depth_first": args.aic_enable_depth_first or None,
    }
    options = dict(
        batch_size=args.batch_size,
        prefill_seq_len=args.prefill_seq_len,
        ctx_len=args.ctx_len,
        kv_cache_prefix=args.kv_cache_prefix,
        layerwise=args.layerwise,
        kv_precision="mxint8" if args.mxint8_kv else args.kv_precision,
        hw_version=args.hw,
        full_batch_size=args.full_batch_size,
        retain_full_kv=args.retain_full_kv,
        comp_ctx_lengths_prefill=args.comp_ctx_lengths_prefill,
        comp_ctx_lengths_decode=args.comp_ctx_lengths_decode,
        ccl_min_length=args.ccl_min_length,
        num_cores=args.num_cores,
        num_devices=args.num_devices,
        specializations_format=args.specializations_format,
        compiler_options={k: v for k, v in compiler_options.items() if v is not None},
        progress=progress,
    )
    if not args.disagg:
        options["prefill_only"] = True if args.prefill_only else (False if args.decode_only else None)
    try:
        if args.disagg:
            pair = export_prefill_decode(model, args.out, **options)
            results = [pair.prefill, pair.decode]
        else:
            results = [export_for_qaic(model, args.out, **options)]
    except (ExportError, ValueError, OSError) as e:  # bad options, or a model that cannot be loaded
        print(f"qaic-dynamo export: {e}", file=sys.stderr)
        return 1
    finally:
        for bar in bars.values():
            bar.close()
    for result in results:
        print(result.summary())
    return validate(model, results[0], args) if args.validate else 0


def validate(model: object, result: object, args: argparse.Namespace) -> int:
    """Greedy tokens of the export on ONNX Runtime against eager PyTorch in the exported dtype."""
    import torch

    from qaic_dynamo import LLM
    from qaic_dynamo.deploy.export import continuous_batching_generate, has_bfloat16_inputs, ort_generate
    from qaic_dynamo.errors import ExportError

    if has_bfloat16_inputs(result.onnx_path):
        print(
            "validation        skipped: the export is bfloat16 (hw ai200), which ONNX Runtime's CPU kernels do not "
            "run (the ai100 export of the checkpoint, in float32, validates here)"
        )
        return 0
    vocab = int(onnx_vocab(result.onnx_path))
    g = torch.Generator().manual_seed(args.seed)
    n = max(1, min(args.prefill_seq_len + 3, args.ctx_len - 4))
    prompts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in sorted({max(1, n // 3), n})]
    room = args.ctx_len - max(len(p) for p in prompts)
    if room < 1:
        print(f"validation        skipped: ctx_len {args.ctx_len} leaves no room to generate a token")
        return 0
    new = min(4, room)
    t0 = time.perf_counter()
    try:
        if result.options.continuous_batching:
            got = continuous_batching_generate(
                result.onnx_path,
                prompts,
                new,
                args.prefill_seq_len,
                slots=result.options.full_batch_size,
                ctx_len=args.ctx_len,
            ).tokens
        else:
            got, _ = ort_generate(result.onnx_path, prompts, new, args.prefill_seq_len)
        dtype = getattr(torch, result.dtype)
        want = LLM(model, backend="eager", max_model_len=args.ctx_len, dtype=dtype).generate(prompts, new)
    except (ExportError, ValueError) as e:
        print(f"qaic-dynamo export: validation failed: {e}", file=sys.stderr)
        return 1
    same = got == want
    print(
        f"validation        ONNX Runtime greedy tokens {'==' if same else '!='} eager PyTorch in {result.dtype} "
        f"({len(prompts)} prompts x {new} tokens, {time.perf_counter() - t0:.1f} s)"
    )
    return 0 if same else 1


def onnx_vocab(path: object) -> int:
    import onnx

    out = onnx.load(str(path), load_external_data=False).graph.output[0]
    return out.type.tensor_type.shape.dim[-1].dim_value
