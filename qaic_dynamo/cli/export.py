"""``qaic-dynamo export``: export a model for a Cloud AI 100 card, and validate it."""

from __future__ import annotations

import argparse
import sys
import time

from qaic_dynamo.cli.common import model_arg
from qaic_dynamo.demo import positive_int

__all__ = ["add_export_arguments", "export_command", "onnx_vocab"]


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
    p.add_argument("--kv-precision", choices=["float16", "mxint8"], default="float16")
    p.add_argument("--num-cores", type=int, default=16)
    p.add_argument(
        "--validate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the export on ONNX Runtime and compare greedy tokens with eager PyTorch",
    )


def export_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from qaic_dynamo.deploy.export import export_for_qaic, has_bfloat16_inputs, ort_generate
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

    try:
        result = export_for_qaic(
            model,
            args.out,
            batch_size=args.batch_size,
            prefill_seq_len=args.prefill_seq_len,
            ctx_len=args.ctx_len,
            kv_cache_prefix=args.kv_cache_prefix,
            layerwise=args.layerwise,
            kv_precision=args.kv_precision,
            num_cores=args.num_cores,
            progress=progress,
        )
    except (ExportError, ValueError, OSError) as e:  # bad options, or a model that cannot be loaded
        print(f"qaic-dynamo export: {e}", file=sys.stderr)
        return 1
    finally:
        for bar in bars.values():
            bar.close()
    print(result.summary())
    if args.validate:
        import torch

        from qaic_dynamo import LLM

        if has_bfloat16_inputs(result.onnx_path):
            print(
                "validation        skipped: the model is bfloat16, which ONNX Runtime's CPU kernels do not run "
                "(a float16 copy of the checkpoint validates here)"
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
            got, _ = ort_generate(result.onnx_path, prompts, new, args.prefill_seq_len)
            want = LLM(model, backend="eager", max_model_len=args.ctx_len).generate(prompts, new)
        except (ExportError, ValueError) as e:
            print(f"qaic-dynamo export: validation failed: {e}", file=sys.stderr)
            return 1
        same = got == want
        print(
            f"validation        ONNX Runtime greedy tokens {'==' if same else '!='} eager PyTorch "
            f"({len(prompts)} prompts x {new} tokens, {time.perf_counter() - t0:.1f} s)"
        )
        if not same:
            return 1
    return 0


def onnx_vocab(path: object) -> int:
    import onnx

    out = onnx.load(str(path), load_external_data=False).graph.output[0]
    return out.type.tensor_type.shape.dim[-1].dim_value
