"""``qaic-dynamo serve-disagg``: serve a prompt file with disaggregated prefill and decode,
from a model (two compiled engines) or from exported artifacts (``--export-dir``, on ONNX
Runtime)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from qaic_dynamo.cli.common import model_arg
from qaic_dynamo.demo import positive_int

__all__ = ["add_serve_disagg_arguments", "serve_disagg_command"]


def add_serve_disagg_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="llama | qwen2 | mistral | mla (built-in configs, random weights) or a local model directory "
        "(default llama)",
    )
    p.add_argument(
        "--export-dir",
        default=None,
        help="serve exported artifacts instead: the pair directory of `qaic-dynamo export --disagg` (prefill/ "
        "and decode/ inside) or one export; its specializations fix the decode slots, ctx_len and chunk size",
    )
    p.add_argument(
        "--prompts", required=True, help="a file with one prompt per line, as whitespace-separated token ids"
    )
    p.add_argument("--layers", type=positive_int, default=None, help="built-in models: number of layers (default 16)")
    p.add_argument(
        "--hidden-size",
        type=positive_int,
        default=None,
        help="built-in models: hidden size (default 512; a multiple of the 8 attention heads)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--decode-slots", type=int, default=None, help="default 4 (an export: its own)")
    p.add_argument("--ctx-len", type=int, default=None, help="default 256 (an export: its own)")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size, default 64 (an export: its own)")
    p.add_argument("--transport", choices=["shm", "copy", "gloo"], default="shm")
    p.add_argument("--kv-cache-prefix", default=None)
    p.add_argument("--backend", choices=["qaic", "eager"], default=None, help="default qaic (not with --export-dir)")


def serve_disagg_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from qaic_dynamo.deploy.serving import DisaggregatedServer, summarize

    try:
        lines = [ln.split() for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        prompts = [[int(t) for t in ln] for ln in lines]
    except (OSError, ValueError) as e:
        print(
            f"qaic-dynamo serve-disagg: cannot read prompts from {args.prompts}: {e} "
            "(one prompt per line, whitespace-separated token ids)",
            file=sys.stderr,
        )
        return 2
    if not prompts:
        print(f"qaic-dynamo serve-disagg: {args.prompts} holds no prompt", file=sys.stderr)
        return 2
    options = dict(
        decode_slots=args.decode_slots,
        ctx_len=args.ctx_len,
        chunk_size=args.chunk_size,
        transport=args.transport,
        kv_cache_prefix=args.kv_cache_prefix,
    )
    if args.export_dir is not None:
        given = [
            f
            for f, v in (
                ("--model", args.model),
                ("--layers", args.layers),
                ("--hidden-size", args.hidden_size),
                ("--backend", args.backend),
            )
            if v is not None
        ]
        if given:
            print(
                f"qaic-dynamo serve-disagg: {', '.join(given)} describe a model to compile; --export-dir serves the "
                "exported one, so drop them",
                file=sys.stderr,
            )
            return 2
        from qaic_dynamo.deploy.serving import ExportedModel
        from qaic_dynamo.errors import ExportError

        try:
            model = ExportedModel(args.export_dir)
        except ExportError as e:
            print(f"qaic-dynamo serve-disagg: {e}", file=sys.stderr)
            return 2
        what = f"ONNX Runtime; {model.describe()}"
    else:
        args.model = args.model or "llama"
        model = model_arg(args)
        if model is None:
            return 2
        options["backend"] = args.backend or "qaic"
        what = (
            f"{options['decode_slots'] or 4} decode slots, ctx_len {options['ctx_len'] or 256}, "
            f"backend {options['backend']}"
        )
    print(f"starting prefill and decode workers ({args.transport} hand-off, {what})", flush=True)

    stopped_by: list[signal.Signals] = []

    def stop(signum: int, frame: object) -> None:
        # KeyboardInterrupt (SIGTERM too): it unwinds through the server's context
        # manager, which stops the workers, and no ``except Exception`` swallows it.
        stopped_by.append(signal.Signals(signum))
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with DisaggregatedServer(model, **options) as server:
            with tqdm(total=len(prompts), desc="requests", unit="req", leave=False) as bar:
                results = server.generate(prompts, args.max_tokens, progress=lambda r: bar.update())
    except KeyboardInterrupt:  # the server's context manager ended the workers and freed the memory
        sig = stopped_by[0] if stopped_by else signal.SIGINT
        print(
            f"qaic-dynamo serve-disagg: stopped by {sig.name}; workers ended, shared memory released", file=sys.stderr
        )
        return 128 + sig.value
    except (ValueError, OSError, NotImplementedError) as e:  # bad options, a model that cannot be loaded or run
        print(f"qaic-dynamo serve-disagg: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a worker failed: its traceback ends with what went wrong
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        cause = f" ({lines[-1].strip()})" if len(lines) > 1 else ""
        print(f"qaic-dynamo serve-disagg: {lines[0] if lines else e}{cause}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
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
        print(
            f"summary: {s['requests']} requests, {s['failed']} failed; TTFT median {s['ttft_median_s'] * 1e3:.1f} "
            f"ms, p90 {s['ttft_p90_s'] * 1e3:.1f} ms; decode {s['decode_tokens_per_s']:.1f} tokens/s; "
            f"KV bytes moved per hand-off {s['kv_bytes_per_handoff']:,.0f}"
        )
    return 0 if not s["failed"] else 1
