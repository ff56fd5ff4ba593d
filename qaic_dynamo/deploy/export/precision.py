"""The dtype policy of an export: what a checkpoint is exported in, per card generation.

QEfficient's rules (``_resolve_torch_dtype``, ``CUSTOM_IO_DTYPE_MAP``): the ai100 compiler
has no bfloat16, so a bfloat16 checkpoint is exported in float32 there - weights, KV
cache and logits - and compiled with ``-convert-to-fp16``; ai200 keeps bfloat16, with
bfloat16 custom IO and no ``-convert-to-fp16``. float16 and float32 checkpoints export as
they are, their KV buffers float16 on the card. When both the model and its KV are
bfloat16, ``custom_io.yaml`` is written but not passed to the compiler (QEfficient's own
behaviour: there is nothing to convert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qaic_dynamo.errors import ExportError

__all__ = ["Precision", "custom_io_precision", "resolve_precision"]

#: torch dtype -> the precision a buffer of it has on the card (custom IO).
_CUSTOM_IO = {torch.float32: "float16", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def custom_io_precision(dtype: torch.dtype) -> str:
    """The custom-IO precision of a floating buffer of ``dtype`` on the card."""
    if dtype not in _CUSTOM_IO:
        raise ExportError(f"a {dtype} model cannot be compiled for the card; export it in float32, float16 or bfloat16")
    return _CUSTOM_IO[dtype]


@dataclass(frozen=True)
class Precision:
    """What one export is in."""

    #: The checkpoint's dtype, and the dtype of the exported weights, KV cache and logits.
    source: torch.dtype
    exported: torch.dtype
    #: custom_io precision of the KV buffers.
    kv: str
    #: Whether the compile command converts float32 to float16 (-convert-to-fp16).
    convert_to_fp16: bool
    #: Whether the compile command is given custom_io.yaml.
    pass_custom_io: bool
    #: What changed, for the export summary (None: the checkpoint's dtype as it is).
    note: str | None = None


def resolve_precision(source: torch.dtype, hw_version: str, kv_precision: str | None) -> Precision:
    """The precision an export of a ``source``-dtype checkpoint has on ``hw_version``."""
    exported = torch.float32 if source == torch.bfloat16 and hw_version == "ai100" else source
    io = custom_io_precision(exported)
    if kv_precision is not None and kv_precision not in (io, "mxint8"):
        raise ExportError(
            f"kv_precision={kv_precision!r} does not fit a {str(exported).replace('torch.', '')} export on "
            f"{hw_version}: its KV buffers are {io} on the card, or 'mxint8'"
        )
    kv = kv_precision or io
    note = None
    if exported != source:
        note = (
            f"bfloat16 checkpoint exported in float32 for {hw_version}, whose compiler has no bfloat16: weights, KV "
            "cache and logits are float32 (hw_version='ai200' keeps bfloat16)"
        )
    return Precision(
        source=source,
        exported=exported,
        kv=kv,
        convert_to_fp16=io == "float16",
        pass_custom_io=not (exported == torch.bfloat16 and kv == "bfloat16"),
        note=note,
    )
