"""The compiled-piece artifact: its on-disk format, and :func:`load`.

An artifact is a readable directory, written once by ``lowering`` and read by everyone
after it (the in-process cache, the persistent cache, the runtime, a curious user)::

    model.onnx      the piece in accelerator ONNX (absent for a piece with no compute)
    layout.json     how to call it: PieceLayout below, with its format version
    fingerprint.json  the structural key's inputs (written by the cache, for humans)
    qpc/            qaic-compile's output, with runtime="qaic"

Compile and load are separate stages: this module knows the format and creates the ONNX
Runtime session, and imports neither ``torch.onnx`` nor onnxscript, so a process that
only loads cached artifacts never pays for the exporter. A directory that does not hold
a loadable artifact of this format raises :class:`ArtifactError`; the cache treats that
as a miss and recompiles.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import sympy
import torch
import torch.utils._sympy.functions as sympy_functions

from qaic_dynamo.counter import compilation_counter

__all__ = [
    "Artifact",
    "ArtifactError",
    "LAYOUT_FILE",
    "LAYOUT_FORMAT",
    "MAX_SIZE_CARRIER",
    "SIZE_CARRIER_DTYPE",
    "ONNX_ELEMENT_TYPES",
    "ONNX_FILE",
    "PieceLayout",
    "dtype_name",
    "evaluate_symbol_expression",
    "load",
    "parse_size_assumption",
    "session_options",
    "shape_function",
]

ONNX_FILE = "model.onnx"
LAYOUT_FILE = "layout.json"
#: Bumped whenever PieceLayout or the meaning of a field changes; an artifact of another
#: format is recompiled, never misread.
LAYOUT_FORMAT = 4
#: The dtype of a size carrier: the ONNX input a ``["size", i]`` source binds, a tensor
#: whose length is the piece's int argument i (its values are never read).
SIZE_CARRIER_DTYPE = torch.bool
#: The longest size carrier bound (bytes of one buffer per runner, never written): a larger
#: int, such as a seed Dynamo made dynamic, runs that call eagerly.
MAX_SIZE_CARRIER = 1 << 30

#: torch dtype -> ONNX TensorProto element type: the dtypes an artifact's inputs and
#: outputs may have (as IOBinding takes them; an integer type also covers bfloat16, which
#: numpy has no dtype for).
ONNX_ELEMENT_TYPES: dict[torch.dtype, int] = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.float64: onnx.TensorProto.DOUBLE,
    torch.int64: onnx.TensorProto.INT64,
    torch.int32: onnx.TensorProto.INT32,
    torch.bool: onnx.TensorProto.BOOL,
}

_SYMPY_LOCALS = {name: getattr(sympy_functions, name) for name in dir(sympy_functions) if not name.startswith("_")}


class ArtifactError(RuntimeError):
    """A directory does not hold a loadable artifact of this format; the message says why."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class PieceLayout:
    """How to call an artifact. JSON-serialisable; written next to the ONNX file.

    ``inputs``: one entry per ONNX input, in order: ``{"name", "source"}`` where source is
        ``["arg", i]`` (the piece's i-th argument), ``["size", i]`` (a tensor of
        :data:`SIZE_CARRIER_DTYPE` whose length is the piece's int argument i: a size no
        tensor argument carries as a dimension), ``["cache", u, j]`` (cache j of update
        u, resolved at call time) or ``["slot_mapping"]``.
    ``outputs``: one per ONNX output: ``{"name", "dtype", "shape", "target"}``; target is
        ``["leaf", k]`` or ``["cache", u, j]`` (written in place); shape entries are ints
        or expressions in the canonical symbols.
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
            raise ArtifactError(f"{LAYOUT_FILE} does not match format {LAYOUT_FORMAT}: unknown keys {unknown}, missing {missing}")
        assumptions = data.get("size_assumptions", [])
        if not isinstance(assumptions, list) or not all(isinstance(a, str) for a in assumptions):
            raise ArtifactError(f"{LAYOUT_FILE}: size_assumptions must be a list of strings, got {assumptions!r}")
        for text in assumptions:
            check_size_expression(text, _CANONICAL_SYMBOL.findall(text), "a size assumption", relation=True)
        return cls(**data)


_EXPRESSION_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_]\w*)|\d+(?:\.\d+)?|\*\*|[-+*/%(),])")
# A relation adds comparisons and logic (sympy prints ``S0 <= 10``, ``Eq(Mod(S0, 4), 0)``).
_RELATION_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_]\w*)|\d+(?:\.\d+)?|\*\*|[<>]=?|[-+*/%(),&|~])")
# Names sympy prints in size expressions besides torch's own sympy functions.
_SYMPY_NAMES = frozenset({"Max", "Min", "floor", "ceiling", "Mod", "Abs", "Integer", "Rational"})
_RELATION_NAMES = frozenset({"Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "True", "False"})
_CANONICAL_SYMBOL = re.compile(r"\bS\d+\b")
# Of torch's sympy module only its sympy classes (FloorDiv, CeilDiv, ...), not the modules
# and helpers it imports.
_SYMPY_FUNCTION_NAMES = frozenset(name for name, v in _SYMPY_LOCALS.items()
                                  if isinstance(v, type) and issubclass(v, sympy.Basic))


def check_size_expression(text: str, symbols: Iterable[str], where: str, relation: bool = False) -> None:
    """Refuse a size expression that is not arithmetic over ``symbols`` and sympy's size
    functions (``relation``: or comparisons and logic over such). sympy parses with
    ``eval``, so layout.json must never reach it unchecked: a cache directory someone else
    can write would otherwise run their code."""
    allowed = set(symbols) | _SYMPY_NAMES | _SYMPY_FUNCTION_NAMES | (_RELATION_NAMES if relation else frozenset())
    token = _RELATION_TOKEN if relation else _EXPRESSION_TOKEN
    pos, previous = 0, ""
    while pos < len(text.rstrip()):
        m = token.match(text, pos)
        word = m.group().strip() if m is not None else ""
        # Sizes are small: a long literal is not one, nor a power but of a symbol or a
        # parenthesis by a small integer (sympy evaluates 9**9**9**9 while it parses).
        power_ok = word != "**" or previous == ")" or previous in allowed
        if (m is None or m.end() == pos or (m["name"] is not None and m["name"] not in allowed) or not power_ok
                or (word[:1].isdigit() and len(word) > 20) or (previous == "**" and not (word.isdigit() and len(word) <= 2))):
            bad = m["name"] if m is not None and m["name"] else text[pos:pos + 12]
            raise ArtifactError(f"{LAYOUT_FILE}: {where} {text!r} is not a size expression (at {bad!r})")
        pos, previous = m.end(), word


def shape_function(shape: list[int | str] | None, symbols: dict[str, list[Any]]) -> Callable[[dict[str, int]], list[int]]:
    """Compile an output's shape spec (ints and expressions in canonical symbols) into a
    function of the symbols' values."""
    if shape is None:
        return lambda sym: []
    parts: list[Callable[[dict[str, int]], int]] = []
    for dim in shape:
        if isinstance(dim, int):
            parts.append(lambda sym, d=dim: d)
        elif dim in symbols:
            parts.append(lambda sym, d=dim: sym[d])
        else:
            check_size_expression(str(dim), symbols, "an output size")
            expr = sympy.sympify(dim, locals={**_SYMPY_LOCALS, **{s: sympy.Symbol(s, integer=True) for s in symbols}})
            missing = {str(s) for s in expr.free_symbols} - set(symbols)
            if missing:
                raise ArtifactError(f"an output size {dim} uses {sorted(missing)}, which no input carries")
            parts.append(lambda sym, e=expr: int(e.xreplace({sympy.Symbol(k, integer=True): v for k, v in sym.items()})))
    return lambda sym: [p(sym) for p in parts]


