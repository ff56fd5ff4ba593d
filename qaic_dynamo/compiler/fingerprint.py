"""Structural fingerprint of a graph piece: the key under which its artifact is reused.

The rule it must keep: two pieces that could compute different results never share a key;
two pieces that always compute the same function of their inputs should.

In the key:
  * every node's op kind and target, the dtype and shape Dynamo traced for it (the
    default dtype, autocast and guards change them under the same ops), and every
    argument: references to other nodes by
    position, and the *values* of constants (floats by exact repr, so an RMSNorm eps of
    1e-5 and 1e-6 differ; strings, so a per-layer name in a custom op differs; dtypes,
    devices, slices; tensor constants by a hash of their bytes);
  * every input's kind, dtype, shape and stride, with symbolic sizes written in canonical
    symbols (S0, S1, ... in order of first appearance), so the key does not depend on what
    Dynamo happened to call a symbol;
  * the config hash (fields that change an artifact), the versions of torch, onnx,
    onnxscript, onnxruntime and qaic_dynamo, the artifact layout format, and a digest of
    qaic_dynamo's own code: every ``.py`` file of the package and the built ``_C``
    library (computed once per process, like inductor's ``torch_key``), so an edit under
    an editable install, where the version string stays the same, still misses.
A graph module a node refers to (the branches of ``torch.cond`` and other higher-order ops)
is keyed by its own nodes, as the piece is; any other module by its class, repr and state.
Not in the key: node and placeholder names, the layer's position, and parameter values
(parameters are inputs; their metadata is in the key, their values are not).

A call to a Python function that is not part of torch is keyed by its qualified name, a
hash of its bytecode and constants, and the function object itself. An op of another
library (``torch.ops.mylib.scale``) is keyed by its name: its kernel is not reachable to
hash, nor are the functions a user function calls, their defaults or the globals they
read, so a piece with either (``Fingerprint.unkeyed_ops``) is reused only within the graph
it was compiled for, never from disk (the backend adds that graph to its key).

Not in the key either: the size guards of the compile. An artifact whose lowering relied
on them records them (``PieceLayout.size_assumptions``) and every reuse checks them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import operator
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from qaic_dynamo.artifact import LAYOUT_FORMAT, SymbolNames

__all__ = [
    "CanonicalNames",
    "Fingerprint",
    "KEYED_NAMESPACES",
    "KEYED_PACKAGES",
    "code_digest",
    "fingerprint",
    "library_versions",
    "package_code_digest",
]

#: The package whose code is keyed: qaic_dynamo, all of it.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Fingerprint:
    key: str  # sha256 hex
    inputs: dict[str, Any]  # everything that went into the key, JSON-serialisable
    #: Ops of other libraries in the piece (``mylib::scale``), keyed by name only, and user
    #: functions, keyed by their own code: the kernels and callees lowering inlines are
    #: not in the key, so an edit to one would not change it. Such a piece is cached in
    #: memory only, never on disk.
    unkeyed_ops: tuple[str, ...] = ()

    @property
    def prefix(self) -> str:
        return self.key[:12]


#: Packages whose version is in every key: what traces, lowers, serialises and runs a
#: piece (onnx-ir writes the model; sympy prints the size expressions of the key and layout).
KEYED_PACKAGES = ("torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime", "sympy", "qaic_dynamo")


@functools.cache
def library_versions() -> dict[str, str]:
    versions = {}
    for pkg in KEYED_PACKAGES:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = "not-installed"
    return versions


def code_digest(root: Path = PACKAGE_ROOT) -> str:
    """sha256 over the package's Python sources and built native libraries under ``root``
    (relative path and bytes of each, in sorted order)."""
    h = hashlib.sha256()
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and (p.suffix == ".py" or p.name.startswith("_C") and p.suffix in (".so", ".pyd"))
    )
    for p in files:
        if "__pycache__" in p.parts:
            continue
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


@functools.cache
def package_code_digest() -> str:
    """:func:`code_digest` of the installed package, computed once per process."""
    return code_digest()


class CanonicalNames(SymbolNames):
    """Turns one piece into a JSON-able structure with canonical names.

    Symbols are renamed S0, S1, ... in order of first appearance, exactly as
    ``artifact.canonical_names`` names them for the layout (the inputs first, sizes then
    strides); nodes by position.
    """

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[fx.Node, str] = {}

    # -- inputs -----------------------------------------------------------------------
    def example(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {
                "tensor": str(v.dtype).replace("torch.", ""),
                "param": isinstance(v, torch.nn.Parameter),
                "shape": [self.size(d) for d in v.shape],
                "stride": [self.size(d) for d in v.stride()],
                "device": v.device.type,
            }
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return {"symint": self.expr(v.node.expr)}
        return {"const": self.value(v)}

    # -- arguments --------------------------------------------------------------------
    def value(self, a: Any) -> Any:
        if isinstance(a, fx.Node):
            return {"node": self.nodes[a]}
        if a is None or isinstance(a, str):
            return a
        if isinstance(a, bool):
            return {"bool": a}
        if isinstance(a, int):
            return {"int": a}
        if isinstance(a, float):
            return {"float": repr(a)}  # repr is exact: 1e-05 != 1e-06
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return {"sym": self.expr(a.node.expr)}
        if isinstance(a, (list, tuple)):
            return {type(a).__name__: [self.value(x) for x in a]}
        if isinstance(a, dict):
            return {"dict": [[str(k), self.value(v)] for k, v in sorted(a.items(), key=lambda kv: str(kv[0]))]}
        if isinstance(a, slice):
            return {"slice": [self.value(a.start), self.value(a.stop), self.value(a.step)]}
        if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return {type(a).__name__: str(a)}
        if isinstance(a, torch.Tensor):
            return {"tensor_constant": _tensor_digest(a)}
        if a is Ellipsis:
            return {"ellipsis": True}
        if callable(a):
            return {"callable": _callable_key(a)}
        return {"repr": f"{type(a).__module__}.{type(a).__qualname__}:{a!r}"}


def _tensor_digest(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().cpu().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""  # 0-d cannot view as bytes
    return {
        "dtype": str(t.dtype),
        "shape": list(t.shape),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def _is_user_function(fn: Any) -> bool:
    """A callable from outside torch in the graph (``allow_in_graph``: a function, a bound
    method or a callable object): its own code can be hashed if it has any, but not the
    functions it calls, its defaults, the globals it reads or an object's state."""
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    module = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    keyed = module == "torch" or module.startswith("torch.") or module in _KEYED_MODULES
    return not keyed


