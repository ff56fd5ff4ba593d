"""PieceLayout: how to call an artifact, written as ``layout.json`` beside its ONNX model."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from qaic_dynamo.artifact.expressions import CANONICAL_SYMBOL, check_size_expression
from qaic_dynamo.artifact.files import LAYOUT_FILE, LAYOUT_FORMAT
from qaic_dynamo.errors import ArtifactError

__all__ = ["PieceLayout"]


@dataclass
class PieceLayout:
    """How to call an artifact. JSON-serialisable; written next to the ONNX file.

    ``inputs``: one entry per ONNX input, in order: ``{"name", "source"}`` where source is
        ``["arg", i]`` (the piece's i-th argument), ``["size", i]`` (a tensor of
        :data:`SIZE_CARRIER_DTYPE` whose length is the piece's int argument i: a size no
        tensor argument carries as a dimension), ``["cache", u, j]`` (cache j of update
        u, resolved at call time) or ``["slot_mapping"]``.
    ``outputs``: one per ONNX output: ``{"name", "dtype", "shape", "target"}``; target is
        ``["leaf", k]``, ``["cache", u, j]`` (written in place) or ``["check", api_name,
        is_matrix]`` (an ``info`` tensor the runner passes to
        ``aten._linalg_check_errors`` after each run: eager's linear-algebra errors) or
        ``["eager_unless", why]`` (a bool: where False, the call runs eagerly instead) or
        ``["write", i]`` (argument i's value after the piece's in-place writes, which the
        runner copies into it);
        shape entries are ints or expressions in the canonical symbols.
    ``leaves``: the piece's flattened outputs: ``["onnx", i]``, ``["arg", i]`` (an input
        passed through), ``["dep", dtype]`` (a dependency token), ``["sym", expr]`` or
        ``["const", value]``.
    ``symbols``: canonical symbol -> ``["dim", arg, dim]`` or ``["int", arg]``.
    ``kv_updates``: per cache update, in call order: ``{"op", "layer_name", "names",
        "cache_dims"}``.
    ``has_model``: False for a piece with no compute (its leaves are inputs, constants
        and sizes only): there is no ``model.onnx`` and no session.
    ``size_assumptions``: size guards the lowering's trace took (a branch a decomposition
        took on a dynamic size) that held because of the guards of the compile it was
        lowered in, as relations in the canonical symbols; a reuse by another compile
        must imply them too (``lowering.unmet_size_assumptions``).
    """

    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    leaves: list[list[Any]]
    out_spec: str
    symbols: dict[str, list[Any]]
    kv_updates: list[dict[str, Any]]
    num_args: int
    has_model: bool = True
    size_assumptions: list[str] = field(default_factory=list)
    export_seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    format: int = LAYOUT_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PieceLayout:
        """Parse a layout; anything but this format's layout is an ArtifactError."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ArtifactError(f"{LAYOUT_FILE} is not JSON: {e}") from e
        if not isinstance(data, dict):
            raise ArtifactError(f"{LAYOUT_FILE} holds a {type(data).__name__}, not a layout object")
        if data.get("format") != LAYOUT_FORMAT:
            raise ArtifactError(
                f"{LAYOUT_FILE} is layout format {data.get('format', 1)!r}; this version of qaic_dynamo "
                f"reads format {LAYOUT_FORMAT}"
            )
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        unknown, missing = sorted(set(data) - names), sorted(required - set(data))
        if unknown or missing:
            raise ArtifactError(
                f"{LAYOUT_FILE} does not match format {LAYOUT_FORMAT}: unknown keys {unknown}, missing {missing}"
            )
        assumptions = data.get("size_assumptions", [])
        if not isinstance(assumptions, list) or not all(isinstance(a, str) for a in assumptions):
            raise ArtifactError(f"{LAYOUT_FILE}: size_assumptions must be a list of strings, got {assumptions!r}")
        for text in assumptions:
            check_size_expression(text, CANONICAL_SYMBOL.findall(text), "a size assumption", relation=True)
        return cls(**data)
