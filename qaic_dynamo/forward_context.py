"""The forward context: what the qaic ops know about the current forward pass.

A model's attention layers call ``qaic::unified_kv_cache_update(k, v, layer_name)`` and
``qaic::unified_attention(q, k, v, layer_name)``. The caches, the slot mapping and the
per-sequence metadata are not arguments: they come from the context set around the
forward pass::

    md = build_attention_metadata(seq_lens=[5, 9], query_lens=[5, 1],
                                  block_tables=[[0], [1]], block_size=16)
    with set_forward_context(md, kv_caches={"layers.0": (k_cache, v_cache), ...}):
        logits = model(input_ids, positions)

Why: a traced graph then holds no per-layer tensors or constants, and with the magic name
``"from_forward_context"`` the update op takes ``all_kv_cache_layers[kv_cache_layer_index]``
and advances the index, so every middle layer's graph piece is identical and compiles once.

The state itself lives in C++ (``csrc/forward_context.cpp``), thread-local, next to the
kernels that read it: resolving a layer costs one hash lookup and no Python, and two
threads running forward passes never see each other's index. This module is the Python
face of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch

from qaic_dynamo.native import _C

__all__ = [
    "FROM_FORWARD_CONTEXT",
    "AttentionMetadata",
    "ForwardContext",
    "build_attention_metadata",
    "get_forward_context",
    "has_forward_context",
    "set_forward_context",
]

#: Layer name that tells a cache-update op to take the next layer from the context.
FROM_FORWARD_CONTEXT: str = _C.FROM_FORWARD_CONTEXT

#: ``AttentionMetadata(slot_mapping, block_tables=None, seq_lens=None, query_start_loc=None)``
#: (C++). ``slot_mapping`` alone is enough for cache updates; attention needs all four.
AttentionMetadata = _C.AttentionMetadata

#: The per-pass context (C++): ``attn_metadata``, ``kv_caches``, ``all_kv_cache_layers``,
#: ``kv_cache_layer_index`` and ``resolve_for_update(layer_name)``.
ForwardContext = _C.ForwardContext


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata,
    kv_caches: Mapping[str, Sequence[torch.Tensor]],
    all_kv_cache_layers: Sequence[str] | None = None,
) -> Iterator[ForwardContext]:
    """Make a context current on this thread for one forward pass.

    Args:
        attn_metadata: slot mapping and, for attention, block tables, sequence lengths
            and query start offsets of this batch.
        kv_caches: layer name -> cache tensors: ``(key_cache, value_cache)`` for standard
            attention, ``(compressed_kv_cache, k_pe_cache)`` for MLA. Every cache is
            ``[num_blocks, num_kv_heads, block_size, head_size]``.
        all_kv_cache_layers: the layers in the order the model updates them; the order in
            which ``"from_forward_context"`` hands them out. Defaults to the order of
            ``kv_caches``.

    Each entry starts with ``kv_cache_layer_index == 0``, so the index is reset at every
    forward pass. Contexts nest; leaving the block restores the outer one.
    """
    if not isinstance(attn_metadata, AttentionMetadata):
        raise TypeError(
            "set_forward_context: attn_metadata must be a qaic_dynamo.AttentionMetadata "
            f"(build one with build_attention_metadata), got {type(attn_metadata).__name__}"
        )
    caches = {str(name): list(tensors) for name, tensors in kv_caches.items()}
    layers = list(caches) if all_kv_cache_layers is None else [str(n) for n in all_kv_cache_layers]
    ctx = _C.ForwardContext(attn_metadata, caches, layers)
    _C.push_forward_context(ctx)
    try:
        yield ctx
    finally:
        _C.pop_forward_context(ctx)


def get_forward_context() -> ForwardContext:
    """The innermost context of this thread; raises RuntimeError when none is set."""
    return _C.current_forward_context("get_forward_context")


def has_forward_context() -> bool:
    return _C.has_forward_context()


def build_attention_metadata(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    num_tokens: int | None = None,
    index_dtype: torch.dtype = torch.int64,
) -> AttentionMetadata:
    """Metadata for a batch whose sequence ``b`` adds ``query_lens[b]`` tokens at the end
    of a context that then holds ``seq_lens[b]`` tokens.

    Prefill has ``query_len == seq_len``; decode has ``query_len == 1``; anything between
    is a chunk. ``num_tokens`` pads the batch with ``-1`` slots (rows that write nothing
    and whose attention output is zero), e.g. to keep a compiled shape.
    """
    if not (len(seq_lens) == len(query_lens) == len(block_tables)):
        raise ValueError(
            "build_attention_metadata: seq_lens, query_lens and block_tables need one entry "
            f"per sequence, got {len(seq_lens)}, {len(query_lens)} and {len(block_tables)}"
        )
    if block_size <= 0:
        raise ValueError(f"build_attention_metadata: block_size must be positive, got {block_size}")
    slots: list[torch.Tensor] = []
    for b, (seq_len, q_len, table) in enumerate(zip(seq_lens, query_lens, block_tables)):
        if not 0 <= q_len <= seq_len:
            raise ValueError(
                f"build_attention_metadata: sequence {b} adds {q_len} tokens to a context "
                f"of {seq_len}; need 0 <= query_len <= seq_len"
            )
        if len(table) * block_size < seq_len:
            raise ValueError(
                f"build_attention_metadata: sequence {b} holds {seq_len} tokens but its "
                f"{len(table)} blocks of {block_size} hold only {len(table) * block_size}"
            )
        pos = torch.arange(seq_len - q_len, seq_len)
        blocks = torch.as_tensor(list(table), dtype=torch.int64)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)
    total = slot_mapping.numel()
    if num_tokens is not None:
        if num_tokens < total:
            raise ValueError(
                f"build_attention_metadata: num_tokens={num_tokens} is less than the {total} tokens of the batch"
            )
        slot_mapping = torch.cat([slot_mapping, slot_mapping.new_full((num_tokens - total,), -1)])
    width = max((len(t) for t in block_tables), default=0)
    table = torch.zeros(len(block_tables), max(width, 1), dtype=torch.int64)
    for b, t in enumerate(block_tables):
        table[b, : len(t)] = torch.as_tensor(list(t), dtype=torch.int64)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.as_tensor(list(query_lens), dtype=torch.int64), 0)
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(index_dtype),
        block_tables=table.to(index_dtype),
        seq_lens=torch.as_tensor(list(seq_lens), dtype=index_dtype),
        query_start_loc=qsl.to(index_dtype),
    )