#: Python's own modules whose functions appear in graphs (size arithmetic): their
#: behaviour is the interpreter's, whose version is in the key through torch's.
_KEYED_MODULES = frozenset({"operator", "_operator", "builtins", "math", "cmath"})


def _callable_name(fn: Any) -> str:
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"torch.ops.{fn}"
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__
    ident = f"{module}.{name}"
    if _is_user_function(fn) and isinstance(getattr(fn, "__code__", None), types.CodeType):
        # A user function allowed into the graph: its behaviour is its code, constants
        # and closure, so those are the key (a name alone could hide an edit).
        code = fn.__code__
        h = hashlib.sha256(code.co_code)
        h.update(repr(code.co_consts).encode())
        for cell in getattr(fn, "__closure__", None) or ():
            h.update(repr(cell.cell_contents).encode())
        ident += f"#{h.hexdigest()[:16]}"
    return ident


def _callable_key(fn: Any) -> str:
    """A callable as the key has it: its name, and for a user function also the object
    itself. Two functions of the same code may differ in what the hash cannot see (their
    defaults, a closure variable whose repr hides its state, a bound method's ``self``);
    a piece calling one is reused only within its graph (see the backend), where the
    object tells them apart."""
    name = _callable_name(fn)
    return f"{name}@{id(fn):x}" if _is_user_function(fn) else name


def _module_key(mod: torch.nn.Module, canon: CanonicalNames, prefix: str) -> dict[str, Any]:
    """A module a node refers to: a graph module (the branches of ``torch.cond`` and other
    higher-order ops) by its own nodes, keyed like the piece's; any other by its class,
    repr and state."""
    if isinstance(mod, fx.GraphModule):
        return {"graph": _graph_body(mod, canon, prefix)}
    state = {k: _tensor_digest(v) for k, v in mod.state_dict().items()}
    return {"module": f"{type(mod).__module__}.{type(mod).__qualname__}", "repr": repr(mod), "state": state}


