"""Dynamo's settings for a qaic compile, and how many entries a region may hold."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from qaic_dynamo._compat import (
    dynamo_config_patch,
    dynamo_recompile_limit,
    guard_latency_profile_off,
    guard_latency_profile_restore,
)
from qaic_dynamo.process_wide import ProcessWide

__all__ = ["REGION_RECOMPILE_LIMIT", "region_config", "region_recompile_limit", "specialized_floats"]


def specialized_floats() -> Any:
    """Dynamo's config for a qaic compile: floats specialised (a context manager, or a
    decorator).

    By default (``specialize_float=False``) Dynamo turns a float that changed between two
    compiles of one code object - Llama's ``rms_norm_eps`` on a second model of the same
    class, 1e-5 then 1e-6 - into a 0-d tensor input of the recompiled graph, read back with
    ``item()``. The qaic backend cannot carry that scalar across a piece boundary, so those
    pieces ran eagerly (with a warning). Specialised, the float is a constant guarded by
    value: the second model gets an entry of its own, lowered like the first's.
    """
    return dynamo_config_patch(specialize_float=True)


#: Process-wide (a module global of Dynamo's), held while any region traces.
_guard_profile_off = ProcessWide(guard_latency_profile_off, guard_latency_profile_restore)


@contextlib.contextmanager
def region_config() -> Iterator[None]:
    """Dynamo's config for compiling a region: :func:`specialized_floats`, and Dynamo's
    fake tensors without their dispatch cache.

    A region's graph holds each op about once, so a cache entry is almost never hit again,
    and building one with symbolic sizes costs more than running the op's meta kernel
    (lowering traces without it too, see ``lowering.fake_inputs``). Not for a whole-model
    compile, whose repeated layers do hit the cache (docs/benchmarks.md).

    And a recompile limit of :data:`REGION_RECOMPILE_LIMIT` entries per code object, not
    Dynamo's 8: transformers wraps every decoder layer class's ``forward`` in one function
    (``forward_with_checkpointing``), so the blocks of every model a process compiles share
    that code object's cache - the ninth model's layers (another size, another eps) ran
    eagerly, with nothing but Dynamo's log line to say so.

    And without the guard-latency measurement Dynamo takes of every frame it compiles
    (:func:`~qaic_dynamo._compat.guard_latency_profile_off`: a CPU cache flush per region
    trace), unless a guards log or a structured trace would show it.
    """
    with (
        dynamo_config_patch(
            specialize_float=True, fake_tensor_cache_enabled=False, recompile_limit=region_recompile_limit()
        ),
        _guard_profile_off.held(),
    ):
        yield


#: Compiled entries one region code object may hold (see :func:`region_config`); past it
#: a region runs eagerly, with a warning.
REGION_RECOMPILE_LIMIT = 64


def region_recompile_limit() -> int:
    """The recompile limit a region compiles under: ours, or Dynamo's if that is higher."""
    return max(REGION_RECOMPILE_LIMIT, dynamo_recompile_limit())
