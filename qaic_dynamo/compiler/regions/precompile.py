"""Precompiled regions: a region's Dynamo trace saved beside its artifacts, so a restart
loads it instead of tracing again.

On a warm start every lowered piece comes from the persistent cache, and what is left is
Dynamo tracing each region again. Dynamo's precompile (``aot_compile``, the mechanism of
vLLM's AOT compile mode) saves a traced frame - the transformed bytecode, its guards and
the backend's output (:mod:`qaic_dynamo.compiler.saved_graph`) - and another process runs
it without tracing. A region's first call therefore traces through ``aot_compile``
(one trace, and one build of its guards, as Dynamo's own path would make) and runs that
entry. Off the first call - at the region's first call ``SAVE_DELAY_S`` later, or at
exit - the thread running it builds the guards the save keeps, only if the objects the
trace guarded on still pass its guards, and a worker thread pickles and writes the
entry; the next process loads it.

The saved entry keeps only the guards Dynamo can serialize. The ones it drops - every
guard on a global (``apply_rotary_pos_emb``, the attention function registered under
``"qaic"``, ``torch.ops.qaic``, imported modules) and the identity guards on the block's
class and the functions its ``forward`` closes over - are re-checked here
(:class:`DroppedGuards`): each dropped guard's source expression is evaluated against the
current objects and compared with what it found at trace time (a function by its module,
name, file, line and bytecode; a class or module by name; a dict by its keys; a constant
by value). With them goes a digest of every source file the trace read, as vLLM keys its
AOT cache. A loaded entry runs only if all of them hold; in the process that traced or
loaded it they are checked again once per forward context (once per model step). Anything
that changed - a source file, a replaced function, another attention function - discards
the stale entry and traces afresh: found at load, the region traces with ``aot_compile``
again and its new trace is saved in place of the old; found in a running process, the
region goes to Dynamo, as it would without precompile.

An entry is used only through guarded dispatch (``region_dispatch="guarded"``), which
runs it after the same checks it makes for Dynamo's own entries (no hooks, no stance,
``forward`` not replaced) and the entry's guards. A region Dynamo cannot trace whole (a
graph break) or whose compiled graph cannot be saved is remembered and traced by Dynamo
as before.
"""

from __future__ import annotations

import atexit
import builtins
import hashlib
import importlib
import json
import logging
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from qaic_dynamo._compat import AotFrame, aot_compile_frame, load_aot_frame
from qaic_dynamo.cache import DiskCache
from qaic_dynamo.compiler.backend import QaicBackend
from qaic_dynamo.compiler.fingerprint import library_versions, package_code_digest
from qaic_dynamo.compiler.saved_graph import SavedGraph, loading_config
from qaic_dynamo.config import CompilationConfig
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.errors import PrecompileError
from qaic_dynamo.forward_context import get_forward_context, has_forward_context

__all__ = ["DroppedGuards", "RegionPrecompile", "wait_for_saves"]

logger = logging.getLogger("qaic_dynamo")

FRAME_FILE = "frame.bin"
RECORD_FILE = "frame.json"
_FORMAT = 1


# --- what a dropped guard held --------------------------------------------------------------


