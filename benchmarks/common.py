"""What every benchmark here shares: timing with medians, machine facts, result files.

The machine these run on is noisy (2 shared cores), so a figure is always the median of
several independent timing runs, and every comparison is measured side by side in the
same process and the same run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.benchmark import Timer

RESULTS_DIR = Path(__file__).parent / "results"


def median_seconds(fn: Callable[[], Any], repeats: int = 5, min_run_time: float = 0.2) -> float:
    """Median over `repeats` runs of torch's blocked_autorange (itself a median per run).

    Timer runs with one thread unless told otherwise; every figure here is taken with the
    process's thread count (and changing it would also make Dynamo recompile).
    """
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    runs = [timer.blocked_autorange(min_run_time=min_run_time).median for _ in range(repeats)]
    return statistics.median(runs)


def wall(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def machine_info() -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "onnx", "onnxscript", "onnxruntime", "transformers", "qaic_dynamo"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def save_results(
    name: str, payload: dict[str, Any], markdown: str | None = None, results_dir: Path | None = None
) -> Path:
    out = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    if markdown is not None:
        (out / f"{name}.md").write_text(markdown)
    return path


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(x: Any) -> str:
        return f"{x:.3g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def piece_call_costs(runner: Any, args: tuple, ctx: Any, repeats: int) -> tuple[float, float, float]:
    """(runner call, bare ONNX Runtime run, eager PyTorch) seconds for one compiled piece.

    ``ctx`` is the forward context the piece's cache updates resolve in; its layer index
    is reset before each call. Binding + dispatch overhead = runner - bare run.
    """
    # Contiguous up front, so the runner binds these tensors and not temporary copies
    # (the bare run reuses the runner's bindings).
    args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)

    def call_runner():
        ctx.reset_kv_cache_layer_index()
        runner(*args)

    def call_eager():
        ctx.reset_kv_cache_layer_index()
        runner.eager(*args)

    t_runner = median_seconds(call_runner, repeats)
    call_runner()  # binds the inputs on this thread
    # The runner binds fresh output tensors on every call; for the bare run, bind outputs
    # that stay alive (ONNX Runtime would otherwise write through freed pointers).
    kept = []
    sym = runner.symbol_values(args)
    for name, target, shape_fn, dtype in runner.output_specs:
        if target[0] == "leaf":
            t = torch.empty(shape_fn(sym), dtype=dtype)
            kept.append(t)
            runner.bind_output(name, t)

    def bare_run():
        runner.run_bound()

    t_bare = median_seconds(bare_run, repeats)
    t_eager = median_seconds(call_eager, repeats)
    del kept
    return t_runner, t_bare, t_eager


def demo_llama(layers: int, hidden: int, vocab: int, **overrides: Any) -> torch.nn.Module:
    """The demo's Llama architecture (transformers, random weights) at ``layers`` layers,
    ``hidden`` wide (intermediate 11/4 of it) with ``vocab`` tokens; ``overrides`` set
    other config fields."""
    from qaic_dynamo.demo import DEFAULT_LLAMA
    from qaic_dynamo.models import hf_config, hf_model_from_config

    cfg = dict(
        DEFAULT_LLAMA,
        num_hidden_layers=layers,
        hidden_size=hidden,
        vocab_size=vocab,
        intermediate_size=hidden * 11 // 4,
        **overrides,
    )
    return hf_model_from_config(hf_config(cfg))


def plot_by_depth(
    png: Path, layers: list[int], curves: list[tuple[str, dict[int, float], dict[str, Any]]], title: str, ylabel: str
) -> None:
    """Seconds against model depth on log-log axes, one line per ``(label, {depth:
    seconds}, matplotlib style)``; a curve without a figure at some depth skips it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, by_depth, style in curves:
        xs = [L for L in layers if by_depth.get(L) is not None]
        if xs:
            ax.plot(xs, [by_depth[L] for L in xs], label=label, **{"marker": "o", **style})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(layers, [str(L) for L in layers])
    ax.set_xlabel("layers")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
