"""Outputs that eager returns as views stay views: taken out of the compiled graph and
rebuilt by a small eager epilogue.

An artifact's outputs are new tensors, so a compiled view - of an input, or of another
output - would come back as a copy, and a write into it would no longer reach its base.
Before the split, :func:`peel_view_outputs` takes such outputs out of the graph and keeps
them as an epilogue that runs the same view ops on the real base after the compiled
graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from qaic_dynamo._compat import FakeTensor

__all__ = ["ViewOutputs", "aliased_outputs", "peel_view_outputs"]


# Ops that may return a view of their first argument. Which of them does is read from
# Dynamo's fake values (``reshape``, ``contiguous`` and ``to`` alias only sometimes), and
# each rebuilt view is checked against them; the list keeps out ops that alias by writing
# in place (``add_`` returns its input).
_VIEW_NAMES = frozenset(
    {
        "alias",
        "as_strided",
        "atleast_1d",
        "atleast_2d",
        "atleast_3d",
        "broadcast_to",
        "chunk",
        "contiguous",
        "detach",
        "diagonal",
        "dsplit",
        "expand",
        "expand_as",
        "flatten",
        "getitem",
        "__getitem__",
        "hsplit",
        "movedim",
        "moveaxis",
        "narrow",
        "permute",
        "reshape",
        "reshape_as",
        "select",
        "split",
        "split_with_sizes",
        "squeeze",
        "swapaxes",
        "swapdims",
        "t",
        "tensor_split",
        "to",
        "transpose",
        "type_as",
        "unbind",
        "unflatten",
        "unsafe_chunk",
        "unsafe_split",
        "unsafe_split_with_sizes",
        "unfold",
        "unsqueeze",
        "view",
        "view_as",
        "view_as_complex",
        "view_as_real",
        "vsplit",
        "float",
        "double",
        "half",
        "bfloat16",
        "int",
        "long",
        "bool",  # same dtype: returns self
        # complex views: a lazily conjugated view, the real / imaginary parts
        "conj",
        "_conj",
        "adjoint",
        "real",
        "imag",
        "resolve_conj",  # return self when nothing is lazy
        "resolve_neg",
    }
)


def _view_name(node: fx.Node) -> str | None:
    """The op's name if ``node`` is a call of one of :data:`_VIEW_NAMES`, else None."""
    if node.op == "call_method":
        name = node.target
    elif node.op != "call_function":
        return None
    elif isinstance(node.target, torch._ops.OpOverload):
        if node.target._schema.is_mutable:
            return None
        name = node.target._schema.name.split("::")[-1]
    elif isinstance(node.target, torch._ops.OpOverloadPacket):
        if any(getattr(node.target, o)._schema.is_mutable for o in node.target.overloads()):
            return None
        name = node.target._qualified_op_name.split("::")[-1]
    else:
        name = getattr(node.target, "__name__", None)
    return name if name in _VIEW_NAMES else None


def _value(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _storages(value: Any) -> set[Any]:
    """The storages of a (fake) tensor, or of the tensors in a tuple or list of them."""
    if isinstance(value, torch.Tensor):
        return {StorageWeakRef(value.untyped_storage())}
    if isinstance(value, (tuple, list)):
        return {s for v in value for s in _storages(v)}
    return set()


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list, dict)):
        return any(_holds_tensor(v) for v in (value.values() if isinstance(value, dict) else value))
    return False


def _view_chain(node: fx.Node) -> list[fx.Node]:
    """``node`` and the view ops it was made from, back to (not including) the node whose
    storage it shares: a placeholder or a computed tensor. Empty if ``node`` is no view."""
    if not isinstance(_value(node), torch.Tensor):
        return []
    storage = StorageWeakRef(_value(node).untyped_storage())
    chain = []
    while (
        _view_name(node) is not None
        and node.args
        and isinstance(node.args[0], fx.Node)
        and storage in _storages(_value(node.args[0]))
        and (isinstance(_value(node.args[0]), torch.Tensor) or _view_name(node.args[0]) is not None)
    ):
        # (a tuple only from a view op: ``getitem`` of ``max(x, 0)``'s new tensors is no view)
        chain.append(node)
        node = node.args[0]
    return chain if isinstance(_value(node), torch.Tensor) else []