def describe(value: Any) -> Any:
    """A JSON-able description of ``value`` that another process can compare: what the
    object *is*, not where it lives in memory."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return [type(value).__name__, value]
    if isinstance(value, torch.dtype):
        return ["dtype", str(value)]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if isinstance(value, types.FunctionType):
        code = value.__code__
        return [
            "function",
            value.__module__,
            value.__qualname__,
            code.co_filename,
            code.co_firstlineno,
            _code_hash(code),
        ]
    if isinstance(value, type):
        return ["type", value.__module__, value.__qualname__]
    if isinstance(value, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)):
        return ["builtin", getattr(value, "__module__", None), getattr(value, "__qualname__", repr(value))]
    if isinstance(value, dict):
        return ["dict", sorted(repr(k) for k in value)]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [describe(v) for v in value]]
    name = getattr(value, "_qualified_op_name", None) or getattr(value, "name", None)
    # torch.ops namespaces and op packets, and any other object: its type, its name if it
    # has one, and its own attribute names (a guard that an attribute is absent).
    own = sorted(vars(value)) if hasattr(value, "__dict__") and not isinstance(value, types.ModuleType) else None
    return ["object", describe(type(value)), str(name) if isinstance(name, str) else None, own]


_code_hashes: dict[int, tuple[types.CodeType, str]] = {}


def _code_hash(code: types.CodeType) -> str:
    known = _code_hashes.get(id(code))
    if known is not None and known[0] is code:
        return known[1]
    h = hashlib.sha256(code.co_code)
    h.update(repr(tuple(c if not isinstance(c, types.CodeType) else _code_hash(c) for c in code.co_consts)).encode())
    h.update(repr(code.co_names).encode())
    digest = h.hexdigest()[:16]
    _code_hashes[id(code)] = (code, digest)
    return digest


class _Globals(dict):
    """``G`` of a guard's source expression: the frame's globals, and the aliases Dynamo
    installs there (``__import_a_dot_b`` for module ``a.b``, ``__builtins_dict___N``)."""

    def __init__(self, f_globals: dict[str, Any]) -> None:
        super().__init__()
        self.f_globals = f_globals

    def __missing__(self, name: str) -> Any:
        if name in self.f_globals:
            return self.f_globals[name]
        if name.startswith("__import_"):
            return importlib.import_module(name[len("__import_") :].replace("_dot_", "."))
        if name.startswith("__builtins_dict___"):
            return builtins.__dict__
        raise KeyError(name)


class DroppedGuards:
    """The guards a saved entry dropped, re-evaluated from their source expressions.

    ``checks`` pairs each expression with the description of what it found at trace time;
    :meth:`mismatch` evaluates them all now and names the first that differs."""

    def __init__(self, checks: list[tuple[str, Any]], f_globals: dict[str, Any]) -> None:
        self.checks = checks
        self._compiled = [(expr, compile(expr, f"<guard {expr}>", "eval"), want) for expr, want in checks]
        self._globals = f_globals

    @classmethod
    def record(cls, entries: list[Any], f_locals: dict[str, Any], f_globals: dict[str, Any]) -> DroppedGuards:
        """From Dynamo's dropped guard entries; raises PrecompileError for one whose
        expression cannot be evaluated here (it could not be re-checked either)."""
        checks: list[tuple[str, Any]] = []
        seen: set[str] = set()
        for entry in entries:
            if entry.name in seen or not entry.name:
                continue
            seen.add(entry.name)
            try:
                found = cls._probe(compile(entry.name, "<guard>", "eval"), f_locals, f_globals)
            except Exception as e:
                raise PrecompileError(f"the dropped guard on {entry.name} cannot be re-checked ({e})") from e
            checks.append((entry.name, found))
        return cls(checks, f_globals)

    @staticmethod
    def _probe(code: types.CodeType, f_locals: dict[str, Any], f_globals: dict[str, Any]) -> Any:
        """What the expression finds: the value's description, or - for a guard that
        something is absent (``not hasattr(x, "y")``, a missing key) - which lookup failed."""
        try:
            value = eval(code, {"G": _Globals(f_globals), "__builtins__": builtins}, dict(f_locals))
        except (AttributeError, KeyError, IndexError) as e:
            return ["missing", type(e).__name__]
        return describe(value)

    def mismatch(self, f_locals: dict[str, Any]) -> str | None:
        for expr, code, want in self._compiled:
            try:
                found = self._probe(code, f_locals, self._globals)
            except Exception as e:
                return f"{expr} cannot be evaluated now ({type(e).__name__}: {e})"
            if found != want:
                return f"{expr} changed: traced with {want}, now {found}"
        return None


# --- source files ---------------------------------------------------------------------------

_file_digests: dict[str, tuple[int, int, str]] = {}


def file_digest(path: str) -> str | None:
    """sha256 of a file's bytes (kept per size and mtime), or None if it cannot be read."""
    try:
        st = os.stat(path)
        known = _file_digests.get(path)
        if known is not None and known[:2] == (st.st_mtime_ns, st.st_size):
            return known[2]
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None
    _file_digests[path] = (st.st_mtime_ns, st.st_size, digest)
    return digest


