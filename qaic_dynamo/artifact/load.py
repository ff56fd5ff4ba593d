"""Load an artifact directory: parse and check its layout, and create its session."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort
import torch

from qaic_dynamo.artifact.expressions import shape_function, symbol_function
from qaic_dynamo.artifact.files import LAYOUT_FILE, ONNX_FILE
from qaic_dynamo.artifact.layout import PieceLayout
from qaic_dynamo.errors import ArtifactError
from qaic_dynamo.runtime import BINDABLE, create_session, dtype_name

__all__ = ["Artifact", "load"]


@dataclass
class Artifact:
    """A loaded artifact: its directory, layout and ONNX Runtime session (None when the
    piece has no model). One artifact serves every call site with its fingerprint; each
    call site runs it through a ``runtime.PieceRunner``."""

    path: Path
    layout: PieceLayout
    session: ort.InferenceSession | None
    output_shapes: list[Callable[[dict[str, int]], list[int]]]
    output_dtypes: list[torch.dtype]
    num_threads: int
    #: Each size leaf's expression (``["sym", expr]``) as a function of the symbol values.
    symbol_leaves: dict[str, Callable[[dict[str, int]], int]]

    @property
    def needs_symbols(self) -> bool:
        """Whether a call must evaluate symbol values (dynamic output sizes, size leaves)."""
        return any(
            o["target"][0] == "leaf" and any(isinstance(d, str) for d in o["shape"]) for o in self.layout.outputs
        ) or any(leaf[0] == "sym" for leaf in self.layout.leaves)


def load(path: Path, num_threads: int | None = None) -> Artifact:
    """Load the artifact in ``path``: parse its layout and create its session.

    ``num_threads``: ONNX Runtime intra-op threads (default ``torch.get_num_threads()``).
    Raises ArtifactError if the directory does not hold a loadable artifact.
    """
    path = Path(path)
    try:
        text = (path / LAYOUT_FILE).read_text()
    except OSError as e:
        raise ArtifactError(f"cannot read {path / LAYOUT_FILE}: {e}") from e
    layout = PieceLayout.from_json(text)
    # Evaluated at call time; checked and compiled once, here.
    symbol_leaves = {
        str(leaf[1]): symbol_function(str(leaf[1]), layout.symbols) for leaf in layout.leaves if leaf[0] == "sym"
    }
    dtypes = []
    for o in layout.outputs:
        dtype = getattr(torch, str(o.get("dtype")), None)
        if dtype not in BINDABLE:
            raise ArtifactError(
                f"output {o['name']} is {o.get('dtype')}; the runtime binds {sorted(dtype_name(d) for d in BINDABLE)}"
            )
        dtypes.append(dtype)
    threads = num_threads or torch.get_num_threads()
    session = None
    if layout.has_model:
        try:
            session = create_session(path / ONNX_FILE, threads)
        except Exception as e:
            first = str(e).splitlines()[0]
            raise ArtifactError(f"ONNX Runtime could not load {path / ONNX_FILE}: {first}{_why(first, layout)}") from e
        # Inputs and outputs are bound by name and position from the layout: a layout
        # that does not describe this model would bind tensors to the wrong inputs.
        for kind, declared, actual in (
            ("inputs", layout.inputs, session.get_inputs()),
            ("outputs", layout.outputs, session.get_outputs()),
        ):
            if [d["name"] for d in declared] != [a.name for a in actual]:
                raise ArtifactError(
                    f"{LAYOUT_FILE} names the {kind} {[d['name'] for d in declared]} but "
                    f"{ONNX_FILE} has {[a.name for a in actual]}"
                )
    shapes = [shape_function(o["shape"], layout.symbols) for o in layout.outputs]
    return Artifact(path, layout, session, shapes, dtypes, threads, symbol_leaves)


def _why(message: str, layout: PieceLayout) -> str:
    """What a missing kernel means for a reduced-float piece: ONNX Runtime's CPU kernels
    lack many ops in bfloat16 / float16 (MatMul, Gemm, ...), so the piece runs eagerly
    in that dtype; said plainly, with the way to lower it."""
    missing = re.search(r"Could not find an implementation for (\w+)\((\d+)\)", message)
    reduced = sorted({str(t.get("dtype")) for t in [*layout.inputs, *layout.outputs]} & {"bfloat16", "float16"})
    if missing is None or not reduced:
        return ""
    return (
        f" (ONNX Runtime's CPU kernels have no {missing.group(1)} for {' / '.join(reduced)}: this piece runs "
        f"eagerly in {' / '.join(reduced)}; run the model in float32 to lower it)"
    )