@dataclass
class ViewOutputs:
    """A graph whose view outputs were taken out (:func:`peel_view_outputs`).

    ``inner`` is the graph to compile: the other outputs, then the computed bases the views
    need. ``epilogue`` runs eagerly after it, on the graph's inputs followed by ``inner``'s
    outputs, and returns the original outputs in their order."""

    inner: fx.GraphModule
    epilogue: fx.GraphModule
    #: Output position -> what it is a view of, for the compile report.
    views: dict[int, str]

    def around(self, compiled: Callable[..., Sequence[Any]]) -> Callable[..., Any]:
        """A callable running ``compiled`` (``inner``'s compiled form), then the epilogue."""
        epilogue = self.epilogue.forward

        def run(*args: Any) -> Any:
            return epilogue(*args, *compiled(*args))

        run.view_outputs = self  # inspectable from what the backend returns
        return run


def peel_view_outputs(gm: fx.GraphModule) -> ViewOutputs | None:
    """Take out the outputs that are views of an input or of another output, or None if
    there are none.

    Eager returns ``x.t()`` as a view of ``x``, and ``y, y[0:2]`` sharing one storage; a
    compiled piece's outputs are new tensors each. So each such output is rebuilt after the
    compiled graph by the same view ops, run eagerly on the real base (Dynamo's guards keep
    their aliasing as it was traced); ops that alias only sometimes (``reshape``,
    ``contiguous``) then decide for themselves, as in eager. The graph given is not
    changed. Views of an intermediate value that no other output shares stay compiled: a
    copy is indistinguishable there. A view whose sizes come from a tensor computed inside
    the graph (not an input or its base) stays compiled too, as before, and so does one
    the epilogue would not rebuild as Dynamo traced it (checked on the fake values: a base
    reshaped in place after the view), and every view in a graph that switches grad mode.
    """
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = output.args[0]
    if not isinstance(outs, (tuple, list)) or not any(_view_chain(o) for o in outs if isinstance(o, fx.Node)):
        return None
    if any(n.op == "call_function" and n.target is torch._C._set_grad_enabled for n in gm.graph.nodes):
        return None  # a view made under no_grad() inside the graph would be rebuilt in the caller's mode
    return _peel(gm, frozenset())


def _peel(gm: fx.GraphModule, skip: frozenset[int]) -> ViewOutputs | None:
    """:func:`peel_view_outputs`, leaving the outputs at ``skip`` compiled."""
    outs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    chains = {i: _view_chain(o) if isinstance(o, fx.Node) and i not in skip else [] for i, o in enumerate(outs)}
    roots = {i: (chain[-1].args[0] if chain else outs[i]) for i, chain in chains.items()}
    shared: dict[fx.Node, int] = {}
    for i, chain in chains.items():
        if chain:
            shared[roots[i]] = shared.get(roots[i], 0) + 1
    plain = {o for i, o in enumerate(outs) if not chains[i]}

    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    peeled: dict[int, list[fx.Node]] = {}
    for i, chain in chains.items():
        root = roots[i]
        if not chain or not (root.op in ("placeholder", "get_attr") or root in plain or shared[root] > 1):
            continue
        needed = _epilogue_nodes(chain, root)
        if needed is not None:
            peeled[i] = needed
    if not peeled:
        return None

    bases = [o for i, o in enumerate(outs) if i not in peeled]
    bases += [
        r for r in dict.fromkeys(roots[i] for i in peeled) if r.op not in ("placeholder", "get_attr") and r not in bases
    ]
    inner_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inner_graph.graph_copy(gm.graph, env)
    inner_graph.output(tuple(env[b] for b in bases))
    dropped = {env[n] for nodes in peeled.values() for n in nodes}
    for node in reversed(list(inner_graph.nodes)):  # views nobody reads now; never an op with effects
        if node in dropped and not node.users:
            inner_graph.erase_node(node)
    inner = fx.GraphModule(gm, inner_graph)

    epilogue_graph = fx.Graph()
    env = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = epilogue_graph.node_copy(node, lambda n: env[n])
    for k, base in enumerate(bases):
        env[base] = epilogue_graph.placeholder(f"inner_out_{k}")
        env[base].meta = dict(base.meta)
    for node in sorted({n for nodes in peeled.values() for n in nodes} - set(env), key=order.__getitem__):
        env[node] = epilogue_graph.node_copy(node, lambda n: env[n])
    epilogue_graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outs))
    epilogue = fx.GraphModule(gm, epilogue_graph)

    # The epilogue rebuilds each view from its base's final state: an in-place change of
    # shape after the view was taken (``y.t_()``, ``v.squeeze_(1)``) would be lost or
    # applied twice. Run it on Dynamo's fake values and keep only the views it rebuilds as
    # Dynamo traced them; the others stay compiled, as copies.
    rebuilt = _rebuilt_on_fakes(gm, epilogue, bases)
    wrong = [i for i in peeled if rebuilt is None or not _same_view(rebuilt[i], _value(outs[i]))]
    if wrong:
        return _peel(gm, skip | frozenset(wrong)) if len(wrong) < len(peeled) else None

    views = {}
    for i in peeled:
        root = roots[i]
        views[i] = (
            f"input {root.target}"
            if root.op == "placeholder"
            else f"attribute {root.target}"
            if root.op == "get_attr"
            else f"output {outs.index(root)}"
            if root in plain
            else f"{root.name}, computed"
        )
    return ViewOutputs(inner, epilogue, views)


