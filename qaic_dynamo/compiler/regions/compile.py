"""Regional compilation: trace each repeated decoder block once, whatever the depth.

``torch.compile(model, backend="qaic")`` hands the backend one graph for the whole model,
and Dynamo has traced every decoder layer again to build it: its own trace time grows
linearly with depth, even though the backend then compiles only three unique pieces.
:func:`compile` removes that cost instead of amortising it:

* it finds the repeated blocks (:mod:`.plan`);
* it compiles each block with ``backend="qaic"``. All blocks of a list share their
  class's ``forward`` code object, and Dynamo caches compiled code per code object with
  guards that hold for every instance (parameters are graph inputs), so the block is
  traced and lowered once and every other layer runs that same compiled code;
* it compiles the rest - the modules beside those lists - each as a region of its own;
* the Python between regions (the model's own ``forward``) runs eagerly.

This works only if nothing per-layer reaches a traced block: Dynamo guards on every
value a frame reads, so a layer-name string or a layer index read inside the block would
re-trace it per layer until the recompile limit. The qaic ops therefore take their layer
from the forward context (``"from_forward_context"``) for the cache update *and* the
attention.

The token and sequence dimensions of every tensor a region receives are marked dynamic
from the forward context, so one trace serves prefill, decode and every batch size
(Dynamo would otherwise specialise the first call's sizes and recompile on the second).
A compiled block is then called through :mod:`.dispatch`.

Like ``nn.Module.compile``, this compiles in place and returns the model.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from qaic_dynamo._compat import dynamo_internals, maybe_mark_dynamic
from qaic_dynamo.compiler.collector import collector_paused
from qaic_dynamo.compiler.regions.dispatch import GuardedDispatch
from qaic_dynamo.compiler.regions.plan import plan_regions
from qaic_dynamo.compiler.regions.precompile import RegionPrecompile
from qaic_dynamo.compiler.regions.settings import region_config
from qaic_dynamo.config import CompilationConfig
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.forward_context import get_forward_context, has_forward_context

__all__ = ["CompiledRegion", "compile", "mark_dynamic_dims", "region_entry"]


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from _tensors(v)


def mark_dynamic_dims(args: tuple, kwargs: dict[str, Any]) -> None:
    """Mark the dimension that changes between forward passes dynamic, so a region is
    traced once for every batch: the forward context's (padded) token count, or its
    sequence count padded to two as the engine pads logits rows (the final norm and head
    see one row per sequence). Dynamo specialises sizes 0 and 1 whatever we do.
    Outside a forward context nothing is marked.

    Only a tensor's leading non-unit dimension is a candidate: the engine runs one flat
    batch (``[1, tokens, ...]`` or ``[tokens, ...]``). A model dimension that merely
    equals the count (GPT-NeoX's 4 rotary dims at 4 sequences, a head size of 16 at 16
    tokens) made symbolic fails the piece's lowering (it ran eagerly)."""
    if not has_forward_context():
        return
    md = get_forward_context().attn_metadata
    sizes = {md.num_tokens, max(2, md.num_seqs)} - {0, 1}
    for t in _tensors((*args, *kwargs.values())):
        d = next((d for d, size in enumerate(t.shape) if size != 1), None)
        if d is not None and t.shape[d] in sizes:
            maybe_mark_dynamic(t, d)