def evaluate_symbol_expression(expr: str, values: dict[str, int]) -> int:
    """The value of a size expression (a ``["sym", expr]`` leaf) for these symbol values."""
    # Parse with the same integer symbols that are substituted (a plain Symbol('S0') is
    # a different symbol from Symbol('S0', integer=True) and would never be replaced).
    symbols = {k: sympy.Symbol(k, integer=True) for k in values}
    return int(sympy.sympify(expr, locals={**_SYMPY_LOCALS, **symbols}).xreplace({symbols[k]: v for k, v in values.items()}))


def parse_size_assumption(text: str) -> sympy.Basic:
    """A ``size_assumptions`` entry as a sympy relation over integer symbols S0, S1, ...
    (checked first, as :meth:`PieceLayout.from_json` checks every entry it reads)."""
    names = _CANONICAL_SYMBOL.findall(text)
    check_size_expression(text, names, "a size assumption", relation=True)
    symbols = {n: sympy.Symbol(n, integer=True) for n in names}
    return sympy.sympify(sympy.sympify(text, locals={**_SYMPY_LOCALS, **symbols}))  # "True" parses to a bool


@dataclass
class Artifact:
    """A loaded artifact: its directory, layout and ONNX Runtime session (None when the
    piece has no model). One artifact serves every call site with its fingerprint."""

    path: Path
    layout: PieceLayout
    session: ort.InferenceSession | None
    output_shapes: list[Callable[[dict[str, int]], list[int]]]
    output_dtypes: list[torch.dtype]
    num_threads: int

    @property
    def needs_symbols(self) -> bool:
        """Whether a call must evaluate symbol values (dynamic output sizes, size leaves)."""
        return any(
            o["target"][0] == "leaf" and any(isinstance(d, str) for d in o["shape"]) for o in self.layout.outputs
        ) or any(leaf[0] == "sym" for leaf in self.layout.leaves)


