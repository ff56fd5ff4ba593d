"""What a served request returns, and the figures every serving report uses: one
nearest-rank percentile definition and :func:`summarize`."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["RequestResult", "percentile", "summarize"]


@dataclass
class RequestResult:
    request_id: int
    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    #: Seconds from submission to the first token (None if it never came).
    ttft: float | None = None
    #: KV bytes moved at this request's hand-off (0 with slicing).
    kv_bytes_moved: int = 0
    error: str | None = None
    submitted: float = 0.0
    finished: float | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1): the smallest value with at least a
    ``q`` share of the values at or below it. The one definition every figure here uses."""
    if not values or not 0 < q <= 1:
        raise ValueError(f"percentile: need values and 0 < q <= 1, got {len(values)} values and q={q}")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(results: Sequence[RequestResult]) -> dict[str, float | None]:
    """Request and failure counts, TTFT median / p90 (s), decode tokens/s and KV bytes moved
    per hand-off (None when no request was served)."""
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttfts = sorted(r.ttft for r in ok)
    if not ok:  # nothing was served: counts only, every figure None
        return {
            "requests": len(results),
            "failed": len(results),
            "ttft_median_s": None,
            "ttft_p90_s": None,
            "decode_tokens_per_s": None,
            "kv_bytes_per_handoff": None,
            "wall_s": None,
        }
    start = min(r.submitted for r in ok)
    end = max(r.finished or 0 for r in ok)
    decode_tokens = sum(max(0, len(r.token_ids) - 1) for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "decode_tokens_per_s": decode_tokens / max(1e-9, end - start),
        "kv_bytes_per_handoff": statistics.mean(r.kv_bytes_moved for r in ok),
        "wall_s": end - start,
    }
