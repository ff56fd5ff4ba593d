"""The qaic op library: opcheck on every op, kernels against PyTorch references, errors."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import ref_causal_attention, ref_reshape_and_cache
from hypothesis import given, settings
from hypothesis import strategies as st

from qaic_dynamo import build_attention_metadata, ops, set_forward_context

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INDEX_DTYPES = [torch.int32, torch.int64]


def caches(num_blocks, heads, block_size, head_size, dtype=torch.float32, fill=0.0):
    shape = (num_blocks, heads, block_size, head_size)
    return torch.full(shape, fill, dtype=dtype), torch.full(shape, fill, dtype=dtype)


# --- reshape_and_cache ----------------------------------------------------------------


def reshape_and_cache_samples():
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for index_dtype in INDEX_DTYPES:
            for block_size in (1, 16, 64):  # 64 == ctx_len: the retained-state layout
                nb = 128 // block_size
                kc, vc = caches(nb, 2, block_size, 8, dtype)
                t = 7
                slots = torch.randperm(nb * block_size, generator=g)[:t]
                slots[3] = -1  # a padding row
                k = torch.randn(t + 2, 2, 8, generator=g).to(dtype)  # +2 padding rows
                v = torch.randn(t + 2, 2, 8, generator=g).to(dtype)
                yield (k, v, kc, vc, slots.to(index_dtype))


@pytest.mark.parametrize(
    "sample", list(reshape_and_cache_samples()), ids=lambda s: f"{s[0].dtype}-{s[4].dtype}-bs{s[2].shape[2]}"
)
def test_reshape_and_cache_opcheck(sample):
    torch.library.opcheck(torch.ops.qaic.reshape_and_cache.default, sample)


@pytest.mark.parametrize(
    "sample", list(reshape_and_cache_samples()), ids=lambda s: f"{s[0].dtype}-{s[4].dtype}-bs{s[2].shape[2]}"
)
def test_reshape_and_cache_matches_reference(sample):
    k, v, kc, vc, slots = sample
    want_k, want_v = ref_reshape_and_cache(k, v, kc, vc, slots)
    ops.reshape_and_cache(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k)
    assert torch.equal(vc, want_v)


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([1, 16, 48]),
    num_tokens=st.integers(0, 40),
    pad_every=st.integers(2, 7),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
    index_dtype=st.sampled_from(INDEX_DTYPES),
)
def test_reshape_and_cache_random_permutations(block_size, num_tokens, pad_every, seed, dtype, index_dtype):
    g = torch.Generator().manual_seed(seed)
    nb = 96 // block_size
    kc, vc = caches(nb, 3, block_size, 4, dtype, fill=7.0)
    slots = torch.randperm(nb * block_size, generator=g)[:num_tokens]
    slots[::pad_every] = -1
    k = torch.randn(num_tokens, 3, 4, generator=g).to(dtype)
    v = torch.randn(num_tokens, 3, 4, generator=g).to(dtype)
    want_k, want_v = ref_reshape_and_cache(k, v, kc, vc, slots)
    ops.reshape_and_cache(k, v, kc, vc, slots.to(index_dtype))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_padding_never_writes_the_last_slot(block_size):
    # ONNX ScatterND reads -1 as "the last element"; the kernel must read it as padding.
    nb = 64 // block_size
    kc, vc = caches(nb, 2, block_size, 4, fill=0.0)
    k = torch.ones(4, 2, 4)
    ops.reshape_and_cache(k, k, kc, vc, torch.tensor([-1, -1, 0, -1]))
    assert kc[-1, :, -1].abs().sum() == 0 and vc[-1, :, -1].abs().sum() == 0
    assert torch.count_nonzero(kc) == 2 * 4  # only slot 0, both heads


def _onnx_kv_cache_scatter(cache, slot_mapping, updates):
    """The KVCacheScatter ONNX function, run alone in ONNX Runtime."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from qaic_dynamo.ops import QAIC_DOMAIN
    from qaic_dynamo.ops.onnx_functions import function_protos

    elem = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16}[cache.dtype]
    node = onnx.helper.make_node("KVCacheScatter", ["cache", "slot_mapping", "updates"], ["out"], domain=QAIC_DOMAIN)
    graph = onnx.helper.make_graph(
        [node],
        "g",
        [
            onnx.helper.make_tensor_value_info("cache", elem, ["nb", cache.shape[1], "bs", cache.shape[3]]),
            onnx.helper.make_tensor_value_info("slot_mapping", onnx.TensorProto.INT64, ["t"]),
            onnx.helper.make_tensor_value_info("updates", elem, ["r", cache.shape[1], cache.shape[3]]),
        ],
        [onnx.helper.make_tensor_value_info("out", elem, ["nb", cache.shape[1], "bs", cache.shape[3]])],
    )
    model = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid(QAIC_DOMAIN, 1)],
        functions=function_protos({"KVCacheScatter"}),
    )
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (out,) = sess.run(
        None,
        {"cache": cache.numpy(), "slot_mapping": slot_mapping.numpy().astype(np.int64), "updates": updates.numpy()},
    )
    return torch.from_numpy(out)


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([1, 16, 48]),
    num_tokens=st.integers(1, 40),  # the engine pads a batch to >= 2 rows; ArgMax needs one
    extra_rows=st.integers(0, 3),
    pad_every=st.integers(1, 7),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_kv_cache_scatter_onnx_function_matches_the_kernel(block_size, num_tokens, extra_rows, pad_every, seed, dtype):
    """The ONNX translation of the cache update writes what the C++ kernel writes: real
    tokens to their slots, nothing new for padded slots (-1, every one of them when
    pad_every=1) or update rows past the slot mapping."""
    g = torch.Generator().manual_seed(seed)
    nb = 96 // block_size
    kc, _ = caches(nb, 3, block_size, 4, dtype, fill=7.0)
    slots = torch.randperm(nb * block_size, generator=g)[:num_tokens]
    slots[::pad_every] = -1
    k = torch.randn(num_tokens + extra_rows, 3, 4, generator=g).to(dtype)
    want, _ = ref_reshape_and_cache(k[:num_tokens], k[:num_tokens], kc.clone(), kc.clone(), slots)
    assert torch.equal(_onnx_kv_cache_scatter(kc, slots, k), want)


