"""Defer onnxscript's conversion of its torch library's functions to their first use.

Importing onnxscript's torch library wraps ~50 script-mode and ~440 trace-only functions,
converting or inferring all of them, for the dozen functions a transformer's pieces use.
While :func:`deferred_script_conversion` is active, the wrappers of that library's
functions (and only those) do their work on first use instead.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from qaic_dynamo.lowering.signatures import memoized_op_signatures

__all__ = [
    "TORCH_LIB_PREFIX",
    "deferred_script_conversion",
    "deferred_script_function_class",
    "deferred_signature_traced_function_class",
    "is_torch_lib_function",
]


TORCH_LIB_PREFIX = "onnxscript.function_libs.torch_lib."
_deferral_lock = threading.Lock()
_deferral: dict[str, Any] = {"depth": 0, "saved": None}


def is_torch_lib_function(func: Callable) -> bool:
    # ``__module__`` may be None (a function made by exec without ``__name__``).
    return (getattr(func, "__module__", None) or "").startswith(TORCH_LIB_PREFIX)


@contextlib.contextmanager
def deferred_script_conversion() -> Iterator[None]:
    """While active, onnxscript's function wrappers do their work on a function's first
    use instead of when the function is defined - for functions of onnxscript's torch
    library only (anything else, e.g. a user's module imported by another thread meanwhile,
    is wrapped by onnxscript's own code as usual):

    * ``onnxscript.script(...)(func)`` returns a :func:`deferred_script_function_class`
      instance, an ``OnnxFunction`` that converts ``func``'s Python source to ONNX when
      first used;
    * ``onnxscript.values.TracedOnnxFunction(opset, func)`` is a
      :func:`deferred_signature_traced_function_class` instance, which infers its ONNX
      signature (from ``func``'s annotations) when first asked for it.

    Importing onnxscript's torch library wraps ~50 script-mode and ~440 trace-only
    functions, converting or inferring all of them - a large part of every cold process
    that lowers, for the dozen functions a transformer's pieces use.

    Entries are counted: the first saves onnxscript's wrappers and installs ours, the last
    exit restores them, whatever the order threads leave in. Once the library is imported
    there is nothing left to defer, and the context does nothing."""
    import onnxscript

    if TORCH_LIB_PREFIX + "ops" in sys.modules:
        yield
        return
    with _deferral_lock:
        if _deferral["depth"] == 0:
            script, traced = onnxscript.script, onnxscript.values.TracedOnnxFunction
            _deferral["saved"] = (script, traced)
            deferred = deferred_script_function_class()

            def deferred_script(
                opset: Any = None, default_opset: Any = None, **kwargs: Any
            ) -> Callable[[Callable], Any]:
                real = script(opset, default_opset, **kwargs)  # validates the arguments, as before

                def decorate(func: Callable) -> Any:
                    if not is_torch_lib_function(func):
                        return real(func)
                    return deferred(func, functools.partial(real, func), kwargs)

                return decorate

            onnxscript.script = deferred_script
            onnxscript.values.TracedOnnxFunction = deferred_signature_traced_function_class()
        _deferral["depth"] += 1
    try:
        yield
    finally:
        with _deferral_lock:
            _deferral["depth"] -= 1
            if _deferral["depth"] == 0:
                onnxscript.script, onnxscript.values.TracedOnnxFunction = _deferral["saved"]
                _deferral["saved"] = None


@functools.cache
def deferred_script_function_class() -> type:
    """``DeferredScriptFunction(func, convert, kwargs)``: an ``onnxscript.OnnxFunction``
    whose Python function is known at once and whose everything else (``name``,
    ``function_ir``, ``op_signature``, ``to_function_proto()``, calling it...) is answered
    from ``convert()`` - the function as ``onnxscript.script`` converts it - run on first
    use. ``test_deferred_script_functions_equal_onnxscripts_own`` checks the answers."""
    import onnxscript

    class DeferredScriptFunction(onnxscript.OnnxFunction):
        # Deliberately not OnnxFunction.__init__: it is what converts.
        def __init__(self, func: Callable, convert: Callable[[], Any], kwargs: dict[str, Any]) -> None:
            self.function = func
            self.kwargs = kwargs
            self.traceable = False
            self._convert = convert
            self._lock = threading.RLock()
            functools.update_wrapper(self, func)

        @property
        def converted(self) -> Any:
            """The function as ``onnxscript.script`` converts it (converting it once)."""
            with self._lock:
                if "_converted" not in self.__dict__:
                    with memoized_op_signatures():
                        self.__dict__["_converted"] = self._convert()
            return self.__dict__["_converted"]

        def __getattr__(self, name: str) -> Any:  # what the converted function has and we lack
            if name.startswith("__") or name in ("function", "kwargs", "_convert", "_lock"):
                raise AttributeError(name)
            return getattr(self.converted, name)

        # Properties of OnnxFunction and its base over fields only their __init__ sets.
        name = property(lambda self: self.converted.name)
        opset = property(lambda self: self.converted.opset)
        domain = property(lambda self: self.converted.domain)
        op_schema = property(lambda self: self.converted.op_schema)
        function_ir = property(lambda self: self.converted.function_ir)
        source = property(lambda self: self.converted.source)

        @property
        def op_signature(self) -> Any:
            return self.converted.op_signature

        @op_signature.setter
        def op_signature(self, value: Any) -> None:
            self.converted.op_signature = value

    return DeferredScriptFunction


@functools.cache
def deferred_signature_traced_function_class() -> type:
    """``onnxscript.values.TracedOnnxFunction`` whose ``op_signature`` is inferred on first
    read (by constructing the real one) rather than in ``__init__``.
    ``test_deferred_script_functions_equal_onnxscripts_own`` checks the signatures."""
    import onnxscript

    traced = onnxscript.values.TracedOnnxFunction

    class DeferredSignatureTracedFunction(traced):
        def __new__(cls, opset: Any, func: Callable) -> Any:
            if not is_torch_lib_function(func):  # not ours to defer: onnxscript's own
                return traced(opset, func)
            return super().__new__(cls)

        # TracedOnnxFunction.__init__ but for the inference: Op's own __init__ leaves
        # the signature None.
        def __init__(self, opset: Any, func: Callable) -> None:
            onnxscript.values.Op.__init__(self, opset, func.__name__)
            self.func = func
            functools.update_wrapper(self, func)

        @property
        def op_signature(self) -> Any:
            if self._signature is None:
                self._signature = traced(self.opset, self.func).op_signature
            return self._signature

        @op_signature.setter
        def op_signature(self, value: Any) -> None:
            self._signature = value

    return DeferredSignatureTracedFunction
