"""Python floats that Dynamo left dynamic: compiled once per value.

Under ``dynamic=True`` (or once a float changed between two compiles of one code object)
Dynamo passes a Python float as a 0-d tensor input read back with ``item()``. ONNX has
no symbolic floats, so :class:`PerFloatValue` compiles the graph once per value those
floats take, with the values in as constants.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from qaic_dynamo._compat import FakeTensor, compile_session, dynamo_compile_lock, free_symbols
from qaic_dynamo.compiler.collector import collector_paused
from qaic_dynamo.runtime import warn_fallback

if TYPE_CHECKING:
    from qaic_dynamo.compiler.backend import QaicBackend

__all__ = ["MAX_FLOAT_VARIANTS", "PerFloatValue", "dynamic_float_inputs", "scalar_arithmetic", "specialize_floats"]

MAX_FLOAT_VARIANTS = 8  # values compiled per graph before the rest run eagerly (Dynamo's own limit)


def dynamic_float_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[int, float]:
    """Graph inputs that carry a Python float Dynamo did not specialise, by position, with
    the example's value.

    Under ``dynamic=True`` (or once a float changed between two compiles of one code
    object, e.g. two models of one class with different ``eps``) Dynamo passes the float as
    a 0-d tensor and reads it back with ``item()``. ONNX has no symbolic floats, so a piece
    that uses the number (an attention ``scale``, ``x.add(eps)``) could not be lowered and
    ran eagerly. Only inputs read solely through ``item()`` with a real example value count,
    and only where the number is used as it is or through Python arithmetic on numbers alone
    (``s * 2``, ``math.sqrt(2 / math.pi)`` in GPT-2's and Phi's GELU: :func:`scalar_arithmetic`,
    computed once the values are in). A size computed from one, or arithmetic that mixes it
    with a dynamic size, keeps its symbol in Dynamo's values of later nodes, which the split
    and the lowering read, so such a graph is left as it was (its pieces run eagerly, with a
    warning)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found: dict[int, tuple[float, set[Any]]] = {}
    for i, (node, example) in enumerate(zip(placeholders, example_inputs)):
        if (
            isinstance(example, torch.Tensor)
            and not isinstance(example, FakeTensor)
            and example.dim() == 0
            and example.is_floating_point()
            and node.users
            and all(u.op == "call_method" and u.target == "item" for u in node.users)
        ):
            found[i] = (example.item(), {s for u in node.users for s in free_symbols(u.meta.get("example_value"))})
    # Until nothing changes: arithmetic counts as computed only if every float it reads is
    # kept (``a * b`` with ``b`` mixed with a size keeps ``a``'s symbol too).
    while found:
        reads = {u for i in found for u in placeholders[i].users}
        computed = scalar_arithmetic(gm, reads)
        elsewhere = {
            s
            for n in gm.graph.nodes
            if n.op != "placeholder" and n not in reads and n not in computed
            for s in free_symbols(n.meta.get("example_value"))
        }
        kept = {i: v for i, v in found.items() if not v[1] & elsewhere}
        if len(kept) == len(found):
            break
        found = kept
    return {i: value for i, (value, _) in found.items()}


#: torch's functions on Python numbers that Dynamo records for math on a symbolic float or
#: int (``math.sqrt`` -> ``torch._sym_sqrt``); with ``operator``'s and ``math``'s, what
#: :func:`scalar_arithmetic` may compute itself.
_SYM_FUNCTIONS = frozenset(
    f
    for name, f in vars(torch).items()
    if callable(f)
    and (
        name.startswith("_sym_")
        or name in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum")
    )
)


def _is_number_function(target: Any) -> bool:
    return target in _SYM_FUNCTIONS or getattr(target, "__module__", None) in ("_operator", "math")


def scalar_arithmetic(gm: fx.GraphModule, reads: set[fx.Node]) -> set[fx.Node]:
    """The nodes computing a Python number from ``reads`` (the float inputs' ``item()``)
    and constants alone, through ``operator``, ``math`` or torch's ``sym_*`` functions:
    once the floats are constants, :func:`specialize_floats` computes them in Python, in
    double precision as eager does, so no symbolic float is left for the split."""
    number = (torch.SymFloat, torch.SymInt, torch.SymBool, float, int, bool)
    computed: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if (
            n.op == "call_function"
            and _is_number_function(n.target)
            and isinstance(n.meta.get("example_value"), number)
            and n.all_input_nodes
            and all(d in reads or d in computed for d in n.all_input_nodes)
        ):
            computed.add(n)
    return computed


