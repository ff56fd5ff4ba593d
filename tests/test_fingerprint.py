"""The structural key: never shared by pieces that could compute different results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qaic_dynamo import AttentionMetadata, ops, set_forward_context
from qaic_dynamo.compiler.fingerprint import fingerprint, library_versions


def key_of(fn, *args, config_hash="cfg", dynamic=False):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    caches = (torch.zeros(2, 2, 4, 4), torch.zeros(2, 2, 4, 4))  # for the KV-update samples
    layers = {f"model.layers.{i}.self_attn": caches for i in range(2)}
    with set_forward_context(AttentionMetadata(torch.arange(3)), layers):
        torch.compile(fn, backend=capture, dynamic=dynamic, fullgraph=True)(*args)
    (gm,) = graphs
    values = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    return fingerprint(gm, values, config_hash)


X, W = torch.randn(4, 8), torch.randn(8)


def norm_eps5(x, w):
    return torch.rms_norm(x, (8,), w, 1e-5)


def norm_eps6(x, w):
    return torch.rms_norm(x, (8,), w, 1e-6)


def norm_eps5_renamed(hidden_states, weight):
    out = torch.rms_norm(hidden_states, (8,), weight, 1e-5)
    return out


def act_silu(x, w):
    return F.silu(x * w)


def act_gelu(x, w):
    return F.gelu(x * w)


def const_a(x, w):
    return x * w + torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])


def const_b(x, w):
    return x * w + torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 9.0])


def kv_layer0(k, v):
    return ops.unified_kv_cache_update(k, v, "model.layers.0.self_attn")


def kv_layer1(k, v):
    return ops.unified_kv_cache_update(k, v, "model.layers.1.self_attn")


def kv_agnostic(k, v):
    return ops.unified_kv_cache_update(k, v, "from_forward_context")


def cond_times2(x, w):
    return torch.cond(x.sum() > 0, lambda t: t * 2.0, lambda t: t - 1.0, (x * w,))


def cond_times3(x, w):
    return torch.cond(x.sum() > 0, lambda t: t * 3.0, lambda t: t - 1.0, (x * w,))


def cond_times2_renamed(hidden, weight):
    return torch.cond(hidden.sum() > 0, lambda h: h * 2.0, lambda h: h - 1.0, (hidden * weight,))


KV = (torch.randn(3, 2, 4), torch.randn(3, 2, 4))


@pytest.mark.parametrize(
    "a, b, args",
    [
        (norm_eps5, norm_eps6, (X, W)),  # an RMSNorm eps
        (act_silu, act_gelu, (X, W)),  # an activation
        (const_a, const_b, (X, W)),  # a constant tensor (one element differs)
        (kv_layer0, kv_layer1, KV),  # a layer-name string
        (kv_layer0, kv_agnostic, KV),
        (cond_times2, cond_times3, (X, W)),  # a constant inside a torch.cond branch (a subgraph)
    ],
    ids=["eps", "activation", "constant-tensor", "layer-name", "name-vs-magic", "cond-branch"],
)
def test_pieces_that_differ_never_share_a_key(a, b, args):
    assert key_of(a, *args).key != key_of(b, *args).key


def test_names_do_not_matter():
    assert key_of(norm_eps5, X, W).key == key_of(norm_eps5_renamed, X, W).key
    assert key_of(cond_times2, X, W).key == key_of(cond_times2_renamed, X, W).key  # branches keyed by structure


def test_a_branch_is_keyed_by_its_position_not_its_attribute_name():
    """In a whole-model graph layer 3's cond branches are ``cond_true_3``: its pieces must
    share layer 2's key."""
    graphs = []
    torch._dynamo.reset()
    torch.compile(cond_times2, backend=lambda gm, ex: graphs.append(gm) or gm.forward, fullgraph=True)(X, W)
    (gm,) = graphs
    values = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    before = fingerprint(gm, values, "cfg").key
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target.startswith("cond_"):
            setattr(gm, node.target + "_renamed", getattr(gm, node.target))
            node.target += "_renamed"
    gm.recompile()
    assert fingerprint(gm, values, "cfg").key == before