def test_non_contiguous_key_rows_are_accepted():
    # K/V often come out of a fused qkv projection as strided views.
    qkv = torch.randn(5, 3, 2, 8)
    k, v = qkv[:, 1], qkv[:, 2]
    assert not k.is_contiguous()
    kc, vc = caches(4, 2, 4, 8)
    slots = torch.tensor([0, 5, 9, 14, 3])
    want_k, want_v = ref_reshape_and_cache(k, v, kc, vc, slots)
    ops.reshape_and_cache(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(key=torch.randn(3, 3, 8)), "key has 3 kv heads but key_cache has 2"),
        (lambda a: a.update(value=torch.randn(3, 2, 4)), "value has head_size 4 but value_cache has head_size 8"),
        (lambda a: a.update(key=a["key"].half()), "key is Half but key_cache is Float"),
        (lambda a: a.update(key_cache=torch.zeros(4, 4, 2, 8).transpose(1, 2)), "key_cache must be contiguous"),
        (
            lambda a: a.update(slot_mapping=torch.tensor([0, 1, 16])),
            "slot_mapping[2] = 16 is out of range; valid slots are 0..15",
        ),
        (lambda a: a.update(slot_mapping=torch.tensor([0, -2, 1])), "slot_mapping[1] = -2 is out of range"),
        (lambda a: a.update(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), "slot_mapping must be int32 or int64"),
        (lambda a: a.update(slot_mapping=torch.tensor([0, 1, 2, 3])), "slot_mapping has 4 tokens but key has 3 rows"),
        (lambda a: a.update(key=torch.randn(3, 2, 8, device="meta")), "key is on meta but key_cache is on cpu"),
        (lambda a: a.update(key=a["key"].double(), key_cache=a["key_cache"].double()), "unsupported dtype Double"),
    ],
)
def test_reshape_and_cache_errors(mutate, message):
    args = dict(
        key=torch.randn(3, 2, 8),
        value=torch.randn(3, 2, 8),
        key_cache=torch.zeros(4, 2, 4, 8),
        value_cache=torch.zeros(4, 2, 4, 8),
        slot_mapping=torch.tensor([0, 1, 2]),
    )
    mutate(args)
    before = args["key_cache"].clone()
    with pytest.raises(RuntimeError) as e:
        ops.reshape_and_cache(**args)
    assert message in str(e.value)
    assert torch.equal(args["key_cache"], before), "a rejected call must not write"