def specialize_floats(gm: fx.GraphModule, values: dict[int, float]) -> None:
    """Put each value in place of its input's ``item()`` reads (the input stays, unused),
    then compute the Python arithmetic on them (:func:`scalar_arithmetic`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    reads = {u for position in values for u in placeholders[position].users}
    computed = scalar_arithmetic(gm, reads)
    constants: dict[fx.Node, Any] = {}
    for position, value in values.items():
        for item in placeholders[position].users:
            constants[item] = value
    for n in gm.graph.nodes:  # in order: a computed node's inputs are constants by now
        if n in computed:
            args = fx.node.map_arg(n.args, lambda a: constants[a])
            kwargs = fx.node.map_arg(n.kwargs, lambda a: constants[a])
            constants[n] = n.target(*args, **kwargs)
    for node in reversed(list(constants)):
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda a, node=node: constants[node] if a is node else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a, node=node: constants[node] if a is node else a)
        gm.graph.erase_node(node)
    gm.recompile()


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (node meta copied shallowly, so
    Dynamo's fake values are shared, not cloned)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _float_key(value: float) -> str:
    return value.hex()  # exact, and NaN and -0.0 are keys of their own


class PerFloatValue:
    """A graph with dynamic float inputs, compiled once per value those floats take.

    Each compile puts the values in as constants, and every call reads the floats (one
    ``item()`` each) to pick the variant compiled for them - a value not seen yet compiles
    its own, from a pristine copy of the graph - so no call is served an artifact built for
    another value. Past
    :data:`MAX_FLOAT_VARIANTS` values the graph runs eagerly for the new ones, with a
    warning."""

    def __init__(
        self,
        backend: QaicBackend,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        floats: dict[int, float],
        grad_mode: bool,
    ) -> None:
        self.backend = backend
        self.grad_mode = grad_mode
        self.positions = tuple(floats)
        self.pristine = _copy_graph_module(gm)  # before the first variant rewrites gm
        self._names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self._lock = threading.Lock()
        self._warned = False
        self.variants: dict[tuple[str, ...], Callable[..., Any]] = {}
        self.variants[tuple(_float_key(v) for v in floats.values())] = self._compile(gm, example_inputs, floats)

    def _compile(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], floats: dict[int, float]
    ) -> Callable[..., Any]:
        try:
            specialize_floats(gm, floats)
        except (ArithmeticError, ValueError):
            # The graph's own arithmetic fails at these values (``math.sqrt(-s)``, ``1 / s``
            # at 0): nothing was changed, and run as it is the graph raises eager's error.
            return gm.forward
        return self.backend.compile_graph(
            gm, example_inputs, self.grad_mode, {self._names[i]: v for i, v in floats.items()}
        )

    def __call__(self, *args: Any) -> Any:
        key = tuple(_float_key(float(args[i])) for i in self.positions)
        compiled = self.variants.get(key)
        if compiled is None:
            compiled = self._new_variant(key, args)
        return compiled(*args)

    def _new_variant(self, key: tuple[str, ...], args: Sequence[Any]) -> Callable[..., Any]:
        # Lowering traces with make_fx, which raises torch.fx's process-wide tracing flag;
        # outside a compile session, a call of any compiled function on another thread
        # then raises (Dynamo takes it for FX tracing a compiled function). A compile at
        # call time is a compile session as Dynamo's own are, under Dynamo's lock (taken
        # first, as Dynamo's compiles do, so the two locks are always taken in one order).
        with dynamo_compile_lock(), self._lock:
            if key in self.variants:
                return self.variants[key]
            if len(self.variants) >= MAX_FLOAT_VARIANTS:
                if not self._warned:  # counted and warned once per graph
                    self._warned = True
                    warn_fallback(
                        f"a graph with dynamic float inputs {[self._names[i] for i in self.positions]}",
                        f"they took more than {MAX_FLOAT_VARIANTS} values; calls with a new value run "
                        "eagerly (for Python floats, torch._dynamo.config.specialize_float = True makes "
                        "Dynamo guard and recompile per value instead)",
                    )
                return self.pristine.forward
            with compile_session(), collector_paused(), torch.set_grad_enabled(self.grad_mode):
                compiled = self._compile(
                    _copy_graph_module(self.pristine), args, {i: float(args[i]) for i in self.positions}
                )
            self.variants[key] = compiled
            return compiled
