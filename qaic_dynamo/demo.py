"""Compile a transformer with backend="qaic" and show what a flat cold start looks like.

The default model is a Llama-architecture ``transformers`` model built from the config
below with random weights (seed 0): 16 layers, hidden size 512, grouped-query attention.
Nothing is downloaded. It runs greedy generation for a few prompts with the ``LLM``
engine twice, eagerly and compiled (region by region: the decoder block is traced and
lowered once for every layer), and prints: the layers, the Dynamo graphs, the unique
pieces compiled, eager and exporter fallbacks, the cold compile time and its ONNX
exports, tokens/s of both, and the largest logit difference; then it restarts - a new
process, so no Dynamo, module or in-memory state - against the persistent cache it just
filled and prints that first call's time too, with the pieces loaded from disk and the
exports the restart needed (none when the cache serves every piece). Counts come from ``compilation_counter``. Compiles use a fresh
temporary cache, so "cold" is cold on every run. ``--compare`` also compiles the whole
model in one ``torch.compile`` (Dynamo traces every layer), with layer-agnostic and with
per-layer names in the KV update (the old behaviour), and prints the times side by side.
All engines run the one model: each adapts its own copy of the module tree, sharing the
weights, and the model itself is left unchanged.

The exit status is non-zero if the compiled model's tokens differ from eager's.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

#: The demo's built-in model: Llama architecture, 16 layers, hidden 512, 8 query / 2 kv heads.
DEFAULT_LLAMA = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        choices=["llama", "qwen2", "mistral", "mla"],
        default="llama",
        help="architecture of the built-in model (llama, qwen2, mistral: transformers; mla: reference)",
    )
    p.add_argument("--config", metavar="DIR_OR_JSON", help="a local transformers config (directory or JSON file)")
    p.add_argument("--layers", type=positive_int, default=None, help="override the number of layers (default 16)")
    p.add_argument(
        "--hidden-size",
        type=positive_int,
        default=None,
        help="override the hidden size (default 512; a multiple of the 8 attention heads)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument(
        "--compare",
        action="store_true",
        help="also compile the whole model, with layer-agnostic and with per-layer KV-update names, and "
        "print both cold compile times",
    )
    p.add_argument("--seed", type=int, default=0)
    # The restart's child process: the same model and prompts against this cache.
    p.add_argument("--restart-from", metavar="CACHE_DIR", default=None, help=argparse.SUPPRESS)


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (0 would otherwise read as "not given")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


#: Config lists with one entry per decoder layer (resized by --layers).
PER_LAYER_LISTS = ("layer_types", "no_rope_layers", "activation_sparsity_pattern")


def build_model(args: argparse.Namespace) -> Any:
    from qaic_dynamo.models import (
        QaicMLAConfig,
        QaicMLAForCausalLM,
        has_weights,
        hf_config,
        hf_model_from_config,
        local_model,
    )

    if args.model == "mla" and not args.config:
        torch.manual_seed(args.seed)
        hidden = args.hidden_size if args.hidden_size is not None else 512
        _check_hidden_size(hidden, 8)
        return QaicMLAForCausalLM(
            QaicMLAConfig(
                vocab_size=32000,
                hidden_size=hidden,
                intermediate_size=hidden * 11 // 4,
                num_hidden_layers=args.layers if args.layers is not None else 16,
                num_attention_heads=8,
                kv_lora_rank=128,
                qk_nope_head_dim=hidden // 8,
                qk_rope_head_dim=32,
                v_head_dim=hidden // 8,
            )
        )
    if args.config and has_weights(args.config):
        # A model directory with weights: the demo runs that model, as LLM(directory) does.
        if args.layers is not None or args.hidden_size is not None:
            raise ValueError(
                f"demo: --config {args.config} holds weights, so its shape is fixed; drop --layers and "
                "--hidden-size (or point --config at a config.json to build a resized random model)"
            )
        return local_model(args.config)
    if args.config:
        cfg = hf_config(args.config)
    else:
        d = dict(DEFAULT_LLAMA, model_type=args.model)
        if args.model == "mistral":
            d["sliding_window"] = 4096
        cfg = hf_config(d)
    if args.layers is not None:
        # Lists with one entry per layer follow the new depth: cut, or extended with their
        # last entry. Only these: other lists may merely have that length by chance
        # (eos_token_id, or mlp_only_layers, which holds layer indices).
        for key in PER_LAYER_LISTS:
            value = getattr(cfg, key, None)
            if isinstance(value, list) and value:
                setattr(cfg, key, value[: args.layers] + [value[-1]] * (args.layers - len(value)))
        cfg.num_hidden_layers = args.layers
    if args.hidden_size is not None:
        _check_hidden_size(args.hidden_size, cfg.num_attention_heads)
        cfg.head_dim = args.hidden_size // cfg.num_attention_heads
        cfg.hidden_size = args.hidden_size
        cfg.intermediate_size = args.hidden_size * 11 // 4
    return hf_model_from_config(cfg, seed=args.seed)


def _check_hidden_size(hidden: int, heads: int) -> None:
    if hidden % heads:
        raise ValueError(
            f"--hidden-size {hidden} is not a multiple of the model's {heads} attention heads; pass a "
            f"multiple of {heads} (e.g. {max(heads, hidden - hidden % heads)})"
        )


def _has_tokenizer(path: str) -> bool:
    return any(
        os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )


def _cold(llm: Any, prompts: list[list[int]]) -> float:
    """Seconds of the first call (Dynamo trace + backend + one prefill step)."""
    t0 = time.perf_counter()
    llm.generate(prompts, 1)
    return time.perf_counter() - t0


def _fresh_compile_state() -> None:
    from qaic_dynamo._compat import dynamo_reset
    from qaic_dynamo.cache import artifact_cache

    dynamo_reset()
    artifact_cache.clear_memory()


def _workload(args: argparse.Namespace) -> tuple[Any, list[list[int]], dict[str, int]]:
    model = build_model(args)
    g = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (12, 35, 7, 60)]
    max_len = max(len(p) for p in prompts) + args.max_new_tokens
    return model, prompts, dict(max_num_seqs=len(prompts), max_model_len=max(128, max_len), block_size=16)


def _restart_child(args: argparse.Namespace) -> int:
    """The restart, in a process of its own: first call against the filled cache, then
    the greedy tokens (printed as one JSON line for the parent)."""
    from qaic_dynamo.counter import compilation_counter
    from qaic_dynamo.engine import LLM

    model, prompts, engine_kw = _workload(args)
    llm = LLM(model, backend="qaic", compile_options={"cache_dir": args.restart_from}, **engine_kw)
    warm_s = _cold(llm, prompts)
    counts = compilation_counter.counts()  # the first call's, as the cold row's
    tokens = [o.token_ids for o in llm.generate_outputs(prompts, args.max_new_tokens)]
    print(
        json.dumps(
            {
                "seconds": warm_s,
                "disk_hits": counts["num_disk_cache_hits"],
                "exports": counts["num_onnx_exports"],
                "traces_loaded": counts["num_precompiled_loads"],
                "graphs": counts["num_graphs_seen"],
                "tokens": tokens,
            }
        )
    )
    return 0


def _restart(args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    """Run the restart in a fresh process: no Dynamo, module or in-memory state at all."""
    argv = [sys.executable, "-m", "qaic_dynamo", "demo", "--model", args.model, "--seed", str(args.seed)]
    argv += ["--max-new-tokens", str(args.max_new_tokens), "--restart-from", cache_dir]
    for flag, value in (("--config", args.config), ("--layers", args.layers), ("--hidden-size", args.hidden_size)):
        if value is not None:
            argv += [flag, str(value)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"demo: the restart process failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    from qaic_dynamo.compiler import compile_reports, wait_for_saves
    from qaic_dynamo.counter import compilation_counter
    from qaic_dynamo.engine import LLM

    if args.restart_from is not None:
        return _restart_child(args)
    model, prompts, engine_kw = _workload(args)

    print(f"qaic_dynamo demo: {type(model).__name__}, building engines ...", flush=True)
    # A --config directory that holds tokenizer files gives text in and out.
    tokenizer = args.config if args.config and os.path.isdir(args.config) else None
    eager = LLM(
        model, backend="eager", tokenizer=tokenizer if tokenizer and _has_tokenizer(tokenizer) else None, **engine_kw
    )
    n_layers = len(eager.kv_cache_layers)
    eager.generate(prompts, 1)  # warm-up (allocator, threads)
    t0 = time.perf_counter()
    ref = eager.generate_outputs(prompts, args.max_new_tokens, return_logits=True)
    eager_s = time.perf_counter() - t0

    # A private, empty persistent cache: "cold" must mean cold even on a second run.
    cache_dir = tempfile.mkdtemp(prefix="qaic-demo-cache-")
    atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
    _fresh_compile_state()
    before, n_reports = compilation_counter.snapshot(), len(compile_reports())
    qaic = LLM(model, backend="qaic", compile_options={"progress": True, "cache_dir": cache_dir}, **engine_kw)
    cold_s = _cold(qaic, prompts)
    backend_s = sum(r.seconds["total"] for r in compile_reports()[n_reports:])
    delta = {k: v - getattr(before, k) for k, v in compilation_counter.counts().items()}
    t0 = time.perf_counter()
    out = qaic.generate_outputs(prompts, args.max_new_tokens, return_logits=True)
    qaic_s = time.perf_counter() - t0

    # A restart: a new process, the same persistent cache. This process writes what an
    # exit would (its saved traces) first: it is still running.
    wait_for_saves()
    restart = _restart(args, cache_dir)
    warm_s, warm_hits, warm_exports = restart["seconds"], restart["disk_hits"], restart["exports"]

    gen_tokens = len(prompts) * args.max_new_tokens
    same = [o.token_ids for o in out] == [r.token_ids for r in ref] == restart["tokens"]
    diff = max((a - b).abs().max().item() for o, r in zip(out, ref) for a, b in zip(o.logits, r.logits))

    graphs = delta["num_graphs_seen"]
    rows = [
        ("layers", f"{n_layers}"),
        (
            "Dynamo graphs",
            f"{graphs} (the decoder block traced once for all {n_layers} layers, + {graphs - 1} regions)",
        ),
        ("unique pieces compiled", f"{delta['num_backend_compilations']}"),
        ("eager fallbacks", f"{delta['num_eager_fallbacks']}"),
        ("exporter fallbacks", f"{delta['num_exporter_fallbacks']}"),
        (
            "cold compile (first call, s)",
            f"{cold_s:.2f}  (backend {backend_s:.2f}, {delta['num_onnx_exports']} exports)",
        ),
        (
            "restart, persistent cache (s)",
            f"{warm_s:.2f}  (a new process: {restart['traces_loaded']} region traces and {warm_hits} pieces "
            f"loaded, {restart['graphs']} Dynamo graphs, {warm_exports} exports)",
        ),
        ("tokens/s compiled vs eager", f"{gen_tokens / qaic_s:.1f} vs {gen_tokens / eager_s:.1f}"),
        ("max |logit - eager logit|", f"{diff:.2e}"),
        ("greedy tokens identical", "yes (eager, compiled, restarted)" if same else "NO"),
    ]
    if args.compare:  # the same model, compiled whole: with layer-agnostic names, then per-layer names
        for label, agnostic in (("whole model", True), ("whole model, per-layer names", False)):
            _fresh_compile_state()
            before = compilation_counter.snapshot()
            other_dir = tempfile.mkdtemp(prefix="qaic-demo-cache-")
            atexit.register(shutil.rmtree, other_dir, ignore_errors=True)
            other = LLM(
                model,
                backend="qaic",
                regional=False,
                layer_agnostic_kv_update=agnostic,
                compile_options={"progress": True, "cache_dir": other_dir},
                **engine_kw,
            )
            other_s = _cold(other, prompts)
            other_n = compilation_counter.num_backend_compilations - before.num_backend_compilations
            rows.append(
                (
                    f"cold compile, {label} (s)",
                    f"{other_s:.2f}  ({other_n} unique pieces) = {other_s / cold_s:.1f}x the regional compile",
                )
            )
    width = max(len(k) for k, _ in rows)
    print(f"\nprompts: {len(prompts)} of {[len(p) for p in prompts]} tokens, {args.max_new_tokens} new tokens each")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if eager.tokenizer is not None:
        print("\ngenerated text (compiled):")
        for i, o in enumerate(out):
            print(f"  [{i}] {eager.tokenizer.decode(o.token_ids, skip_special_tokens=True)!r}")
    return 0 if same else 1