def test_out_of_range_slot_rejects_the_whole_call():
    kc, vc = caches(4, 2, 4, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.reshape_and_cache(torch.ones(3, 2, 8), torch.ones(3, 2, 8), kc, vc, torch.tensor([0, 1, 99]))
    assert torch.count_nonzero(kc) == 0


# --- the unified ops ------------------------------------------------------------------


def batch(
    seq_lens,
    query_lens,
    block_size,
    heads=2,
    kv_heads=1,
    head_size=8,
    layers=("l0",),
    dtype=torch.float32,
    num_tokens=None,
    seed=0,
):
    """A mixed batch: caches pre-filled with each sequence's context, plus the new tokens."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    order = torch.randperm(sum(blocks_per_seq) + 3, generator=g).tolist()  # scattered blocks
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(order[start : start + n])
        start += n
    nb = len(order)
    full_k = [torch.randn(s, kv_heads, head_size, generator=g).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, kv_heads, head_size, generator=g).to(dtype) for s in seq_lens]
    kv = {name: caches(nb, kv_heads, block_size, head_size, dtype) for name in layers}
    # Context (everything but the new tokens) goes into the caches up front.
    ctx_md = build_attention_metadata(
        [s - q for s, q in zip(seq_lens, query_lens)], [s - q for s, q in zip(seq_lens, query_lens)], tables, block_size
    )
    ctx_k = torch.cat([k[: s - q] for k, s, q in zip(full_k, seq_lens, query_lens)])
    ctx_v = torch.cat([v[: s - q] for v, s, q in zip(full_v, seq_lens, query_lens)])
    for kc, vc in kv.values():
        ops.reshape_and_cache(ctx_k, ctx_v, kc, vc, ctx_md.slot_mapping)
    md = build_attention_metadata(seq_lens, query_lens, tables, block_size, num_tokens=num_tokens)
    new_k = torch.cat([k[s - q :] for k, s, q in zip(full_k, seq_lens, query_lens)])
    new_v = torch.cat([v[s - q :] for v, s, q in zip(full_v, seq_lens, query_lens)])
    total = new_k.shape[0]
    pad = (num_tokens or total) - total
    new_k = torch.cat([new_k, torch.randn(pad, kv_heads, head_size, generator=g).to(dtype)])
    new_v = torch.cat([new_v, torch.randn(pad, kv_heads, head_size, generator=g).to(dtype)])
    query = torch.randn(total + pad, heads, head_size, generator=g).to(dtype)
    return dict(
        md=md,
        kv=kv,
        full_k=full_k,
        full_v=full_v,
        new_k=new_k,
        new_v=new_v,
        query=query,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )


MIXED = dict(seq_lens=[9, 1, 20, 33, 5], query_lens=[9, 1, 1, 7, 5])  # prefill, decode, chunk


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 1), (6, 2)])
def test_unified_attention_matches_sdpa_reference(block_size, heads, kv_heads):
    b = batch(**MIXED, block_size=block_size, heads=heads, kv_heads=kv_heads, num_tokens=26)
    with set_forward_context(b["md"], b["kv"]):
        dep = ops.unified_kv_cache_update(b["new_k"], b["new_v"])
        out = ops.unified_attention(b["query"], b["new_k"], b["new_v"], "l0", kv_cache_dependency=dep)
    start = 0
    for s, q, k, v in zip(b["seq_lens"], b["query_lens"], b["full_k"], b["full_v"]):
        want = ref_causal_attention(b["query"][start : start + q], k, v)
        torch.testing.assert_close(out[start : start + q], want, atol=1e-5, rtol=1e-5)
        start += q
    assert torch.count_nonzero(out[start:]) == 0, "padding rows produce zeros"


def test_attention_from_forward_context_reads_the_layer_updated_last():
    """With the magic name on both ops, each attention reads the layer whose update ran
    just before it: the same result as naming the layer."""
    layers = ("l0", "l1", "l2")
    by_name, magic = (batch(**MIXED, block_size=4, heads=4, kv_heads=2, layers=layers) for _ in range(2))
    for kc, vc in magic["kv"].values():  # make the layers' contexts differ
        kc.mul_(1 + len(kc)), vc.add_(1.0)
    for (name, (kc, vc)), (kc2, vc2) in zip(by_name["kv"].items(), magic["kv"].values()):
        kc.copy_(kc2), vc.copy_(vc2)
    outs = {}
    for b, how in ((by_name, "name"), (magic, "magic")):
        with set_forward_context(b["md"], b["kv"]):
            got = []
            for i, name in enumerate(layers):
                k, v = b["new_k"] * (i + 1), b["new_v"] - i
                dep = ops.unified_kv_cache_update(k, v)
                got.append(
                    ops.unified_attention(
                        b["query"], k, v, name if how == "name" else "from_forward_context", kv_cache_dependency=dep
                    )
                )
        outs[how] = got
    for a, b_ in zip(outs["name"], outs["magic"]):
        torch.testing.assert_close(a, b_)
    assert not torch.allclose(outs["magic"][0], outs["magic"][1]), "the layers really differ"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unified_attention_low_precision(dtype):
    b = batch(**MIXED, block_size=16, heads=4, kv_heads=2, dtype=dtype)
    with set_forward_context(b["md"], b["kv"]):
        ops.unified_kv_cache_update(b["new_k"], b["new_v"])
        out = ops.unified_attention(b["query"], b["new_k"], b["new_v"], "l0", scale=0.3)
    start = 0
    for q, k, v in zip(b["query_lens"], b["full_k"], b["full_v"]):
        want = ref_causal_attention(b["query"][start : start + q], k, v, scale=0.3)
        torch.testing.assert_close(out[start : start + q], want, atol=2e-2, rtol=2e-2)
        start += q


@pytest.mark.parametrize("window", [1, 4, 8])
def test_unified_attention_sliding_window(window):
    b = batch(**MIXED, block_size=4, heads=2, kv_heads=1)
    with set_forward_context(b["md"], b["kv"]):
        ops.unified_kv_cache_update(b["new_k"], b["new_v"])
        out = ops.unified_attention(b["query"], b["new_k"], b["new_v"], "l0", sliding_window=window)
    start = 0
    for q, k, v in zip(b["query_lens"], b["full_k"], b["full_v"]):
        want = ref_causal_attention(b["query"][start : start + q], k, v, sliding_window=window)
        torch.testing.assert_close(out[start : start + q], want, atol=1e-5, rtol=1e-5)
        start += q


@settings(max_examples=25, deadline=None)
@given(
    block_size=st.sampled_from([1, 4, 16]),
    heads_kv=st.sampled_from([(2, 2), (4, 1), (6, 2)]),
    softcap=st.sampled_from([None, 2.0, 30.0]),
    with_sinks=st.booleans(),
    window=st.sampled_from([None, 3, 16]),
    seed=st.integers(0, 2**16),
)
def test_softcap_and_sinks_match_the_reference(block_size, heads_kv, softcap, with_sinks, window, seed):
    """Prefill, decode and chunked rows (each kernel path) against a plain PyTorch
    reference, with soft-capping and sinks on their own and together."""
    heads, kv_heads = heads_kv
    b = batch(**MIXED, block_size=block_size, heads=heads, kv_heads=kv_heads, num_tokens=26, seed=seed)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2 if with_sinks else None
    b["query"] = b["query"] * 3  # large logits, so the cap bites
    with set_forward_context(b["md"], b["kv"]):
        dep = ops.unified_kv_cache_update(b["new_k"], b["new_v"])
        out = ops.unified_attention(b["query"], b["new_k"], b["new_v"], "l0", None, window, dep, softcap, sinks)
    start = 0
    for q, k, v in zip(b["query_lens"], b["full_k"], b["full_v"]):
        want = ref_causal_attention(
            b["query"][start : start + q], k, v, sliding_window=window, softcap=softcap, sinks=sinks
        )
        torch.testing.assert_close(out[start : start + q], want, atol=1e-5, rtol=1e-5)
        start += q


def test_softcap_and_sinks_change_the_result():
    b = batch(**MIXED, block_size=4, heads=4, kv_heads=2)
    with set_forward_context(b["md"], b["kv"]):
        ops.unified_kv_cache_update(b["new_k"], b["new_v"])
        q = b["query"] * 3
        plain = ops.unified_attention(q, b["new_k"], b["new_v"], "l0")
        capped = ops.unified_attention(q, b["new_k"], b["new_v"], "l0", softcap=1.0)
        sunk = ops.unified_attention(q, b["new_k"], b["new_v"], "l0", sinks=torch.full((4,), 3.0))
    assert not torch.allclose(plain, capped, atol=1e-3) and not torch.allclose(plain, sunk, atol=1e-3)
    # A sink only takes probability mass: the output shrinks towards zero.
    assert sunk.norm() < plain.norm()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(softcap=0.0), "softcap must be positive, got 0"),
        (dict(sinks=torch.zeros(3)), r"sinks must be \[num_heads\] = \[4\], got \[3\]"),
        (dict(sinks=torch.zeros(4, dtype=torch.long)), "sinks must be floating point"),
    ],
)
def test_softcap_and_sinks_errors(kwargs, message):
    b = batch(**MIXED, block_size=4, heads=4, kv_heads=2)
    with set_forward_context(b["md"], b["kv"]):
        ops.unified_kv_cache_update(b["new_k"], b["new_v"])
        with pytest.raises(RuntimeError, match=message):
            ops.unified_attention(b["query"], b["new_k"], b["new_v"], "l0", **kwargs)


def mla_batch(block_size, heads=4, rank=16, rope=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq_lens, query_lens = MIXED["seq_lens"], MIXED["query_lens"]
    nblk = [-(-s // block_size) for s in seq_lens]
    tables, start = [], 0
    for n in nblk:
        tables.append(list(range(start, start + n)))
        start += n
    ckv = torch.zeros(start, 1, block_size, rank)
    kpe = torch.zeros(start, 1, block_size, rope)
    md = build_attention_metadata(seq_lens, query_lens, tables, block_size)
    full_c = [torch.randn(s, rank, generator=g) for s in seq_lens]
    full_p = [torch.randn(s, rope, generator=g) for s in seq_lens]
    ctx_md = build_attention_metadata(
        [s - q for s, q in zip(seq_lens, query_lens)], [s - q for s, q in zip(seq_lens, query_lens)], tables, block_size
    )
    ops.reshape_and_cache(
        torch.cat([c[: s - q] for c, s, q in zip(full_c, seq_lens, query_lens)]).unsqueeze(1),
        torch.cat([p[: s - q] for p, s, q in zip(full_p, seq_lens, query_lens)]).unsqueeze(1),
        ckv,
        kpe,
        ctx_md.slot_mapping,
    )
    new_c = torch.cat([c[s - q :] for c, s, q in zip(full_c, seq_lens, query_lens)])
    new_p = torch.cat([p[s - q :] for p, s, q in zip(full_p, seq_lens, query_lens)])
    T = new_c.shape[0]
    return dict(
        md=md,
        kv={"mla0": (ckv, kpe)},
        full_c=full_c,
        full_p=full_p,
        new_c=new_c,
        new_p=new_p,
        q_lat=torch.randn(T, heads, rank, generator=g),
        q_pe=torch.randn(T, heads, rope, generator=g),
    )


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("k_pe_rank", [2, 3])
def test_unified_mla_matches_reference(block_size, k_pe_rank):
    b = mla_batch(block_size)
    k_pe = b["new_p"] if k_pe_rank == 2 else b["new_p"].unsqueeze(1)  # DeepSeek's [T, 1, P]
    with set_forward_context(b["md"], b["kv"]):
        dep = ops.unified_mla_kv_cache_update(b["new_c"], k_pe)
        out = ops.unified_mla_attention(b["q_lat"], b["q_pe"], "mla0", 0.25, dep)
    start = 0
    for q, c, p in zip(MIXED["query_lens"], b["full_c"], b["full_p"]):
        query = torch.cat([b["q_lat"][start : start + q], b["q_pe"][start : start + q]], -1)
        key = torch.cat([c, p], -1).unsqueeze(1)
        want = ref_causal_attention(query, key, c.unsqueeze(1), scale=0.25)
        torch.testing.assert_close(out[start : start + q], want, atol=1e-5, rtol=1e-5)
        start += q


# --- opcheck on the unified ops (they need a live forward context) ------------------------


def test_opcheck_unified_kv_cache_update():
    for block_size in (1, 16):
        # opcheck calls the op several times; register enough layers for the magic name.
        layers = [f"l{i}" for i in range(16)]
        b = batch(**MIXED, block_size=block_size, layers=layers, num_tokens=24)
        with set_forward_context(b["md"], b["kv"]):
            for name in ("l3", "from_forward_context"):
                torch.library.opcheck(torch.ops.qaic.unified_kv_cache_update.default, (b["new_k"], b["new_v"], name))


def test_opcheck_unified_attention():
    for block_size, heads, kv_heads in ((4, 4, 2), (16, 2, 2), (64, 6, 3)):
        b = batch(**MIXED, block_size=block_size, heads=heads, kv_heads=kv_heads)
        with set_forward_context(b["md"], b["kv"]):
            dep = ops.unified_kv_cache_update(b["new_k"], b["new_v"], "l0")
            torch.library.opcheck(
                torch.ops.qaic.unified_attention.default,
                (b["query"], b["new_k"], b["new_v"], "l0"),
                {"scale": 0.5, "kv_cache_dependency": dep},
            )
            torch.library.opcheck(
                torch.ops.qaic.unified_attention.default, (b["query"], b["new_k"], b["new_v"], "l0", None, 3)
            )
            torch.library.opcheck(
                torch.ops.qaic.unified_attention.default,
                (b["query"], b["new_k"], b["new_v"], "l0"),
                {"softcap": 20.0, "sinks": torch.randn(heads)},
            )


def test_opcheck_mla_ops():
    for block_size in (1, 16):
        b = mla_batch(block_size)
        with set_forward_context(b["md"], b["kv"]):
            for k_pe in (b["new_p"], b["new_p"].unsqueeze(1)):
                torch.library.opcheck(torch.ops.qaic.unified_mla_kv_cache_update.default, (b["new_c"], k_pe, "mla0"))
            torch.library.opcheck(torch.ops.qaic.unified_mla_attention.default, (b["q_lat"], b["q_pe"], "mla0", 0.125))


def test_unified_ops_trace_without_a_context():
    """Fake kernels let Dynamo trace the ops with no forward context and no caches."""

    def layer(q, k, v):
        dep = ops.unified_kv_cache_update(k, v)
        return ops.unified_attention(q, k, v, "l0", kv_cache_dependency=dep) * 2

    gm_holder = []

    def capture(gm, example_inputs):
        gm_holder.append(gm)
        return gm.forward

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.compile(layer, backend=capture, fullgraph=True)(
            torch.empty(5, 4, 8), torch.empty(5, 2, 8), torch.empty(5, 2, 8)
        )
    assert out.shape == (5, 4, 8)
    targets = {str(n.target) for n in gm_holder[0].graph.nodes if n.op == "call_function"}
    assert {"qaic.unified_kv_cache_update", "qaic.unified_attention"} <= targets


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda b: ops.unified_attention(b["query"][:, :3], b["new_k"], b["new_v"], "l0"),
            "3 query heads are not a multiple of 2 kv heads",
        ),
        (
            lambda b: ops.unified_attention(b["query"], b["new_k"], b["new_v"], "from_forward_context"),
            "before any 'from_forward_context' KV-cache update ran in this forward pass",
        ),
        (
            lambda b: ops.unified_attention(b["query"].half(), b["new_k"], b["new_v"], "l0"),
            "query is Half but the KV cache is Float",
        ),
        (
            lambda b: ops.unified_kv_cache_update(b["new_k"][:, :1], b["new_v"][:, :1], "l0"),
            "key has 1 kv heads but key_cache has 2",
        ),
        (
            lambda b: ops.unified_mla_kv_cache_update(b["new_k"], b["new_v"], "l0"),
            "kv_c_normed must be [num_tokens, dim] or [num_tokens, 1, dim]",
        ),
    ],
)
def test_unified_op_errors(call, message):
    b = batch(**MIXED, block_size=4, heads=4, kv_heads=2)
    with set_forward_context(b["md"], b["kv"]):
        with pytest.raises(RuntimeError) as e:
            call(b)
    assert message in str(e.value)


@pytest.mark.parametrize("query_lens", [[1], [2]], ids=["decode", "prefill"])
@pytest.mark.parametrize(
    "value_cache, message",
    [
        (torch.zeros(1, 1, 16, 8), r"the layer's caches disagree: \[64, 4, 16, 8\] and \[1, 1, 16, 8\]"),
        (torch.zeros(64, 4, 8, 8), r"the layer's caches disagree: \[64, 4, 16, 8\] and \[64, 4, 8, 8\]"),
        (torch.zeros(64, 4, 16, 8, dtype=torch.float64), "the layer's caches disagree: Float on cpu and Double on cpu"),
    ],
)
def test_attention_refuses_a_value_cache_that_disagrees_with_the_key_cache(query_lens, value_cache, message):
    """The decode kernel reads the value cache with the key cache's block layout: a
    smaller value cache was read past its end (garbage, or a crash)."""
    key_cache = torch.zeros(64, 4, 16, 8)
    md = build_attention_metadata([20], query_lens, [[63, 62]], 16)
    q = torch.ones(query_lens[0], 4, 8)
    with set_forward_context(md, {"l0": (key_cache, value_cache)}):
        with pytest.raises(RuntimeError, match=message):
            ops.unified_attention(q, q, q, "l0")


def test_mla_attention_checks_each_query_part_against_its_cache():
    """Only the sum of the widths reached the kernel: a query split at the wrong place
    attended with misaligned halves, and the fake kernel gave another shape."""
    b = mla_batch(16)
    with set_forward_context(b["md"], b["kv"]):
        ops.unified_mla_kv_cache_update(b["new_c"], b["new_p"], "mla0")
        q = torch.cat([b["q_lat"], b["q_pe"]], -1)
        with pytest.raises(
            RuntimeError,
            match=r"q_latent width 17 / q_pe width 7 do not match layer 'mla0' caches: "
            r"compressed_kv width 16 / k_pe width 8",
        ):
            ops.unified_mla_attention(q[..., :17], q[..., 17:], "mla0", 0.1)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "qaic"])
def test_an_update_whose_token_is_unused_still_writes(backend):
    """The updates' schemas name no cache, so FX took them for pure: under aot_eager an
    update whose dependency token nothing reads was removed as dead code."""

    def f(k, v):
        ops.unified_kv_cache_update(k, v, "from_forward_context")  # token dropped
        return k * 2

    kc, vc = caches(1, 1, 4, 2)
    g = torch.compile(f, backend=backend, **({"options": {"cache": False}} if backend == "qaic" else {}))
    with set_forward_context(build_attention_metadata([2], [1], [[0]], 4), {"l0": (kc, vc)}):
        g(torch.ones(1, 1, 2), torch.full((1, 1, 2), 3.0))
    assert kc[0, 0, 1].tolist() == [1.0, 1.0] and vc[0, 0, 1].tolist() == [3.0, 3.0]


def test_attention_needs_full_metadata():
    from qaic_dynamo import AttentionMetadata

    kc, vc = caches(2, 1, 4, 8)
    md = AttentionMetadata(torch.tensor([0, 1]))
    with set_forward_context(md, {"l0": (kc, vc)}):
        ops.unified_kv_cache_update(torch.ones(2, 1, 8), torch.ones(2, 1, 8))  # fine
        with pytest.raises(RuntimeError, match="needs attention metadata"):
            ops.unified_attention(torch.ones(2, 1, 8), torch.ones(2, 1, 8), torch.ones(2, 1, 8), "l0")


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or not torch.backends.openmp.is_available() or torch.get_num_threads() < 2,
    reason="counts the OpenMP workers through Linux's /proc with PyTorch's OpenMP on 2+ threads",
)
@pytest.mark.parametrize(
    ("seq_lens", "parallel"),
    [([32, 32], False), ([40, 1], False), ([256, 256], True), ([300, 1], True)],
    ids=["small-prefill", "small-prefill-and-decode", "large-prefill", "large-prefill-and-decode"],
)
def test_a_small_prefill_runs_attention_on_the_calling_thread(seq_lens, parallel):
    """Between two ONNX Runtime pieces (which release PyTorch's OpenMP workers first), a
    small prefill's SDPA started the workers again every layer: slower than one thread, and
    they took the cores from ONNX Runtime's. Below the serial threshold no worker starts;
    above it attention is parallel as before, and the caller's thread count is restored."""
    from qaic_dynamo.runtime import release_openmp_workers

    query_lens = [s if s > 1 else 1 for s in seq_lens]
    b = batch(seq_lens=seq_lens, query_lens=query_lens, block_size=16, heads=8, kv_heads=2, head_size=64)
    threads = torch.get_num_threads()
    with set_forward_context(b["md"], b["kv"]):
        ops.unified_kv_cache_update(b["new_k"], b["new_v"])
        assert release_openmp_workers() is True
        before = _os_threads()
        out = ops.unified_attention(b["query"], b["new_k"], b["new_v"], "l0")
        started = _os_threads() - before
    assert (started > 0) == parallel, f"{started} threads started"
    assert torch.get_num_threads() == threads
    q0 = 0
    for k, v, n in zip(b["full_k"], b["full_v"], query_lens):
        torch.testing.assert_close(
            out[q0 : q0 + n], ref_causal_attention(b["query"][q0 : q0 + n], k, v), atol=1e-5, rtol=1e-5
        )
        q0 += n


def test_long_decode_rows_past_the_serial_threshold_match_the_reference():
    # 2 rows x 8 heads x ~2750 positions x (64 + 64) dims is past the serial threshold (the
    # kernel parallelises such rows; which path ran is not observable here, only the values).
    b = batch(seq_lens=[3000, 2500], query_lens=[1, 1], block_size=16, heads=8, kv_heads=2, head_size=64)
    with set_forward_context(b["md"], b["kv"]):
        ops.unified_kv_cache_update(b["new_k"], b["new_v"])
        out = ops.unified_attention(b["query"], b["new_k"], b["new_v"], "l0")
    for i, (k, v) in enumerate(zip(b["full_k"], b["full_v"])):
        torch.testing.assert_close(
            out[i : i + 1], ref_causal_attention(b["query"][i : i + 1], k, v), atol=1e-5, rtol=1e-5
        )
