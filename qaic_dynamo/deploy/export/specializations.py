"""``specializations.json``: the shapes qaic-compile builds the model for, as QEfficient
writes them.

One Prefill entry (``seq_len = prefill_seq_len``) and one Decode entry (``seq_len = 1``),
each at ``ctx_len``. With continuous batching the KV cache has a ``full_batch_size`` of its
own: Prefill runs one request (``batch_size = 1``) and Decode all of them (``batch_size =
full_batch_size``). With compute-context lengths (CCL) there is one entry per length
(``comp_ctx_lengths``), named ``Prefill_0``, ``Prefill_1``, ..., ``Decode_0``, ....
``prefill_only`` keeps the Prefill entries (True) or the Decode ones (False); with
``prefill_seq_len == 1`` the two would be identical, so there is one. Values are strings,
in the ``{"name", "symbols"}`` form of QEfficient >= 1.22 or the flat form of <= 1.21
(``specializations_format="legacy"``).
"""

from __future__ import annotations

from typing import Any

from qaic_dynamo.deploy.export.options import ExportOptions

__all__ = ["CCL_UNIQUE_STEP", "ccl_lengths", "specializations"]

#: A Prefill CCL equal to a Decode one is lowered to a multiple of this (QEfficient's
#: CCL_UNIQNE_STEP): the compiler wants every specialization distinct.
CCL_UNIQUE_STEP = 32


def ccl_lengths(options: ExportOptions) -> tuple[list[int] | None, list[int] | None]:
    """The compute-context lengths of the Prefill and Decode specializations, as QEfficient's
    ``process_ccl_specializations`` makes them from the options: a list not given is
    ``[ctx_len]``; lengths below ``ccl_min_length`` are raised to it, all capped at ctx_len,
    sorted and unique, and ctx_len is the last of each (so every position fits one). With
    ``prefill_seq_len == 1`` both share the union; otherwise a Prefill length equal to a
    Decode one drops to the next lower multiple of 32. (None, None) without CCL."""
    if not options.compute_context_lengths:
        return None, None
    ctx = options.ctx_len

    def normal(lengths: tuple[int, ...] | None) -> list[int]:
        values = [max(n, options.ccl_min_length) for n in (lengths or (ctx,))]
        if values[-1] < ctx:
            values.append(ctx)
        return sorted({min(n, ctx) for n in values})

    prefill, decode = normal(options.comp_ctx_lengths_prefill), normal(options.comp_ctx_lengths_decode)
    if options.prefill_seq_len == 1:
        union = sorted(set(prefill) | set(decode))
        return union, union
    unique: list[int] = []
    for n in prefill:
        while n in decode or n in unique:
            n = (n - 1) // CCL_UNIQUE_STEP * CCL_UNIQUE_STEP
        if n > 0:
            unique.append(n)
    return sorted(unique), decode


def _prefill_entry(options: ExportOptions, ccl: int | None) -> dict[str, Any]:
    cb, p = options.continuous_batching, options.prefill_seq_len
    exec_batch = options.batch_size if not cb else (options.full_batch_size if p == 1 else 1)
    spec: dict[str, Any] = {"batch_size": exec_batch, "seq_len": p, "ctx_len": options.ctx_len}
    if ccl is not None:
        spec["comp_ctx_lengths"] = ccl
    if cb:
        spec["full_batch_size"] = options.full_batch_size
        spec["full_batch_exec_size"] = exec_batch
    spec["_graph_name"] = "Decode" if p == 1 and options.prefill_only is False else "Prefill"
    return spec


def _decode_entry(options: ExportOptions, ccl: int | None) -> dict[str, Any]:
    cb = options.continuous_batching
    spec: dict[str, Any] = {
        "batch_size": options.full_batch_size if cb else options.batch_size,
        "seq_len": 1,
        "ctx_len": options.ctx_len,
    }
    if ccl is not None:
        spec["comp_ctx_lengths"] = ccl
    if cb:
        spec["full_batch_size"] = options.full_batch_size
    spec["_graph_name"] = "Decode"
    return spec


def _named(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """QEfficient's ``to_named_specializations``: ``{"name", "symbols"}`` with string values;
    a name that repeats gets ``_0``, ``_1``, ... on every occurrence."""
    named = [
        {"name": e["_graph_name"], "symbols": {k: str(v) for k, v in e.items() if k != "_graph_name"}} for e in entries
    ]
    counts: dict[str, int] = {}
    for e in named:
        counts[e["name"]] = counts.get(e["name"], 0) + 1
    seen: dict[str, int] = {}
    for e in named:
        name = e["name"]
        if counts[name] > 1:
            e["name"] = f"{name}_{seen.get(name, 0)}"
            seen[name] = seen.get(name, 0) + 1
    return named


def specializations(options: ExportOptions) -> dict[str, Any]:
    """``specializations.json`` for ``options`` (see the module docstring)."""
    prefill_ccl, decode_ccl = ccl_lengths(options)
    p, only = options.prefill_seq_len, options.prefill_only
    entries: list[dict[str, Any]] = []
    if only is None or only or p == 1:
        lengths = (decode_ccl if p == 1 else prefill_ccl) or [None]
        entries += [_prefill_entry(options, n) for n in lengths]
    if (only is None or not only) and p != 1:
        entries += [_decode_entry(options, n) for n in (decode_ccl or [None])]
    if options.specializations_format == "legacy":
        return {"specializations": [{k: str(v) for k, v in e.items() if k != "_graph_name"} for e in entries]}
    return {"specializations": _named(entries)}