def test_inputs_metadata_matters_but_values_do_not():
    base = key_of(norm_eps5, X, W).key
    assert key_of(norm_eps5, torch.randn(4, 8), torch.randn(8)).key == base  # other values
    assert key_of(norm_eps5, X.double(), W.double()).key != base  # dtype
    assert key_of(norm_eps5, torch.randn(5, 8), W).key != base  # static shape
    assert key_of(norm_eps5, X.t().contiguous().t(), W).key != base  # stride


def test_symbolic_shapes_are_named_canonically():
    a = key_of(norm_eps5, torch.randn(6, 8), W, dynamic=True)
    b = key_of(norm_eps5, torch.randn(9, 8), W, dynamic=True)
    assert a.key == b.key
    tensor_inputs = [i for i in a.inputs["inputs"] if "tensor" in i]
    assert tensor_inputs[0]["shape"] == [{"sym": "S0"}, 8]


def test_config_hash_and_versions_are_in_the_key():
    a, b = key_of(norm_eps5, X, W, config_hash="A"), key_of(norm_eps5, X, W, config_hash="B")
    assert a.key != b.key
    assert a.inputs["versions"] == library_versions()
    # onnx-ir (it serialises the model) and sympy (size expressions) were missing: an
    # upgrade of either alone kept serving artifacts made with the old one
    assert set(library_versions()) == {"torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime", "sympy", "qaic_dynamo"}
    assert "not-installed" not in library_versions().values()


def test_edited_user_function_changes_the_key():
    @torch._dynamo.allow_in_graph
    def scale_v1(x):
        return x * 2

    @torch._dynamo.allow_in_graph
    def scale_v2(x):
        return x * 3

    scale_v2.__qualname__ = scale_v1.__qualname__  # same name, different code constant
    assert key_of(lambda x: scale_v1(x) + 1, X).key != key_of(lambda x: scale_v2(x) + 1, X).key


def ones_plus(x, w):
    return x * w + torch.ones(8)


def matmul(x, w):
    return x @ w.unsqueeze(1)


def head16(x):
    return x[:16] * 2


def test_the_default_dtype_is_in_the_key():
    # torch.ones(8) carries no dtype in the graph: it is float64 under this default.
    base = key_of(ones_plus, X, W).key
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert key_of(ones_plus, X, W).key != base
    finally:
        torch.set_default_dtype(old)
    assert key_of(ones_plus, X, W).key == base


def test_ambient_autocast_is_in_the_key():
    base = key_of(matmul, X, W).key
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key_of(matmul, X, W).key != base  # the same nodes, a bfloat16 matmul
    assert key_of(matmul, X, W).key == base


def test_graphs_traced_on_two_sides_of_a_guard_differ():
    # Dynamo traces x[:16] as [s0] for s0 <= 16 and as [16] above: the same nodes and inputs.
    short, long = key_of(head16, torch.randn(12), dynamic=True), key_of(head16, torch.randn(20), dynamic=True)
    assert short.inputs["inputs"] == long.inputs["inputs"] and short.key != long.key
    assert key_of(head16, torch.randn(13), dynamic=True).key == short.key


def test_a_zero_dim_tensor_constant_is_keyed_by_value():
    class Scale(torch.nn.Module):
        def __init__(self, s):
            super().__init__()
            self.register_buffer("s", torch.tensor(s))  # 0-d: a get_attr of a 0-d tensor

        def forward(self, x):
            return x * self.s

    def key(s):
        return fingerprint(torch.fx.symbolic_trace(Scale(s)), [X], "cfg").key

    assert key(0.5) == key(0.5) != key(0.25)


_lib = torch.library.Library("qaic_test_fp", "DEF")
_lib.define("scale(Tensor x) -> Tensor")
_lib.impl("scale", lambda x: x * 2.0, "CompositeImplicitAutograd")


def _helper(x):
    return x * 2.0


@torch._dynamo.allow_in_graph
def _calls_helper(x):
    return _helper(x) + 1.0  # an edit to _helper does not change _calls_helper's code


def test_ops_of_other_libraries_and_user_functions_are_named_as_unkeyed():
    assert key_of(lambda x: torch.ops.qaic_test_fp.scale(x) + 1, X).unkeyed_ops == ("qaic_test_fp.scale",)
    (name,) = key_of(lambda x: _calls_helper(x).sin(), X).unkeyed_ops
    assert name.startswith("test_fingerprint._calls_helper#")
    assert key_of(norm_eps5, X, W).unkeyed_ops == () and key_of(kv_agnostic, *KV).unkeyed_ops == ()
