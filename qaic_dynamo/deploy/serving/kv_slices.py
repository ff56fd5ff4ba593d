"""KV buffer names and the slicing spec of a hand-off: which buffers, which dims.

As in QEfficient's disaggregated flow, a :class:`KVSliceSpec` names the decode KV buffers
by pattern and the dims that are indexed per request: ``batch_index`` (dim 0, the decode
slot) and ``ctx_start`` (dim 2, where the request's tokens start).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch

from qaic_dynamo.deploy.naming import (
    align_inputs_to_outputs,
    apply_kv_cache_prefix,
    retained_state_names,
    validate_kv_cache_prefix,
)
from qaic_dynamo.errors import KVSliceError
from qaic_dynamo.ops import QAIC_OPS

__all__ = ["KVSliceSpec", "kv_buffer_names"]


def kv_buffer_names(model: Any, kv_cache_prefix: str | None = None) -> list[list[str]]:
    """Each layer's KV buffer names, in layer order: the retained-state input names of the
    deployment export (``qaic_dynamo.deploy.naming``), e.g.
    ``[["past_key.0", "past_value.0"], ...]``."""
    stems = QAIC_OPS[model.kv_cache_update].retained_state
    out = []
    for i in range(len(model.kv_cache_layers)):
        outputs = apply_kv_cache_prefix(retained_state_names(stems, i), kv_cache_prefix)
        inputs = align_inputs_to_outputs(outputs)
        out.append([inputs[o] for o in outputs])
    return out


@dataclass(frozen=True)
class KVSliceSpec:
    """Which buffers a hand-off slices, and along which dims.

    ``patterns`` are ``fnmatch`` patterns over buffer names (``past_key.*``); ``dims`` maps
    each slicing index to the buffer dim it indexes: ``batch_index`` selects one slot
    (dim 0), ``ctx_start`` the first cache position written (dim 2)."""

    patterns: tuple[str, ...] = ("past_key.*", "past_value.*")
    dims: tuple[tuple[str, int], ...] = (("batch_index", 0), ("ctx_start", 2))

    @classmethod
    def for_model(cls, model: Any, kv_cache_prefix: str | None = None) -> KVSliceSpec:
        """The spec of a model's KV buffers: its stems, in the prefixed form when a
        ``kv_cache_prefix`` is set (``past_key.*_P``)."""
        prefix = validate_kv_cache_prefix(kv_cache_prefix)
        stems = QAIC_OPS[model.kv_cache_update].retained_state
        return cls(tuple(f"{s}.*_{prefix}" if prefix else f"{s}.*" for s in stems))

    @classmethod
    def for_names(cls, names: list[str], kv_cache_prefix: str | None = None) -> KVSliceSpec:
        """The spec of an exported model's KV inputs (``past_key.0``, ...): one pattern per
        stem, in the prefixed form when the export has a ``kv_cache_prefix``."""
        prefix = validate_kv_cache_prefix(kv_cache_prefix)
        stems = list(dict.fromkeys(n.split(".")[0] for n in names))
        return cls(tuple(f"{s}.*_{prefix}" if prefix else f"{s}.*" for s in stems))

    def select(self, buffers: dict[str, torch.Tensor]) -> list[str]:
        """The names of ``buffers`` the spec covers, checked: every pattern must match a
        buffer and every sliced dim must exist in each of them."""
        names: list[str] = []
        for pattern in self.patterns:
            hits = [n for n in buffers if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise KVSliceError(
                    f"slicing pattern {pattern!r} matches no buffer; buffers: {sorted(buffers)[:8]}"
                    f"{' ...' if len(buffers) > 8 else ''}"
                )
            names += [n for n in hits if n not in names]
        for name in names:
            rank = buffers[name].dim()
            for key, dim in self.dims:
                if not 0 <= dim < rank:
                    raise KVSliceError(f"slicing dim {key}={dim} is out of range for {name} of rank {rank}")
        return names

    def views(self, buffers: dict[str, torch.Tensor], index: dict[str, int]) -> dict[str, torch.Tensor]:
        """Views of the covered buffers at ``index`` (``batch_index`` keeps one slot,
        ``ctx_start`` starts the cache dim there); they share the buffers' memory."""
        unknown = set(index) - {k for k, _ in self.dims}
        if unknown:
            raise KVSliceError(f"unknown slicing index {sorted(unknown)}; this spec slices {[k for k, _ in self.dims]}")
        out = {}
        for name in self.select(buffers):
            v = buffers[name]
            for key, dim in self.dims:
                if key not in index:
                    continue
                i = index[key]
                if not 0 <= i < v.shape[dim]:
                    raise KVSliceError(f"{key}={i} is out of range for {name} (dim {dim} has {v.shape[dim]})")
                v = v.narrow(dim, i, 1 if key == "batch_index" else v.shape[dim] - i)
            out[name] = v
        return out