def changed_files(files: dict[str, str]) -> list[str]:
    return [path for path, digest in files.items() if file_digest(path) != digest]


def _code_tree(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_tree(const)


#: (path, sha256 of its bytes) -> its code objects by (qualified name, first line). The
#: regions of one model read the same files (the model's modeling file above all); each
#: is compiled once per content, not once per save.
_code_index: dict[tuple[str, str], dict[tuple[str, int], list[types.CodeType]]] = {}
_code_index_lock = threading.Lock()


def _codes_in(path: str, data: bytes, digest: str) -> dict[tuple[str, int], list[types.CodeType]]:
    with _code_index_lock:
        index = _code_index.get((path, digest))
    if index is not None:
        return index
    try:
        compiled = compile(data, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        raise PrecompileError(f"{path} no longer compiles ({e}); it changed since it was imported") from None
    index = {}
    for c in _code_tree(compiled):  # two lambdas on one line share a name and a line
        index.setdefault((c.co_qualname, c.co_firstlineno), []).append(c)
    with _code_index_lock:
        if len(_code_index) >= 256:  # files edited over and over in one long process
            _code_index.clear()
        _code_index[(path, digest)] = index
    return index


def source_digests(codes: list[types.CodeType]) -> dict[str, str]:
    """sha256 of each source file ``codes`` came from, each file checked to still compile
    to those very code objects.

    A digest alone would bind a saved trace to the file as it is when it is hashed, not
    to the code that was traced: a file edited after its module was imported hashes as
    the new text while the process runs (and traces) the old. The next process would
    import the new text, find the digest equal and run the old code. So the bytes hashed
    are compiled too, and every traced code object must be equal (``==`` on code objects
    compares bytecode, constants, names and line table) to the one at the same qualified
    name and first line (its ``co_name`` aside); else :class:`PrecompileError`. Code with
    no readable source file (``<string>``, generated code) has nothing to compare and is
    left out, as Dynamo's own record of inlined sources leaves it out."""
    by_file: dict[str, list[types.CodeType]] = {}
    for code in codes:
        by_file.setdefault(code.co_filename, []).append(code)
    digests = {}
    for path, file_codes in sorted(by_file.items()):
        try:
            data = Path(path).read_bytes()
        except OSError:
            continue
        digest = hashlib.sha256(data).hexdigest()
        found = _codes_in(path, data, digest)
        for code in file_codes:
            # co_name aside: a region entry's code is renamed per region (its qualname is not)
            candidates = [
                c.replace(co_name=code.co_name) for c in found.get((code.co_qualname, code.co_firstlineno), [])
            ]
            if code not in candidates:
                raise PrecompileError(
                    f"{path} changed since {code.co_qualname} was imported from it (or an import hook rewrote "
                    "its code, as pytest's assertion rewriting does)"
                )
        digests[path] = digest
    return digests


# --- one region's saved trace ---------------------------------------------------------------


#: Seconds between a trace and its save: a region traces inside the model's first call,
#: and a save then would slow the rest of that call. The saved guards are built by the
#: thread that runs the region, at its first call this long after the trace (or by
#: :func:`wait_for_saves`, and at exit): Dynamo parses guard expressions with ``ast``,
#: which CPython 3.11 does not allow on two threads at once (``SystemError: AST
#: constructor recursion depth mismatch``), so a worker thread building them could break
#: the program's own parsing. The worker thread then pickles and writes the entry. Until
#: then a traced region holds the locals of its first call (its inputs).
SAVE_DELAY_S = 2.0


class _Saver:
    """Writes saves on one daemon thread, in order; :meth:`flush` (at interpreter exit,
    through :func:`wait_for_saves`) writes the ones still waiting at once (a process that
    ends sooner still leaves its traces), after the one being written."""

    def __init__(self) -> None:
        self._pending: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._writing = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, save: Callable[[], None]) -> None:
        with self._cv:
            self._pending.append(save)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="qaic-precompile-saver", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _next(self) -> Callable[[], None] | None:
        with self._cv:
            return self._pending.pop(0) if self._pending else None

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._pending))
            # Taken under the writing lock, so that a flush never returns while a save it
            # did not see is still being written.
            with self._writing:
                save = self._next()
                if save is not None:
                    save()

    def flush(self) -> None:
        """Write every waiting save now, in this thread, after the one being written."""
        with self._writing:
            while (save := self._next()) is not None:
                save()