def _target(node: fx.Node, gm: fx.GraphModule, canon: CanonicalNames) -> Any:
    if node.op == "call_function":
        if node.target is operator.getitem:
            return "getitem"
        return _callable_key(node.target)
    if node.op == "call_method":
        return f"method:{node.target}"
    if node.op == "get_attr":
        attr = operator.attrgetter(node.target)(gm)
        if isinstance(attr, torch.Tensor):
            return {"get_attr": _tensor_digest(attr)}
        if isinstance(attr, torch.nn.Module):
            # Not by name: two cond branches differing in one constant are two functions.
            return {"get_attr": _module_key(attr, canon, f"{canon.nodes[node]}.")}  # by position, not name
        return {"get_attr": canon.value(attr)}
    if node.op == "call_module":
        return _module_key(operator.attrgetter(node.target)(gm), canon, f"{canon.nodes[node]}.")
    return node.op


def _graph_body(gm: fx.GraphModule, canon: CanonicalNames, prefix: str = "") -> list[Any]:
    """Every node of ``gm`` but its placeholders (named by the caller), in order, with
    nodes referred to by position; a nested graph module's nodes are named under the
    canonical name of the node that refers to it."""
    body: list[Any] = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        canon.nodes.setdefault(node, f"{prefix}in{i}")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        canon.nodes[node] = f"{prefix}n{len(body)}"
        body.append(
            [
                node.op,
                _target(node, gm, canon),
                canon.value(tuple(node.args)),
                canon.value(dict(node.kwargs)),
                _traced_value(node.meta.get("val", node.meta.get("example_value")), canon),
            ]
        )
    return body


def _traced_value(v: Any, canon: CanonicalNames) -> Any:
    """The dtype and shape Dynamo traced for a node. The ops and arguments alone do not fix
    them: ``torch.ones(3)`` follows the default dtype, a matmul the ambient autocast, and
    ``x[:16]`` is ``[s0]`` or ``[16]`` depending on which side of a guard the graph was
    traced - each computes something else under the same nodes."""
    if isinstance(v, torch.Tensor):
        return {"dtype": str(v.dtype).replace("torch.", ""), "shape": [canon.size(d) for d in v.shape]}
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return canon.size(v)
    if isinstance(v, (list, tuple)):
        return [_traced_value(x, canon) for x in v]
    return None


#: Namespaces of ops whose kernels the key covers: torch's own (its version is in the key)
#: and qaic's (the package's code digest is).
KEYED_NAMESPACES = frozenset(
    {
        "aten",
        "prims",
        "rngprims",
        "higher_order",
        "_c10d_functional",
        "c10d_functional",
        "_dtensor",
        "quantized",
        "_quantized",
        "profiler",
        "inductor",
        "onnx",
        "qaic",
    }
)


def _unkeyed_ops(gm: fx.GraphModule) -> set[str]:
    found: set[str] = set()
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            if str(target).split(".", 1)[0] not in KEYED_NAMESPACES:  # "mylib.scale.default"
                found.add(str(target))
        elif node.op == "call_function" and _is_user_function(target):  # what it calls is not in the key
            found.add(_callable_name(target))
        elif node.op in ("get_attr", "call_module"):
            sub = operator.attrgetter(node.target)(gm)
            if isinstance(sub, fx.GraphModule):
                found |= _unkeyed_ops(sub)
    return found


def fingerprint(gm: fx.GraphModule, example_args: Sequence[Any], config_hash: str) -> Fingerprint:
    canon = CanonicalNames()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_args):
        raise ValueError(f"fingerprint: the piece has {len(placeholders)} inputs but {len(example_args)} example args")
    inputs = []
    for i, (node, arg) in enumerate(zip(placeholders, example_args)):
        canon.nodes[node] = f"in{i}"
        inputs.append(canon.example(arg))
    body = _graph_body(gm, canon)
    payload = {
        "format": 4,
        "inputs": inputs,
        "graph": body,
        "config_hash": config_hash,
        "versions": library_versions(),
        "code": package_code_digest(),
        "layout_format": LAYOUT_FORMAT,
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return Fingerprint(hashlib.sha256(blob.encode()).hexdigest(), payload, tuple(sorted(_unkeyed_ops(gm))))
