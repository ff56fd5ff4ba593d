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

__all__ = [
    "HW_VERSIONS",
    "KV_PRECISIONS",
    "SPECIALIZATION_FORMATS",
    "SPECIALIZED_DISAGG_SERVING_MODEL_ARCH",
    "ExportOptions",
]

#: The card generations qaic-compile targets (``-aic-hw-version``).
HW_VERSIONS = ("ai100", "ai200")
#: custom_io precisions of the KV buffers.
KV_PRECISIONS = ("float16", "bfloat16", "mxint8")
#: ``specializations.json`` forms: QEfficient >= 1.22 ({name, symbols}) and <= 1.21 (flat).
SPECIALIZATION_FORMATS = ("named", "legacy")
#: Architectures whose prefill-only graph QEfficient changes (and whose continuous-batching
#: prefill-only export it refuses without chunking); QEfficient's own set.
SPECIALIZED_DISAGG_SERVING_MODEL_ARCH = frozenset({"gpt_oss", "qwen3_moe", "glm4_moe", "kimi_k2", "kimi_k25", "gemma4"})


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in valid:
        raise ExportError(f"{name} must be one of {list(valid)}, got {value!r}")


@dataclass(frozen=True)
class ExportOptions:
    """What :func:`export_for_qaic` builds. Every field changes the artifact and is hashed."""

    batch_size: int = field(default=1, metadata=_doc("Decode batch size (the Decode specialization)."))
    prefill_seq_len: int = field(default=32, metadata=_doc("Tokens per prefill call (the Prefill specialization)."))
    ctx_len: int = field(default=128, metadata=_doc("KV-cache capacity per sequence (retained layout dim 2)."))
    kv_cache_prefix: str | None = field(default=None, metadata=_doc("Alphanumeric infix for KV names; None: none."))
    layerwise: bool = field(default=True, metadata=_doc("Lower one decoder block and stitch it L times."))
    kv_precision: str | None = field(
        default=None,
        metadata=_doc(
            "custom_io precision of the KV buffers: None follows the exported dtype (float16, or bfloat16 for a "
            "bfloat16 export on ai200), or 'mxint8'."
        ),
    )
    hw_version: str = field(
        default="ai100",
        metadata=_doc(
            "Card generation, -aic-hw-version: 'ai100' (a bfloat16 checkpoint exports in float32: its compiler has "
            "no bfloat16) or 'ai200' (bfloat16 kept)."
        ),
    )
    full_batch_size: int | None = field(
        default=None,
        metadata=_doc(
            "Continuous batching: the KV cache holds this many sequences and a batch_index input [batch_size, 1] "
            "names each call's rows. None: static batches."
        ),
    )
    prefill_only: bool | None = field(
        default=None,
        metadata=_doc("True: the Prefill specialization only; False: the Decode one only; None: both."),
    )
    retain_full_kv: bool = field(
        default=False,
        metadata=_doc(
            "QEfficient's flag for a decode graph to keep ctx_len KV in sliding-window layers. Every layer's KV "
            "here holds ctx_len already; recorded, and warned about for models it changes nothing for."
        ),
    )
    comp_ctx_lengths_prefill: tuple[int, ...] | None = field(
        default=None, metadata=_doc("Compute-context lengths of the Prefill specializations (CCL).")
    )
    comp_ctx_lengths_decode: tuple[int, ...] | None = field(
        default=None, metadata=_doc("Compute-context lengths of the Decode specializations (CCL).")
    )
    ccl_min_length: int = field(
        default=1024,
        metadata=_doc("CCL lengths below this are raised to it (QEfficient's CCL_MIN_CTX_LEN, 1024)."),
    )
    num_devices: int = field(
        default=1, metadata=_doc("Devices to tensor-slice the model over (MDP); > 1 writes the partition config.")
    )
    specializations_format: str = field(
        default="named",
        metadata=_doc("specializations.json form: 'named' (QEfficient >= 1.22) or 'legacy' (<= 1.21, flat)."),
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
        for name in ("batch_size", "prefill_seq_len", "ctx_len", "num_cores", "num_devices", "ccl_min_length"):
            v = getattr(self, name)
            if not _positive_int(v):
                raise ExportError(f"{name} must be a positive int, got {v!r}")
        _check_choice("hw_version", self.hw_version, HW_VERSIONS)
        _check_choice("specializations_format", self.specializations_format, SPECIALIZATION_FORMATS)
        if self.full_batch_size is not None:
            if not _positive_int(self.full_batch_size):
                raise ExportError(f"full_batch_size must be a positive int or None, got {self.full_batch_size!r}")
            if self.full_batch_size < self.batch_size:
                raise ExportError(
                    f"full_batch_size ({self.full_batch_size}) must be at least batch_size ({self.batch_size}): a "
                    "decode step runs batch_size of the full_batch_size cache rows"
                )
        if self.prefill_only is not None and not isinstance(self.prefill_only, bool):
            raise ExportError(f"prefill_only must be True, False or None, got {self.prefill_only!r}")
        if not isinstance(self.retain_full_kv, bool):
            raise ExportError(f"retain_full_kv must be a bool, got {self.retain_full_kv!r}")
        for name in ("comp_ctx_lengths_prefill", "comp_ctx_lengths_decode"):
            lengths = getattr(self, name)
            if lengths is None:
                continue
            if not isinstance(lengths, tuple) or not lengths or not all(_positive_int(n) for n in lengths):
                raise ExportError(f"{name} must be a non-empty list of positive ints, got {lengths!r}")
            over = [n for n in lengths if n > self.ctx_len]
            if over:
                raise ExportError(
                    f"{name} {list(lengths)} has lengths over ctx_len ({self.ctx_len}): {over}; a compute-context "
                    "length reads that many KV positions, which the cache does not have"
                )
        if self.prefill_seq_len > self.ctx_len:
            raise ExportError(f"prefill_seq_len ({self.prefill_seq_len}) must not exceed ctx_len ({self.ctx_len})")
        validate_kv_cache_prefix(self.kv_cache_prefix)
        rb = self.retained_buffers
        if not isinstance(rb, (tuple, list)) or not all(isinstance(n, str) and n for n in rb):
            raise ExportError(f"retained_buffers must be buffer names (strings), got {rb!r}")
        repeated = sorted({n for n in rb if rb.count(n) > 1})
        if repeated:  # each would be a second graph input of the same name (caught only by onnx.checker)
            raise ExportError(f"retained_buffers names {repeated} more than once; name each buffer once")
        if self.kv_precision is not None:
            _check_choice("kv_precision", self.kv_precision, KV_PRECISIONS)
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
        for name in ("comp_ctx_lengths_prefill", "comp_ctx_lengths_decode"):
            if isinstance(options.get(name), list):
                options[name] = tuple(options[name])
        return cls(**options)

    @property
    def continuous_batching(self) -> bool:
        return self.full_batch_size is not None

    @property
    def compute_context_lengths(self) -> bool:
        return self.comp_ctx_lengths_prefill is not None or self.comp_ctx_lengths_decode is not None

    def replace(self, **changes: Any) -> ExportOptions:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compiler_options"] = dict(self.compiler_options)
        return d

    def compute_hash(self, model_identity: dict[str, Any]) -> str:
        """Short sha256 of every field and the model's identity (sorted-key JSON)."""
        blob = json.dumps({"options": self.as_dict(), "model": model_identity}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
