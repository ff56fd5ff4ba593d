"""Command line: ``qaic-dynamo <command>`` (or ``python -m qaic_dynamo <command>``).

    qaic-dynamo demo [--compare] [...]      compile a transformer, compare with eager
    qaic-dynamo cache info|list|clear       inspect or empty the persistent compile cache
    qaic-dynamo export --model M --out DIR  export M for a Cloud AI 100 card (retained-state
                                            ONNX, custom_io.yaml, specializations.json)
    qaic-dynamo serve-disagg --model M --prompts FILE
                                            serve a prompt file with prefill and decode in
                                            separate processes (zero-copy KV hand-off)
"""

from __future__ import annotations

import argparse
import sys
import time

from qaic_dynamo.demo import positive_int


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def cache_command(args: argparse.Namespace) -> int:
    from qaic_dynamo.cache import DiskCache
    from qaic_dynamo.config import CompilationConfig

    cfg = CompilationConfig.from_options({"cache_dir": args.cache_dir} if args.cache_dir else {})
    cache = DiskCache(cfg.resolved_cache_dir(), cfg.cache_size_limit)
    if args.action == "info":
        entries = cache.entries()
        print(f"location  {cache.root}")
        print(f"entries   {len(entries)}")
        print(f"size      {_human(sum(e.size for e in entries))} (limit {_human(cfg.cache_size_limit)})")
        last = cache.last_run()
        if last:
            print(f"last run  {last['misses']} misses, {last['hits']} hits, {last['writes']} written "
                  f"(pid {last['pid']}, {_when(last['time'])})")
        else:
            print("last run  unknown")
    elif args.action == "list":
        print(f"{'key':<12}  {'size':>10}  {'created':<19}  last used")
        for e in sorted(cache.entries(), key=lambda e: e.last_used, reverse=True):
            print(f"{e.key[:12]:<12}  {_human(e.size):>10}  {_when(e.created):<19}  {_when(e.last_used)}")
    else:
        print(f"removed {cache.clear()} entries from {cache.root}")
    return 0


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama",
                   help="llama | qwen2 | mistral | mla (built-in configs, random weights) or a local model directory")
    p.add_argument("--out", required=True, help="output root; the export goes to OUT/<hash>/")
    p.add_argument("--layers", type=positive_int, default=None, help="built-in models: number of layers (default 16)")
    p.add_argument("--hidden-size", type=positive_int, default=None,
                   help="built-in models: hidden size (default 512; a multiple of the 8 attention heads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1, help="decode batch size")
    p.add_argument("--prefill-seq-len", type=int, default=32)
    p.add_argument("--ctx-len", type=int, default=128)
    p.add_argument("--kv-cache-prefix", default=None, help="alphanumeric infix for the KV buffer names")
    p.add_argument("--layerwise", action=argparse.BooleanOptionalAction, default=True,
                   help="lower one decoder block and stitch it (default) or export the whole model")
    p.add_argument("--kv-precision", choices=["float16", "mxint8"], default="float16")
    p.add_argument("--num-cores", type=int, default=16)
    p.add_argument("--validate", action=argparse.BooleanOptionalAction, default=True,
                   help="run the export on ONNX Runtime and compare greedy tokens with eager PyTorch")


def export_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from qaic_dynamo.export import ExportError, export_for_qaic, has_bfloat16_inputs, ort_generate

    model = _model_arg(args)
    if model is None:
        return 2
    bars: dict[str, tqdm] = {}

    def progress(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=total, desc=f"{stage:<8}", unit="layer" if stage == "layers" else "step",
                                     leave=False)
        bar.update(done - bar.n)

    try:
        result = export_for_qaic(
            model, args.out, batch_size=args.batch_size, prefill_seq_len=args.prefill_seq_len, ctx_len=args.ctx_len,
            kv_cache_prefix=args.kv_cache_prefix, layerwise=args.layerwise, kv_precision=args.kv_precision,
            num_cores=args.num_cores, progress=progress)
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
            print("validation        skipped: the model is bfloat16, which ONNX Runtime's CPU kernels do not run "
                  "(a float16 copy of the checkpoint validates here)")
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
        print(f"validation        ONNX Runtime greedy tokens {'==' if same else '!='} eager PyTorch "
              f"({len(prompts)} prompts x {new} tokens, {time.perf_counter() - t0:.1f} s)")
        if not same:
            return 1
    return 0


def onnx_vocab(path: object) -> int:
    import onnx

    out = onnx.load(str(path), load_external_data=False).graph.output[0]
    return out.type.tensor_type.shape.dim[-1].dim_value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama",
                   help="llama | qwen2 | mistral | mla (built-in configs, random weights) or a local model directory")
    p.add_argument("--prompts", required=True,
                   help="a file with one prompt per line, as whitespace-separated token ids")
    p.add_argument("--layers", type=positive_int, default=None, help="built-in models: number of layers (default 16)")
    p.add_argument("--hidden-size", type=positive_int, default=None,
                   help="built-in models: hidden size (default 512; a multiple of the 8 attention heads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--decode-slots", type=int, default=4)
    p.add_argument("--ctx-len", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=64, help="prefill chunk size")
    p.add_argument("--transport", choices=["shm", "copy", "gloo"], default="shm")
    p.add_argument("--kv-cache-prefix", default=None)
    p.add_argument("--backend", choices=["qaic", "eager"], default="qaic")


