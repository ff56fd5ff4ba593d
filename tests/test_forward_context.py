"""The forward context: layer resolution, its errors, per-pass reset and thread isolation."""

from __future__ import annotations

import threading

import pytest
import torch

from qaic_dynamo import (
    AttentionMetadata,
    build_attention_metadata,
    get_forward_context,
    has_forward_context,
    ops,
    set_forward_context,
)


def layer_caches(names, num_blocks=4, heads=1, block_size=4, head_size=2):
    return {
        n: (
            torch.zeros(num_blocks, heads, block_size, head_size),
            torch.zeros(num_blocks, heads, block_size, head_size),
        )
        for n in names
    }


def one_token_md(slot=0):
    return AttentionMetadata(torch.tensor([slot]))


def write(value, layer="from_forward_context"):
    t = torch.full((1, 1, 2), float(value))
    return ops.unified_kv_cache_update(t, t, layer)


def test_no_context_is_a_clear_error():
    assert not has_forward_context()
    with pytest.raises(RuntimeError, match=r"no forward context is set on this thread; run the model inside"):
        get_forward_context()
    with pytest.raises(RuntimeError, match="unified_kv_cache_update: no forward context is set"):
        write(1.0)


def test_magic_name_takes_layers_in_order_and_advances():
    names = [f"model.layers.{i}.self_attn" for i in range(4)]
    kv = layer_caches(names)
    with set_forward_context(one_token_md(), kv) as ctx:
        for i in range(4):
            assert ctx.kv_cache_layer_index == i
            write(i + 1)
    for i, n in enumerate(names):
        assert kv[n][0][0, 0, 0, 0] == i + 1, f"layer {n} got another layer's update"


def test_explicit_order_and_direct_names():
    kv = layer_caches(["a", "b", "c"])
    with set_forward_context(one_token_md(), kv, all_kv_cache_layers=["c", "a", "b"]) as ctx:
        write(1)  # -> c
        write(9, "b")  # a direct name does not move the index
        assert ctx.kv_cache_layer_index == 1
        write(2)  # -> a
    assert [kv[n][0][0, 0, 0, 0].item() for n in "abc"] == [2, 9, 1]


def test_call_past_the_last_layer_names_both_counts():
    kv = layer_caches([f"l{i}" for i in range(4)])
    with set_forward_context(one_token_md(), kv):
        for i in range(4):
            write(i)
        with pytest.raises(RuntimeError) as e:
            write(5)
    assert "unified_kv_cache_update called 5 times but 4 KV-cache layers are registered" in str(e.value)


def test_mla_update_shares_the_index():
    kv = {
        "attn0": (torch.zeros(2, 1, 4, 3), torch.zeros(2, 1, 4, 2)),
        "attn1": (torch.zeros(2, 1, 4, 3), torch.zeros(2, 1, 4, 2)),
    }
    with set_forward_context(one_token_md(5), kv) as ctx:
        ops.unified_mla_kv_cache_update(torch.ones(1, 3), torch.ones(1, 1, 2))
        ops.unified_mla_kv_cache_update(torch.full((1, 3), 2.0), torch.full((1, 2), 2.0))
        assert ctx.kv_cache_layer_index == 2
        with pytest.raises(RuntimeError, match="unified_mla_kv_cache_update called 3 times but 2 KV-cache layers"):
            ops.unified_mla_kv_cache_update(torch.ones(1, 3), torch.ones(1, 2))
    assert kv["attn0"][0][1, 0, 1].tolist() == [1, 1, 1]  # slot 5 = block 1, offset 1
    assert kv["attn1"][1][1, 0, 1].tolist() == [2, 2]


def test_unknown_layer_lists_the_known_ones():
    with set_forward_context(one_token_md(), layer_caches(["q", "p"])):
        with pytest.raises(RuntimeError) as e:
            write(1, "layers.7")
    assert "unknown KV-cache layer 'layers.7'; the forward context knows: ['p', 'q']" in str(e.value)


def test_all_kv_cache_layers_must_name_known_layers():
    with pytest.raises(RuntimeError, match=r"unknown KV-cache layer 'zz'; the forward context knows: \['a'\]"):
        with set_forward_context(one_token_md(), layer_caches(["a"]), all_kv_cache_layers=["a", "zz"]):
            pass
    with pytest.raises(RuntimeError, match="appears twice"):
        with set_forward_context(one_token_md(), layer_caches(["a"]), all_kv_cache_layers=["a", "a"]):
            pass
    assert not has_forward_context(), "a failed entry leaves no context behind"


