"""Pieces that write their inputs in place (a batch norm's running statistics in
training, a buffer's ``add_``) are compiled: the new values leave the artifact as outputs
and the runner copies them into the inputs (lowering/prepare.py, aten_trace.py). Each
case compares the outputs and the written inputs with eager; they all ran as eager
pieces before. Inputs that cannot be written back still run eagerly, and say why."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from qaic_dynamo import last_compile_report
from qaic_dynamo.counter import compilation_counter


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_writes_like_eager(fn, *args, steps=2):
    """Run ``fn`` eagerly and compiled on copies of ``args`` for ``steps`` calls; the
    outputs and every argument (the written ones) must agree after each."""
    eager_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    compiled_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    compiled = torch.compile(fn, backend="qaic", options={"fallback": "error"})
    with compilation_counter.expect(num_eager_fallbacks=0):
        for _ in range(steps):
            want, got = fn(*eager_args), compiled(*compiled_args)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for a, b in zip(compiled_args, eager_args):
                if isinstance(a, torch.Tensor):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not any(p.runs_eagerly for p in last_compile_report().pieces)
    return compiled_args


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5), (2, 3, 4, 4)])
@pytest.mark.parametrize("momentum", [0.1, 0.5, -1.0])
def test_batch_norm_in_training_writes_its_running_statistics(shape, momentum):
    torch.manual_seed(0)
    x, rm, rv = torch.randn(shape), torch.randn(3), torch.rand(3) + 0.5
    w, b = torch.randn(3), torch.randn(3)
    before = rm.clone()
    rm_after, _ = compiled_writes_like_eager(
        lambda x, rm, rv, w, b: F.batch_norm(x, rm, rv, w, b, training=True, momentum=momentum, eps=1e-3),
        x,
        rm,
        rv,
        w,
        b,
    )[1:3]
    assert not torch.equal(rm_after, before)  # it did write


def test_a_batch_norm_module_in_training():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3).train()
    ref = torch.nn.BatchNorm2d(3).train()
    ref.load_state_dict(bn.state_dict())
    compiled = torch.compile(bn, backend="qaic", options={"fallback": "error"})
    with torch.no_grad(), compilation_counter.expect(num_eager_fallbacks=0):
        for step in range(3):
            x = torch.randn(2, 3, 4, 4) + step
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-5)
    for name, buf in bn.named_buffers():
        torch.testing.assert_close(buf, dict(ref.named_buffers())[name], rtol=1e-5, atol=1e-5)
    assert int(bn.num_batches_tracked) == 3


def test_instance_norm_with_running_statistics():
    torch.manual_seed(0)
    x, rm, rv = torch.randn(2, 3, 5), torch.randn(3), torch.rand(3) + 0.5
    compiled_writes_like_eager(
        lambda x, rm, rv: F.instance_norm(x, rm, rv, use_input_stats=True, momentum=0.3), x, rm, rv
    )


def test_a_buffer_counter_and_an_in_place_update():
    def step(x, count, total):
        count.add_(1)
        total.mul_(0.5).add_(x.sum(0))
        return x * count

    compiled_writes_like_eager(step, torch.randn(4, 3), torch.zeros(()), torch.ones(3), steps=3)


def test_an_input_that_requires_grad_is_not_written_back():
    leaf = torch.ones(3, requires_grad=True)
    w = leaf * 1  # not a leaf: eager's in-place write joins its history

    def f(x, w):
        w.mul_(2)
        return x + w

    with pytest.warns(RuntimeWarning, match="writes in place into piece input"):
        out = torch.compile(f, backend="qaic")(torch.zeros(3), w)
    assert torch.equal(out.detach(), torch.full((3,), 2.0)) and torch.equal(w.detach(), torch.full((3,), 2.0))
    out.sum().backward()
    assert torch.equal(leaf.grad, torch.full((3,), 2.0))


def test_inputs_sharing_memory_are_not_written_back():
    base = torch.zeros(6)

    def f(a, b):
        a.add_(1)
        return b * 2

    with pytest.warns(RuntimeWarning, match="writes in place into piece input"):
        out = torch.compile(f, backend="qaic")(base[:4], base[2:])
    assert torch.equal(base, torch.tensor([1.0, 1, 1, 1, 0, 0])) and torch.equal(out, torch.tensor([2.0, 2, 0, 0]))


def test_batch_norm_with_update_writes_its_running_statistics():
    torch.manual_seed(0)
    x, rm, rv, w, b = torch.randn(4, 3, 5), torch.randn(3), torch.rand(3) + 0.5, torch.randn(3), torch.randn(3)
    compiled_writes_like_eager(
        lambda x, w, b, rm, rv: torch.ops.aten._batch_norm_with_update(x, w, b, rm, rv, 0.3, 1e-3)[:3], x, w, b, rm, rv
    )
