"""The backend's output in a form Dynamo's precompile can save, and its rebuild on load.

Dynamo's precompile (``aot_compile``) saves a traced frame - its transformed bytecode,
guards and the backend's output - and another process runs it without tracing. The
backend's output must then serialize itself (``SerializableCallable``). A
:class:`SavedGraph` wraps what :class:`~qaic_dynamo.compiler.backend.QaicBackend` returns:
the split graph, whose compilable pieces are ``PieceRunner`` s over ONNX Runtime sessions.
Sessions are not data, so a runner is saved as what rebuilds it - its piece's cache key,
its eager graph and label - and on load the artifact comes back from the persistent cache
(a memory hit when this process already holds it). An artifact that is gone (evicted,
cleared) fails the load with :class:`~qaic_dynamo.errors.PrecompileError`; the caller
traces again.

Not every output can be saved: a piece reused only inside its graph (its key does not
cover the kernels it calls, so it is never on disk), a graph compiled once per float value,
or one with an eager view epilogue. Such an output still runs; saving it raises
PrecompileError naming why.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from qaic_dynamo.cache import DiskCache, artifact_cache
from qaic_dynamo.config import CompilationConfig
from qaic_dynamo.errors import PrecompileError
from qaic_dynamo.runtime import PieceRunner

__all__ = ["SavedGraph", "loading_config"]

_FORMAT = 3
_loading = threading.local()


@contextlib.contextmanager
def loading_config(config: CompilationConfig) -> Iterator[None]:
    """The config a :class:`SavedGraph` loaded in this block uses (its cache, threads).

    Dynamo's deserializer calls ``deserialize_compile_artifacts(bytes)`` with nothing
    else, and the saved config's cache directory may not be the loading process's."""
    previous = getattr(_loading, "config", None)
    _loading.config = config
    try:
        yield
    finally:
        _loading.config = previous


class SavedGraph:
    """What the backend returned, callable as it is, and savable when :attr:`why_not` is None.

    Dynamo's ``SerializableCallable`` protocol (the two classmethods below); the adapter
    registers the class as one when it hands it to Dynamo, so importing this module does
    not import Dynamo."""

    def __init__(self, compiled: Callable[..., Any], config: CompilationConfig) -> None:
        self.compiled = compiled
        self.config = config
        self.why_not = _why_not_savable(compiled)

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: SavedGraph) -> bytes:
        if fn.why_not is not None:
            raise PrecompileError(f"the compiled graph cannot be saved: {fn.why_not}")
        split: fx.GraphModule = fn.compiled.__self__
        runners = {}
        modules = {}
        for name, child in split.named_children():
            if isinstance(child, PieceRunner):
                eager = child.eager.data if isinstance(child.eager, _LazyGraph) else pickle.dumps(child.eager)
                runners[name] = (child.cache_key, child.label, child.differentiable, eager)
                modules[name] = torch.nn.Module()  # a stand-in (a leaf to fx), replaced on load
            else:
                modules[name] = child
        # The split graph as its generated code: the runners are rebuilt on load.
        return pickle.dumps({"format": _FORMAT, "graph": _pack(split, modules), "runners": runners})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> SavedGraph:
        config = getattr(_loading, "config", None)
        if config is None:
            raise PrecompileError("a saved qaic graph loads only inside qaic_dynamo's precompile loader")
        state = pickle.loads(data)
        if state.get("format") != _FORMAT:
            raise PrecompileError(f"saved graph format {state.get('format')} is not {_FORMAT}")
        graph = _unpack(state["graph"])
        disk = DiskCache.get(config.resolved_cache_dir(), config.cache_size_limit) if config.cache else None
        threads = config.num_threads or torch.get_num_threads()
        for name, (key, label, differentiable, eager) in state["runners"].items():
            artifact = artifact_cache.lookup(key, disk=disk, num_threads=threads)
            if artifact is None:
                raise PrecompileError(f"{label}: its artifact {key[:12]} is no longer in the cache")
            runner = PieceRunner(artifact, _LazyGraph(eager), config, label)
            runner.cache_key = key
            runner.differentiable = differentiable
            setattr(graph, name, runner)
        return cls(graph.forward, config)


class _CodeModule(torch.nn.Module):
    """A graph module rebuilt from its generated code, without the ``torch.fx`` trace that
    unpickling a GraphModule runs (most of a saved graph's load time)."""


def _pack(module: torch.nn.Module, children: dict[str, torch.nn.Module] | None = None) -> tuple:
    """``module`` for :func:`_unpack`: a graph module as its code, the globals the code
    names (modules by name) and its children, packed alike; anything else pickled."""
    if not isinstance(module, fx.GraphModule) or any(n.op == "get_attr" for n in module.graph.nodes):
        return ("pickle", pickle.dumps(module))
    code = module.graph.python_code(root_module="self")
    names = []
    for name, value in code.globals.items():
        if isinstance(value, types.ModuleType):
            names.append((name, "module", value.__name__))
        else:
            names.append((name, "value", value))  # builtins, types, floats: pickled by reference
    children = dict(module.named_children()) if children is None else children
    return ("code", code.src, names, {name: _pack(child) for name, child in children.items()})


def _unpack(packed: tuple) -> torch.nn.Module:
    if packed[0] == "pickle":
        return pickle.loads(packed[1])
    _, src, names, children = packed
    scope = {name: importlib.import_module(v) if kind == "module" else v for name, kind, v in names}
    exec(compile(src, "<qaic saved graph>", "exec"), scope)  # noqa: S102  (fx's own generated code)
    module = _CodeModule()
    for name, child in children.items():
        setattr(module, name, _unpack(child))
    module.forward = types.MethodType(scope["forward"], module)
    return module


class _LazyGraph:
    """A runner's eager graph, unpickled at its first call: it runs only if ONNX Runtime
    fails the piece, and unpickling a GraphModule traces its code again (most of a
    saved graph's load time, were every piece's unpickled up front)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._graph: fx.GraphModule | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        if self._graph is None:
            with self._lock:
                if self._graph is None:
                    self._graph = pickle.loads(self.data)
        return self._graph(*args)


def _why_not_savable(compiled: Callable[..., Any]) -> str | None:
    split = getattr(compiled, "__self__", None)
    # the graph's forward, or fx's lazily generated one (``_lazy_forward``) before its first call
    if not isinstance(split, fx.GraphModule) or getattr(compiled, "__name__", "") not in ("forward", "_lazy_forward"):
        if getattr(compiled, "view_outputs", None) is not None:
            return "its outputs include views, returned by an eager epilogue"
        return (
            f"the backend returned {type(compiled).__name__}, not a graph's forward (a graph compiled per float value)"
        )
    for child in split.children():
        if isinstance(child, PieceRunner) and getattr(child, "cache_key", None) is None:
            return f"{child.label} is reused only within its graph (its key does not cover the kernels it calls)"
    return None