def _epilogue_nodes(chain: list[fx.Node], root: fx.Node) -> list[fx.Node] | None:
    """The nodes rebuilding a view from its root: the chain of view ops and the size
    arithmetic their arguments need. None if an argument needs a tensor the epilogue will
    not have (one computed inside the graph, other than the root)."""
    needed: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(node: fx.Node) -> bool:
        if node in seen or node.op == "placeholder" or (node is root and root.op != "get_attr"):
            return True
        seen.add(node)
        if node.op == "get_attr":  # the module's own tensor, which the epilogue shares
            needed.append(node)
            return True
        value = _value(node)
        if node not in chain and (
            node.op not in ("call_function", "call_method") or value is None or _holds_tensor(value)
        ):
            return False
        if not all(visit(n) for n in node.all_input_nodes):
            return False
        needed.append(node)
        return True

    return needed if all(visit(n) for n in chain) else None


def _rebuilt_on_fakes(gm: fx.GraphModule, epilogue: fx.GraphModule, bases: list[fx.Node]) -> tuple | None:
    """The epilogue's outputs computed from the graph's fake values, or None if it cannot
    be run on them."""
    placeholders = [_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    args = [*placeholders, *(_value(b) for b in bases)]
    # The values' own mode: torch 2.13 gives a backend a fresh one in TracingContext.
    fake_mode = next((a.fake_mode for a in args if isinstance(a, FakeTensor)), None)
    if fake_mode is None or any(a is None for a in args):
        return None

    class OnFakes(fx.Interpreter):
        def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:  # the module's real tensor, as a fake
            value = super().get_attr(target, args, kwargs)
            return fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    try:
        with fake_mode:
            return tuple(OnFakes(epilogue).run(*args))
    except Exception:  # noqa: BLE001 - any failure: keep the outputs compiled, as before
        return None


def _same_view(rebuilt: Any, traced: Any) -> bool:
    """Whether a rebuilt view is the tensor Dynamo traced: same storage, sizes, strides,
    offset and autograd flag (symbolic sizes compare as expressions, with no guard)."""
    if not isinstance(rebuilt, torch.Tensor) or not isinstance(traced, torch.Tensor):
        return False

    def same(a: Any, b: Any) -> bool:
        return all(str(x) == str(y) for x, y in zip(a, b, strict=True)) if len(a) == len(b) else False

    return (
        StorageWeakRef(rebuilt.untyped_storage()) == StorageWeakRef(traced.untyped_storage())
        and same(rebuilt.shape, traced.shape)
        and same(rebuilt.stride(), traced.stride())
        and str(rebuilt.storage_offset()) == str(traced.storage_offset())
        and rebuilt.dtype == traced.dtype
        and rebuilt.requires_grad == traced.requires_grad
    )


def aliased_outputs(gm: fx.GraphModule) -> str | None:
    """Why the graph's outputs cannot be compiled as new tensors, or None: two outputs
    that share a storage in eager without one being a view of the other that
    :func:`peel_view_outputs` rebuilt - ``y, y.relu_()`` (an in-place op returns its
    input), ``y, y.unsqueeze(0).mul_(3)``. Compiled, they would come back as two tensors,
    and a write to one would not reach the other."""
    outs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    if not isinstance(outs, (tuple, list)):
        return None
    seen: dict[Any, tuple[int, fx.Node]] = {}
    for i, o in enumerate(outs):
        value = _value(o)
        if not isinstance(o, fx.Node) or not isinstance(value, torch.Tensor) or o.op in ("placeholder", "get_attr"):
            continue
        storage = StorageWeakRef(value.untyped_storage())
        if storage in seen and seen[storage][1] is not o:
            j, other = seen[storage]
            return f"outputs {j} ({other.name}) and {i} ({o.name}) share one tensor's memory through an in-place op"
        seen.setdefault(storage, (i, o))
    return None
