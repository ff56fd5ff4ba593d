"""The names and format version of an artifact directory's files."""

from __future__ import annotations

__all__ = ["LAYOUT_FILE", "LAYOUT_FORMAT", "ONNX_FILE"]

ONNX_FILE = "model.onnx"
LAYOUT_FILE = "layout.json"
#: Bumped whenever PieceLayout or the meaning of a field changes; an artifact of another
#: format is recompiled, never misread.
LAYOUT_FORMAT = 4