class CompiledRegion(nn.Module):
    """A module run through its compiled form; attributes the model's own Python reads
    (e.g. transformers' ``decoder_layer.attention_type``) are the wrapped module's."""

    def __init__(self, module: nn.Module, compiled: Any, dispatch: GuardedDispatch | None = None) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "_compiled", compiled)  # not a submodule: no duplicate parameters
        object.__setattr__(self, "dispatch", dispatch)
        # The wrapper is invisible in checkpoints: the model's state_dict keys stay those of
        # the uncompiled model (``layers.0.mlp...``, not ``layers.0.module.mlp...``), so a
        # checkpoint saved before compiling loads after it and vice versa.
        self._register_state_dict_hook(_drop_wrapper_prefix)
        self._register_load_state_dict_pre_hook(_add_wrapper_prefix, with_module=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.dispatch is not None:
            compiled_code = self.dispatch.lookup(args, kwargs)
            if compiled_code is not None:
                compilation_counter.bump(num_guarded_region_calls=1)
                return compiled_code(*args, **kwargs)
        precompiled = self.dispatch.precompiled if self.dispatch is not None else None
        if precompiled is not None and not precompiled.tried:
            f_locals = self.dispatch.direct_call_locals(args, kwargs)
            if f_locals is not None:
                with region_config(), collector_paused():
                    precompiled.prepare(self.module, args, kwargs, f_locals, mark_dynamic_dims)
                compiled_code = self.dispatch.lookup(args, kwargs)
                if compiled_code is not None:
                    compilation_counter.bump(num_guarded_region_calls=1)
                    return compiled_code(*args, **kwargs)
        compilation_counter.bump(num_dynamo_region_calls=1)
        breaks = self.dispatch.graph_breaks() if self.dispatch is not None else 0
        mark_dynamic_dims(args, kwargs)
        # The collector paused for Dynamo's trace too, not only for the backend: a region
        # compiles here, and a call through Dynamo that only runs cached code pays only a
        # few microseconds for it (docs/benchmarks.md).
        with region_config(), collector_paused():
            out = self._compiled(*args, **kwargs)
        if self.dispatch is not None:
            self.dispatch.after_dynamo(breaks)
        return out

    def __getstate__(self) -> Any:
        # copy.deepcopy and pickle reach the torch.compile wrapper and Dynamo's modules
        # ("cannot pickle 'module' object"); say what works instead.
        raise TypeError(
            "a model compiled with qaic_dynamo.compile holds compiled code, which cannot be copied or pickled; "
            "deepcopy or torch.save the model before compiling it and compile the copy, or save its state_dict "
            "(it loads into the compiled model and back)"
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Writes go to the wrapped module, as reads come from it: ``layer.flag = x`` on a
        # compiled layer must change what the layer computes (Dynamo guards on the wrapped
        # module's attributes), not shadow it with a wrapper attribute nothing reads.
        # The wrapper's own state (nn.Module's fields, ``module``, ``dispatch``) stays here.
        if name in self.__dict__ or name == "module" or "module" not in self.__dict__.get("_modules", {}):
            super().__setattr__(name, value)
        else:
            setattr(self._modules["module"], name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__ or name == "module":
            super().__delattr__(name)
        else:
            delattr(self._modules["module"], name)


def _drop_wrapper_prefix(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    inner = prefix + "module."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner) :]] = state.pop(key)


def _add_wrapper_prefix(region: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    # Keys in the uncompiled model's form (``state_dict()``'s) get the wrapper's ``module.``.
    # A key already in the wrapper's form (``named_parameters()`` of the compiled model)
    # stays; which form a key is in is told by the wrapped module's own keys - by prefix
    # alone a block's own submodule named ``module`` looks wrapped.
    own = set(region._modules["module"].state_dict(keep_vars=True))
    for key in [k for k in state if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        if rest not in own and rest.startswith("module.") and rest[len("module.") :] in own:
            continue
        state[prefix + "module." + rest] = state.pop(key)


def compile(model: nn.Module, **options: Any) -> nn.Module:  # noqa: A001  (mirrors torch.compile)
    """Compile ``model`` region by region with ``backend="qaic"`` (in place; returns it).

    ``options`` are the qaic backend's options (``CompilationConfig``), shared by every
    region. Raises ValueError if the model has no repeated blocks.
    """
    config = CompilationConfig.from_options(options)  # reject bad options now, not at the first call
    if any(isinstance(m, CompiledRegion) for m in model.modules()):
        raise ValueError(
            f"qaic_dynamo.compile: {type(model).__name__} is already compiled region by region (it holds "
            "CompiledRegion modules); compile the original model once, or pass a fresh copy"
        )
    plan = plan_regions(model)
    internals = dynamo_internals() if config.region_dispatch == "guarded" else None
    # Saved traces need guarded dispatch (it runs them) and the persistent cache (it keeps them).
    precompile = config.precompile and config.cache and internals is not None

    for path, blocks in plan.blocks:
        shared: dict[types.FunctionType, RegionPrecompile] = {}  # one saved trace per forward code
        for i, block in enumerate(blocks):
            compiled = torch.compile(block, backend="qaic", options=dict(options))
            dispatch = GuardedDispatch.for_block(block, compiled, internals) if internals is not None else None
            if precompile and dispatch is not None:
                func = type(block).forward
                if func not in shared:
                    shared[func] = RegionPrecompile(func, True, config, f"block {type(block).__name__} ({path})")
                dispatch.precompiled = shared[func]
            blocks[i] = CompiledRegion(block, compiled, dispatch)
    for parent, name, path in plan.rest:
        module = getattr(parent, name)
        entry = region_entry(module, path)
        compiled = torch.compile(entry, backend="qaic", options=dict(options))
        dispatch = GuardedDispatch.for_function(entry, module, compiled, internals) if internals is not None else None
        if precompile and dispatch is not None:
            label = f"region {path} ({type(module).__name__})"
            dispatch.precompiled = RegionPrecompile(entry, False, config, label, identity=type(module))
        setattr(parent, name, CompiledRegion(module, compiled, dispatch))
    return model


def region_entry(module: nn.Module, path: str) -> Any:
    """A function that calls ``module``, with a code object of its own.

    Dynamo caches compiled code per code object, and ``torch.compile`` of a module of
    torch.nn's own classes (Embedding, Linear, RMSNorm), or of a bound method, goes
    through one shared wrapper function: every such region would stack its entries on
    that one code object and meet Dynamo's recompile limit (then run eagerly). A fresh
    code object per region keeps each region's cache its own.
    """

    def entry(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    entry.__code__ = entry.__code__.replace(co_name=f"qaic_region_{path.replace('.', '_')}")
    return entry
