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
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.benchmark import Timer

RESULTS_DIR = Path(__file__).parent / "results"


def median_seconds(fn: Callable[[], Any], repeats: int = 5, min_run_time: float = 0.2) -> float:
    """Median over `repeats` runs of torch's blocked_autorange (itself a median per run)."""
    timer = Timer(stmt="fn()", globals={"fn": fn})
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