def test_index_is_reset_at_every_forward_pass():
    kv = layer_caches(["a", "b"])
    for step in range(3):
        with set_forward_context(one_token_md(step), kv) as ctx:
            assert ctx.kv_cache_layer_index == 0
            write(10 + step)
            write(20 + step)
    assert kv["a"][0][0, 0, :3, 0].tolist() == [10, 11, 12]
    assert kv["b"][0][0, 0, :3, 0].tolist() == [20, 21, 22]


def test_contexts_nest_and_restore():
    outer, inner = layer_caches(["o"]), layer_caches(["i"])
    with set_forward_context(one_token_md(), outer) as c1:
        with set_forward_context(one_token_md(), inner) as c2:
            assert get_forward_context() is c2
            write(1)
        assert get_forward_context() is c1 and c1.kv_cache_layer_index == 0
    assert not has_forward_context()
    assert inner["i"][0].sum() == 2 and outer["o"][0].sum() == 0


def test_context_is_popped_when_the_body_raises():
    with pytest.raises(ValueError):
        with set_forward_context(one_token_md(), layer_caches(["a"])):
            raise ValueError("boom")
    assert not has_forward_context()


def test_contexts_left_out_of_order_are_an_error_and_each_keeps_its_own():
    """Two forwards interleaved on one thread (generators, asyncio tasks) that hold their
    contexts across a yield: leaving the first while the second is still set used to pop
    the second, so the second's updates went into the first's caches."""
    a, b = layer_caches(["a"]), layer_caches(["b"])

    def forward(kv):
        with set_forward_context(one_token_md(), kv) as ctx:
            yield ctx
            yield write(1)  # one update, into this context's own layer

    fa, fb = forward(a), forward(b)
    next(fa)
    cb = next(fb)
    with pytest.raises(
        RuntimeError,
        match=r"forward contexts were left out of order on this thread.*interleaved "
        r"on one thread.*Run each forward pass to completion",
    ):
        fa.close()  # leaves a's context while b's is current
    assert get_forward_context() is cb  # b kept its own context
    next(fb)
    assert b["b"][0].sum() == 2 and a["a"][0].sum() == 0  # b's update went into b's cache
    fb.close()
    assert not has_forward_context()


def test_a_failed_update_does_not_move_the_index():
    """A caller that catches the error and retries must write the same layer."""
    kv = layer_caches(["l0", "l1"])
    with set_forward_context(one_token_md(), kv) as ctx:
        bad = torch.ones(1, 1, 3)  # head_size 3, the caches hold 2
        for update in (ops.unified_kv_cache_update, ops.unified_mla_kv_cache_update):
            with pytest.raises(RuntimeError, match="head_size 3 but key_cache has head_size 2"):
                update(bad, bad, "from_forward_context")
            assert ctx.kv_cache_layer_index == 0
        write(5)  # the retry
    assert kv["l0"][0].sum() == 10 and kv["l1"][0].sum() == 0


def test_threads_do_not_share_an_index():
    """Two threads interleave their layers step by step; each keeps its own index."""
    n_layers = 6
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def run(tid):
        try:
            kv = layer_caches([f"t{tid}.l{i}" for i in range(n_layers)])
            with set_forward_context(one_token_md(), kv) as ctx:
                seen = []
                for i in range(n_layers):
                    barrier.wait()  # both threads are mid-pass at the same layer
                    write(100 * tid + i)
                    seen.append(ctx.kv_cache_layer_index)
                results[tid] = (seen, [kv[f"t{tid}.l{i}"][0][0, 0, 0, 0].item() for i in range(n_layers)])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(t,)) for t in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for tid in (1, 2):
        seen, values = results[tid]
        assert seen == list(range(1, n_layers + 1))
        assert values == [100 * tid + i for i in range(n_layers)]
    assert not has_forward_context(), "another thread's context is not visible here"


