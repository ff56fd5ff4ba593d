"""ExportOptions: what ``export_for_qaic`` builds, one frozen dataclass."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from qaic_dynamo.config import OPSETS
from qaic_dynamo.deploy.naming import validate_kv_cache_prefix
from qaic_dynamo.errors import ExportError
from qaic_dynamo.runtime import extra_flag_problem

__all__ = ["KV_PRECISIONS", "ExportOptions"]

KV_PRECISIONS = ("float16", "mxint8")


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class ExportOptions:
    """What :func:`export_for_qaic` builds. Every field changes the artifact and is hashed."""

    batch_size: int = field(default=1, metadata=_doc("Decode batch size (the Decode specialization)."))
    prefill_seq_len: int = field(default=32, metadata=_doc("Tokens per prefill call (the Prefill specialization)."))
    ctx_len: int = field(default=128, metadata=_doc("KV-cache capacity per sequence (retained layout dim 2)."))
    kv_cache_prefix: str | None = field(default=None, metadata=_doc("Alphanumeric infix for KV names; None: none."))
    layerwise: bool = field(default=True, metadata=_doc("Lower one decoder block and stitch it L times."))
    kv_precision: str = field(
        default="float16", metadata=_doc("custom_io precision of the KV buffers: float16 or mxint8.")
    )
    num_cores: int = field(default=16, metadata=_doc("qaic-compile -aic-num-cores."))
    compiler_options: tuple[tuple[str, Any], ...] = field(
        default=(), metadata=_doc("Extra qaic-compile options, key_name=v -> -key-name=v; True -> bare flag.")
    )
    retained_buffers: tuple[str, ...] = field(
        default=(),
        metadata=_doc("Model buffers kept as retained state (input X, output X_RetainedState; never prefixed)."),
    )
    opset: int = field(default=18, metadata=_doc("ONNX opset of the model."))

    def __post_init__(self) -> None:
        for name in ("batch_size", "prefill_seq_len", "ctx_len", "num_cores"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ExportError(f"{name} must be a positive int, got {v!r}")
        if self.prefill_seq_len > self.ctx_len:
            raise ExportError(f"prefill_seq_len ({self.prefill_seq_len}) must not exceed ctx_len ({self.ctx_len})")
        validate_kv_cache_prefix(self.kv_cache_prefix)
        rb = self.retained_buffers
        if not isinstance(rb, (tuple, list)) or not all(isinstance(n, str) and n for n in rb):
            raise ExportError(f"retained_buffers must be buffer names (strings), got {rb!r}")
        repeated = sorted({n for n in rb if rb.count(n) > 1})
        if repeated:  # each would be a second graph input of the same name (caught only by onnx.checker)
            raise ExportError(f"retained_buffers names {repeated} more than once; name each buffer once")
        if self.kv_precision not in KV_PRECISIONS:
            raise ExportError(f"kv_precision must be one of {KV_PRECISIONS}, got {self.kv_precision!r}")
        if not isinstance(self.layerwise, bool):
            raise ExportError(f"layerwise must be a bool, got {self.layerwise!r}")
        extra = self.compiler_options  # from_options made a dict the sorted pairs hashed here
        if isinstance(extra, tuple) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in extra):
            extra = dict(extra)
        problem = extra_flag_problem(extra)
        if problem:
            raise ExportError(problem)
        if isinstance(self.opset, bool) or type(self.opset) is not int or self.opset not in OPSETS:
            raise ExportError(
                f"opset must be one of {list(OPSETS)} (the opset onnxscript's torch library emits), got {self.opset!r}"
            )

    @classmethod
    def from_options(cls, **options: Any) -> ExportOptions:
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ExportError(f"unknown export option(s) {unknown}; valid options: {sorted(valid)}")
        co = options.get("compiler_options")
        if isinstance(co, (list, tuple)) and all(isinstance(kv, (list, tuple)) and len(kv) == 2 for kv in co):
            co = dict(co)  # pairs, as before: the same options as the dict (and the same hash)
        if isinstance(co, dict):
            options["compiler_options"] = tuple(sorted(co.items()))
        if isinstance(options.get("retained_buffers"), (list, str)):
            rb = options["retained_buffers"]
            options["retained_buffers"] = (rb,) if isinstance(rb, str) else tuple(rb)
        return cls(**options)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compiler_options"] = dict(self.compiler_options)
        return d

    def compute_hash(self, model_identity: dict[str, Any]) -> str:
        """Short sha256 of every field and the model's identity (sorted-key JSON)."""
        blob = json.dumps({"options": self.as_dict(), "model": model_identity}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