def session_options(num_threads: int) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = num_threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Spinning worker threads would steal the cores from PyTorch's eager attention that
    # runs between pieces.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # ONNX Runtime's own graph optimizations fold constants at load and then log every
    # initializer the folding left unused, for every session. The models we write have
    # none (lowering removes them); this is the one place ORT's log level is set.
    opts.log_severity_level = 3  # errors only
    return opts


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
    for leaf in layout.leaves:  # evaluated at call time; checked once, here
        if leaf[0] == "sym":
            check_size_expression(str(leaf[1]), layout.symbols, "a size output")
    dtypes = []
    for o in layout.outputs:
        dtype = getattr(torch, str(o.get("dtype")), None)
        if dtype not in ONNX_ELEMENT_TYPES:
            raise ArtifactError(
                f"output {o['name']} is {o.get('dtype')}; the runtime binds {sorted(dtype_name(d) for d in ONNX_ELEMENT_TYPES)}"
            )
        dtypes.append(dtype)
    threads = num_threads or torch.get_num_threads()
    session = None
    if layout.has_model:
        try:
            # EliminateDropout removes every Dropout whose mask is unused, training_mode or
            # not: a training-mode piece from the exporter lost its dropout. EliminateIdentity
            # would remove the Identity nodes that keep float16 roundings (lowering's
            # _keep_reduced_float_roundings).
            session = ort.InferenceSession(
                str(path / ONNX_FILE), sess_options=session_options(threads), providers=["CPUExecutionProvider"],
                disabled_optimizers=["EliminateDropout", "EliminateIdentity"],
            )
        except Exception as e:
            raise ArtifactError(f"ONNX Runtime could not load {path / ONNX_FILE}: {str(e).splitlines()[0]}") from e
        compilation_counter.bump(num_runtime_sessions=1)
        # Inputs and outputs are bound by name and position from the layout: a layout
        # that does not describe this model would bind tensors to the wrong inputs.
        for kind, declared, actual in (("inputs", layout.inputs, session.get_inputs()),
                                       ("outputs", layout.outputs, session.get_outputs())):
            if [d["name"] for d in declared] != [a.name for a in actual]:
                raise ArtifactError(f"{LAYOUT_FILE} names the {kind} {[d['name'] for d in declared]} but "
                                    f"{ONNX_FILE} has {[a.name for a in actual]}")
    shapes = [shape_function(o["shape"], layout.symbols) for o in layout.outputs]
    return Artifact(path, layout, session, shapes, dtypes, threads)