def _model_arg(args: argparse.Namespace) -> object | None:
    from pathlib import Path

    if Path(args.model).is_dir():
        if args.layers is not None or args.hidden_size is not None:
            print(f"qaic-dynamo: --layers and --hidden-size resize the built-in models; the model in {args.model} is "
                  "used as it is, so drop them", file=sys.stderr)
            return None
        # As a path, never a bare name: a directory called "llama" is that model, not the
        # built-in one.
        return str(Path(args.model).resolve())
    if args.model not in ("llama", "qwen2", "mistral", "mla"):
        print(f"qaic-dynamo: --model {args.model!r} is neither a built-in model (llama, qwen2, mistral, mla) "
              "nor a local directory", file=sys.stderr)
        return None
    from qaic_dynamo import demo

    try:
        return demo.build_model(argparse.Namespace(model=args.model, config=None, layers=args.layers,
                                                   hidden_size=args.hidden_size, seed=args.seed))
    except ValueError as e:  # a shape the model cannot have
        print(f"qaic-dynamo: {e}", file=sys.stderr)
        return None


def serve_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from qaic_dynamo.serving import DisaggregatedServer, summarize

    try:
        lines = [ln.split() for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        prompts = [[int(t) for t in ln] for ln in lines]
    except (OSError, ValueError) as e:
        print(f"qaic-dynamo serve-disagg: cannot read prompts from {args.prompts}: {e} "
              "(one prompt per line, whitespace-separated token ids)", file=sys.stderr)
        return 2
    if not prompts:
        print(f"qaic-dynamo serve-disagg: {args.prompts} holds no prompt", file=sys.stderr)
        return 2
    model = _model_arg(args)
    if model is None:
        return 2
    print(f"starting prefill and decode workers ({args.transport} hand-off, {args.decode_slots} decode slots, "
          f"ctx_len {args.ctx_len}, backend {args.backend})", flush=True)
    try:
        with DisaggregatedServer(model, decode_slots=args.decode_slots, ctx_len=args.ctx_len,
                                 chunk_size=args.chunk_size, transport=args.transport, backend=args.backend,
                                 kv_cache_prefix=args.kv_cache_prefix) as server:
            with tqdm(total=len(prompts), desc="requests", unit="req", leave=False) as bar:
                results = server.generate(prompts, args.max_tokens, progress=lambda r: bar.update())
    except (ValueError, OSError) as e:  # bad options, or a model that cannot be loaded
        print(f"qaic-dynamo serve-disagg: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a worker failed: its traceback ends with what went wrong
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        cause = f" ({lines[-1].strip()})" if len(lines) > 1 else ""
        print(f"qaic-dynamo serve-disagg: {lines[0] if lines else e}{cause}", file=sys.stderr)
        return 1
    for r in results:
        head = f"request {r.request_id:>3}  prompt {len(r.prompt):>4} tokens"
        if r.error:
            print(f"{head}  FAILED: {r.error}")
        else:
            print(f"{head}  TTFT {r.ttft * 1e3:8.1f} ms  tokens {r.token_ids}")
    s = summarize(results)
    if s["failed"] == s["requests"]:
        print(f"summary: {s['requests']} requests, all failed")
    else:
        print(f"summary: {s['requests']} requests, {s['failed']} failed; TTFT median {s['ttft_median_s'] * 1e3:.1f} "
              f"ms, p90 {s['ttft_p90_s'] * 1e3:.1f} ms; decode {s['decode_tokens_per_s']:.1f} tokens/s; "
              f"KV bytes moved per hand-off {s['kv_bytes_per_handoff']:,.0f}")
    return 0 if not s["failed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qaic-dynamo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    from qaic_dynamo import demo

    demo.add_arguments(sub.add_parser("demo", help=demo.__doc__.splitlines()[0]))
    cache = sub.add_parser("cache", help="inspect or empty the persistent compile cache")
    cache.add_argument("action", choices=["info", "list", "clear"])
    cache.add_argument("--cache-dir", help="cache root (default: the backend's, see docs)")
    add_export_arguments(sub.add_parser("export", help="export a model for a Cloud AI 100 card"))
    add_serve_arguments(sub.add_parser("serve-disagg", help="serve prompts with disaggregated prefill and decode"))
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            return demo.run(args)
        except (ValueError, OSError) as e:  # bad flags for this model (a context past its positions), no model
            print(f"qaic-dynamo demo: {e}", file=sys.stderr)
            return 2
    if args.command == "export":
        return export_command(args)
    if args.command == "serve-disagg":
        return serve_command(args)
    return cache_command(args)


if __name__ == "__main__":
    sys.exit(main())
