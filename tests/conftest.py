"""Shared fixtures and pure-PyTorch references for the qaic op tests."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

import qaic_dynamo  # noqa: F401  (registers torch.ops.qaic)

# CI draws the same examples on every run, so a failure in its log reproduces locally
# (`CI=true pytest ...`); elsewhere Hypothesis explores new ones each run.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _private_compile_cache(tmp_path, monkeypatch):
    """Every test gets an empty persistent cache of its own (never the user's)."""
    monkeypatch.setenv("QAIC_DYNAMO_CACHE_DIR", str(tmp_path / "qaic-cache"))
    monkeypatch.delenv("QAIC_DYNAMO_DISABLE_CACHE", raising=False)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Every test starts from a clean Dynamo state (no cached frames, no guards) and an
    empty in-process artifact cache, so compilation counts do not depend on test order."""
    from qaic_dynamo.cache import artifact_cache

    torch._dynamo.reset()
    artifact_cache.clear_memory()
    yield
    torch._dynamo.reset()
    artifact_cache.clear_memory()


@pytest.fixture
def exporter_path(monkeypatch):
    """Every piece goes to the lowering's exporter fallback, as one with an op the direct
    path cannot trace does (until 2026-11-26 a tensor constant did, and tests used one)."""
    from qaic_dynamo.lowering import piece

    def untraceable(*args, **kwargs):
        raise RuntimeError("the test sends this piece to the exporter")

    monkeypatch.setattr(piece, "aten_graph", untraceable)


def ref_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Reference: index_put into a [slots, heads, dim] view of clones of the caches."""
    kc, vc = key_cache.clone(), value_cache.clone()
    n = slot_mapping.numel()
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for src, cache in ((key, kc), (value, vc)):
        nb, h, bs, d = cache.shape
        flat = cache.permute(0, 2, 1, 3).reshape(nb * bs, h, d).clone()
        flat[slots] = src[:n][keep]
        cache.copy_(flat.reshape(nb, bs, h, d).permute(0, 2, 1, 3))
    return kc, vc


def ref_causal_attention(q, k, v, scale=None, sliding_window=None, softcap=None, sinks=None):
    """Reference for one sequence: q [n, Hq, D] are the last n of L positions, k/v [L, Hkv, D];
    ``softcap``: logits become tanh(s / softcap) * softcap; ``sinks`` [Hq]: one more logit per
    head in the softmax denominator (no value)."""
    n, L = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    pos = torch.arange(L - n, L).unsqueeze(1)
    kpos = torch.arange(L).unsqueeze(0)
    mask = kpos <= pos
    if sliding_window is not None:
        mask &= kpos > pos - sliding_window
    qf, kf, vf = (t.transpose(0, 1).float() for t in (q, k, v))
    if softcap is None and sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
        return out.transpose(0, 1).to(q.dtype)
    s = qf @ kf.transpose(1, 2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :L]
    out = p @ vf
    return out.transpose(0, 1).to(q.dtype)