def test_reading_a_layer_before_its_update_means_the_order_is_wrong():
    """If all_kv_cache_layers is not in model order, updates land in other layers' caches;
    attention catches that instead of silently reading stale KV."""
    md = build_attention_metadata([1], [1], [[0]], block_size=4)
    kv = layer_caches(["l0", "l1"])
    x = torch.ones(1, 1, 2)
    with set_forward_context(md, kv, all_kv_cache_layers=["l1", "l0"]):
        write(1)  # model's layer 0 update, but the context hands out l1
        with pytest.raises(RuntimeError) as e:
            ops.unified_attention(x, x, x, "l0")
    assert "layer 'l0' is read before its KV-cache update ran" in str(e.value)
    assert "must list the layers in the order the model calls them" in str(e.value)
    with set_forward_context(md, kv):  # the right order reads fine
        write(1)
        ops.unified_attention(x, x, x, "l0")


def test_python_resolution_matches_the_op():
    """The runtime resolves layers through the same C++ path as the eager op."""
    kv = layer_caches(["a", "b"])
    with set_forward_context(one_token_md(), kv) as ctx:
        name, (kc, vc) = ctx.resolve_for_update("from_forward_context")
        assert name == "a"
        assert kc.data_ptr() == kv["a"][0].data_ptr() and vc.data_ptr() == kv["a"][1].data_ptr()
        write(3)  # the op takes the next one
        assert ctx.kv_cache_layer_index == 2
        assert kv["b"][0][0, 0, 0, 0] == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(slot_mapping=torch.zeros(2, 2, dtype=torch.long)), "slot_mapping must be 1-D"),
        (dict(slot_mapping=torch.zeros(2)), "slot_mapping must be int32 or int64"),
        (
            dict(slot_mapping=torch.arange(2), seq_lens=torch.tensor([2])),
            "block_tables, seq_lens and query_start_loc go together",
        ),
        (
            dict(
                slot_mapping=torch.arange(2),
                block_tables=torch.zeros(1, 1, dtype=torch.long),
                seq_lens=torch.tensor([2]),
                query_start_loc=torch.tensor([0, 1, 2]),
            ),
            "query_start_loc must have num_seqs + 1 = 2 entries, got 3",
        ),
        (
            dict(
                slot_mapping=torch.arange(2),
                block_tables=torch.zeros(1, 1, dtype=torch.long),
                seq_lens=torch.tensor([1]),
                query_start_loc=torch.tensor([0, 2]),
            ),
            "sequence 0 has 2 new tokens but seq_len 1",
        ),
        (
            dict(
                slot_mapping=torch.zeros(1, dtype=torch.long),
                block_tables=torch.zeros(1, 1, dtype=torch.long),
                seq_lens=torch.tensor([2]),
                query_start_loc=torch.tensor([0, 2]),
            ),
            "query_start_loc ends at 2 but slot_mapping has only 1 tokens",
        ),
        # The lowered scatter read any negative slot as padding; the kernel refused it.
        (
            dict(slot_mapping=torch.tensor([3, -2, -1])),
            "slot_mapping entries must be >= -1 (-1 marks a padded token), got -2",
        ),
        (dict(slot_mapping=torch.tensor([-5], dtype=torch.int32)), "got -5"),
        # The kernel kept the last of two writes to one slot, the lowered scatter either one.
        (dict(slot_mapping=torch.tensor([7, -1, 3, -1, 7])), "slot_mapping writes slot 7 more than once"),
        (dict(slot_mapping=torch.tensor([9, 9], dtype=torch.int32)), "writes slot 9 more than once"),
    ],
)
def test_metadata_validation(kwargs, message):
    with pytest.raises(RuntimeError) as e:
        AttentionMetadata(**kwargs)
    assert message in str(e.value)


def test_build_attention_metadata_slots_and_padding():
    md = build_attention_metadata(
        seq_lens=[6, 3],
        query_lens=[2, 3],
        block_tables=[[4, 1], [2]],
        block_size=4,
        num_tokens=8,
        index_dtype=torch.int32,
    )
    # seq 0: positions 4, 5 -> block 1 (table[1]), offsets 0, 1 -> slots 4, 5
    # seq 1: positions 0..2 -> block 2 -> slots 8, 9, 10; then 3 padding rows
    assert md.slot_mapping.tolist() == [4, 5, 8, 9, 10, -1, -1, -1]
    assert md.slot_mapping.dtype == torch.int32
    assert md.query_start_loc.tolist() == [0, 2, 5]
    assert md.block_tables.tolist() == [[4, 1], [2, 0]]
    with pytest.raises(ValueError, match="its 1 blocks of 4 hold only 4"):
        build_attention_metadata([5], [5], [[0]], block_size=4)