_saver = _Saver()

#: Regions whose trace waits for its saved guards' build (see SAVE_DELAY_S).
_unbuilt: set[RegionPrecompile] = set()


def wait_for_saves() -> None:
    """Build, in this thread, the saved guards still waiting, and write every trace still
    waiting to be saved (tests; exit does it too)."""
    for region in list(_unbuilt):
        region.hand_over_save()
    _saver.flush()


atexit.register(wait_for_saves)


class RegionPrecompile:
    """The saved trace of one region code (a block class's ``forward``, or a region's
    entry function), shared by every module that runs that code.

    :meth:`prepare` runs at the region's first call that misses: it loads the saved
    entry, or traces one with ``aot_compile`` and saves it. Guarded dispatch then asks
    :meth:`check` for the entry's function at every call, after its own checks."""

    def __init__(
        self, func: types.FunctionType, method: bool, config: CompilationConfig, label: str, identity: Any = None
    ) -> None:
        self.func = func
        self.identity = identity  # a region entry's module class: in the key beside the code
        self.method = method
        self.config = config
        self.label = label
        self.disk = DiskCache.get(config.resolved_cache_dir(), config.cache_size_limit)
        self.key = self._key()
        self.frame: AotFrame | None = None
        self.guards: DroppedGuards | None = None
        self.off: str | None = None  # why this region is traced by Dynamo instead
        self.tried = False
        # Weak: the context holds the step's KV caches, which must go when the engine
        # drops or rebinds them, not live on in the last region that checked them.
        self._checked_context: weakref.ref[Any] | None = None
        self._lock = threading.Lock()
        # The trace this process made and has not yet handed to the saver: (frame, its
        # dropped guards, when it is due).
        self._unsaved: tuple[AotFrame, DroppedGuards, float] | None = None

    def _key(self) -> str:
        code = self.func.__code__
        ident = {
            "format": _FORMAT,
            "what": "precompiled-frame",
            "code": [code.co_name, code.co_qualname, code.co_filename, code.co_firstlineno],
            "identity": describe(self.identity),
            "config": self.config.compute_hash(),
            "versions": library_versions(),
            "package": package_code_digest(),
            "python": sys.version,
        }
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()

    # -- the per-call check -----------------------------------------------------------------
    def check(self, f_locals: dict[str, Any]) -> Callable | None:
        """The entry's function if its dropped guards still hold (checked once per
        forward context) and its own guards pass on ``f_locals``; else None."""
        frame = self.frame
        if frame is None:
            return None
        unsaved = self._unsaved
        if unsaved is not None and time.monotonic() >= unsaved[2]:
            self.hand_over_save()
        ctx = get_forward_context() if has_forward_context() else None
        checked = self._checked_context
        if ctx is None or checked is None or checked() is not ctx:
            problem = self.guards.mismatch(f_locals) if self.guards is not None else None
            if problem is not None:
                self._drop(problem)
                return None
            self._checked_context = weakref.ref(ctx) if ctx is not None else None
        if frame.guard_manager.check(f_locals):
            return frame.fn
        return None

    def _drop(self, why: str) -> None:
        logger.warning("qaic: %s: its precompiled trace no longer holds (%s); Dynamo traces it again", self.label, why)
        self.frame, self.guards, self.off = None, None, why
        self._discard_unsaved()
        self.disk.discard(self.key)
        compilation_counter.bump(num_precompiled_discards=1)

    # -- first call ---------------------------------------------------------------------------
    def prepare(
        self,
        module: torch.nn.Module,
        args: tuple,
        kwargs: dict[str, Any],
        f_locals: dict[str, Any],
        before_trace: Callable[[tuple, dict[str, Any]], None],
    ) -> None:
        """Load the saved entry for this region, or trace and save one (once).
        ``before_trace(args, kwargs)`` runs only if it traces (it marks dynamic dims: a
        loaded entry's guards check that a tensor is marked as it was when traced)."""
        with self._lock:
            if self.tried:
                return
            self.tried = True
            loaded = self._load(f_locals)
            if loaded is None and self.off is None:
                before_trace(args, kwargs)
                self._trace(module, args, kwargs, f_locals)

    def _closure(self) -> dict[str, Any]:
        return {f"cell{i}": c.cell_contents for i, c in enumerate(self.func.__closure__ or ())}

    def _load(self, f_locals: dict[str, Any]) -> AotFrame | None:
        path = self.disk.lookup(self.key)
        if path is None:
            return None
        try:
            record = json.loads((path / RECORD_FILE).read_text())
            stale = changed_files(record["files"])
            if stale:
                raise PrecompileError(f"source changed since it was traced: {', '.join(stale[:3])}")
            guards = DroppedGuards([(e, w) for e, w in record["checks"]], self.func.__globals__)
            problem = guards.mismatch(f_locals)
            if problem is not None:
                raise PrecompileError(problem)
            with loading_config(self.config):
                frame = load_aot_frame((path / FRAME_FILE).read_bytes(), self._closure())
        except Exception as e:  # noqa: BLE001  a cache entry that does not load, for any reason, is traced again
            logger.warning("qaic: %s: the precompiled trace is not used (%s); Dynamo traces it", self.label, e)
            self.disk.discard(self.key)
            compilation_counter.bump(num_precompiled_discards=1)
            return None
        self.frame, self.guards = frame, guards
        compilation_counter.bump(num_precompiled_loads=1)
        return frame

    def _trace(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], f_locals: dict[str, Any]) -> None:
        backend = _saving_backend(self.config)
        call_args = ((module, *args) if self.method else args), kwargs
        try:
            frame, dropped = aot_compile_frame(self.func, call_args, backend)
            guards = DroppedGuards.record(dropped, f_locals, self.func.__globals__)
        except Exception as e:  # a graph break, a backend failure: Dynamo's own path handles it
            self.off = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            logger.info("qaic: %s is traced by Dynamo (precompile: %s)", self.label, self.off)
            return
        self.frame, self.guards = frame, guards
        compilation_counter.bump(num_precompiled_traces=1)
        self._unsaved = (frame, guards, time.monotonic() + SAVE_DELAY_S)
        _unbuilt.add(self)

    def hand_over_save(self) -> None:
        """Build the trace's saved guards on this thread, then queue its write (once)."""
        unsaved = self._take_unsaved()
        if unsaved is None:
            return
        frame, guards, _ = unsaved
        try:
            frame.build_saved_guards()
        except Exception as e:  # noqa: BLE001  a trace that cannot be saved still runs
            logger.info("qaic: %s: its trace is not saved (%s)", self.label, e)
            frame.release()
            return
        _saver.submit(lambda: self._save(frame, guards))

    def _take_unsaved(self) -> tuple[AotFrame, DroppedGuards, float] | None:
        with self._lock:
            unsaved, self._unsaved = self._unsaved, None
            _unbuilt.discard(self)
        return unsaved

    def _discard_unsaved(self) -> None:
        unsaved = self._take_unsaved()
        if unsaved is not None:
            unsaved[0].release()

    def _save(self, frame: AotFrame, guards: DroppedGuards) -> None:
        try:
            digests = source_digests([*frame.traced_codes, self.func.__code__])
            data = frame.serialize(self._closure())
            tmp = self.disk.new_tmp_dir(self.key)
            if tmp is None:
                return
            (tmp / FRAME_FILE).write_bytes(data)
            (tmp / RECORD_FILE).write_text(
                json.dumps({"label": self.label, "files": digests, "checks": guards.checks}, indent=0)
            )
            self.disk.commit(self.key, tmp)
            compilation_counter.bump(num_precompiled_saves=1)
        except Exception as e:  # a trace that cannot be saved still runs; the next process traces
            logger.info("qaic: %s: its trace is not saved (%s)", self.label, e)
        finally:
            frame.release()  # the first call's inputs, held for the save's guard build


def _saving_backend(config: CompilationConfig) -> Callable[..., SavedGraph]:
    qaic = QaicBackend(config)

    def backend(gm: Any, example_inputs: Any) -> SavedGraph:
        return SavedGraph(qaic(gm, example_inputs), config)

    return backend
