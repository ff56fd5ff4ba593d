"""Deployment export (issue 11): names, validation, compiler inputs, ONNX Runtime parity of
the whole-model and layerwise exports, padding, and the three upstream layerwise bugs."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

from qaic_dynamo import LLM
from qaic_dynamo.deploy.export import (
    ExportError,
    ExportOptions,
    align_inputs_to_outputs,
    apply_kv_cache_prefix,
    custom_io_yaml,
    export_for_qaic,
    ort_generate,
    retained_state_names,
    specializations,
    validate_kv_cache_prefix,
)
from qaic_dynamo.deploy.export import assemble as qexport_names
from qaic_dynamo.models import (
    QaicLlamaConfig,
    QaicLlamaForCausalLM,
    QaicMLAConfig,
    QaicMLAForCausalLM,
    hf_model_from_config,
)

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [35, 89, 7]]
SHAPE = dict(batch_size=2, prefill_seq_len=8, ctx_len=32)
SUFFIX = "_RetainedState"


def llama(layers: int = 4) -> QaicLlamaForCausalLM:
    torch.manual_seed(0)
    return QaicLlamaForCausalLM(
        QaicLlamaConfig(
            num_hidden_layers=layers,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        )
    ).eval()


def mla(layers: int = 4) -> QaicMLAForCausalLM:
    torch.manual_seed(0)
    return QaicMLAForCausalLM(QaicMLAConfig(num_hidden_layers=layers)).eval()


def hf(family: str, layers: int = 4) -> nn.Module:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    small = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
    )
    cfg = {
        "llama": lambda: LlamaConfig(**small),
        "qwen2": lambda: Qwen2Config(**small),
        "mistral": lambda: MistralConfig(sliding_window=6, **small),
    }[family]()
    return hf_model_from_config(cfg)


def graph_io(path) -> tuple[list[str], list[str]]:
    g = onnx.load(str(path), load_external_data=False).graph
    return [i.name for i in g.input], [o.name for o in g.output]


# --- names -------------------------------------------------------------------------------------


def test_names_without_and_with_a_prefix():
    outs = ["logits", *retained_state_names(("past_key", "past_value"), 3), "vision_embeds_RetainedState"]
    assert outs == ["logits", "past_key.3_RetainedState", "past_value.3_RetainedState", "vision_embeds_RetainedState"]
    assert apply_kv_cache_prefix(outs, None) == outs
    prefixed = apply_kv_cache_prefix(outs, "vllm")
    assert prefixed == [
        "logits",
        "past_key.3_vllm_RetainedState",
        "past_value.3_vllm_RetainedState",
        "vision_embeds_RetainedState",
    ]  # a non-KV retained buffer keeps its name
    assert align_inputs_to_outputs(prefixed) == {
        "past_key.3_vllm_RetainedState": "past_key.3_vllm",
        "past_value.3_vllm_RetainedState": "past_value.3_vllm",
        "vision_embeds_RetainedState": "vision_embeds",
    }
    mla_names = apply_kv_cache_prefix(retained_state_names(("compressed_kv", "k_pe"), 0), "P1")
    assert mla_names == ["compressed_kv.0_P1_RetainedState", "k_pe.0_P1_RetainedState"]


# "kvé", "KV²": str.isalnum() is true, but no KV-name pattern reads them (mxint8 became float16)
@pytest.mark.parametrize("bad", ["", "kv.cache", "kv_cache", "kv cache", "kv-cache", 3, b"kv", ["kv"], "kvé", "KV²"])
def test_invalid_kv_cache_prefix_is_refused(bad):
    with pytest.raises(ExportError, match="kv_cache_prefix must be"):
        validate_kv_cache_prefix(bad)
    with pytest.raises(ExportError, match="kv_cache_prefix must be"):
        export_for_qaic(llama(2), "/nonexistent", kv_cache_prefix=bad)


def test_valid_prefixes():
    assert validate_kv_cache_prefix("vllm") == "vllm" and validate_kv_cache_prefix("KV0") == "KV0"
    assert validate_kv_cache_prefix(None) is None


def test_compiler_options_as_pairs_are_the_dict():
    # accepted before, refused by the option-name check at first
    want = ExportOptions.from_options(compiler_options={"mos": 1, "mxfp6_matmul": True})
    for pairs in ([("mos", 1), ("mxfp6_matmul", True)], (["mxfp6_matmul", True], ["mos", 1])):
        got = ExportOptions.from_options(compiler_options=pairs)
        assert got == want and got.compute_hash({}) == want.compute_hash({})


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(batch_size=0), "batch_size must be a positive int"),
        (dict(ctx_len=-1), "ctx_len must be a positive int"),
        (dict(prefill_seq_len=64, ctx_len=32), r"prefill_seq_len \(64\) must not exceed ctx_len \(32\)"),
        (dict(kv_precision="int4"), "kv_precision must be one of"),
        (dict(layerwise="yes"), "layerwise must be a bool"),
        (dict(num_core=4), r"unknown export option\(s\) \['num_core'\]; valid options: \[.*'num_cores'"),
        (dict(opset=20), r"opset must be one of \[18\] .*got 20"),  # was accepted, and an opset-18 model written
        (dict(opset=18.0), r"opset must be one of \[18\] .*got 18.0"),
        # a second -aic-num-cores / -aic-binary-dir went on the command after the export's own
        (
            dict(compiler_options={"aic_num_cores": 4}),
            r"repeat flags .*-aic-num-cores \(set by num_cores\); pass num_cores=",
        ),
        (
            dict(compiler_options={"aic_binary_dir": "/x", "convert_to_fp16": False}),
            r"-aic-binary-dir \(set by out_dir\), -convert-to-fp16 \(set by convert_to_fp16\)",
        ),
        # a leading dash made --aic-num-cores, past the check above; a string raised dict()'s ValueError
        (dict(compiler_options={"-aic-num-cores": 4}), r"without the leading dash .*got \['-aic-num-cores'\]"),
        (dict(compiler_options={"mos=2": 1}), r"compiler option names must be .*got \['mos=2'\]"),
        (dict(compiler_options="mxfp6_matmul"), r"compiler options must be a dict .*got str 'mxfp6_matmul'"),
        # the inputs would be past_key.0_RetainedState, named like the outputs
        (dict(kv_cache_prefix="RetainedState"), r"kv_cache_prefix 'RetainedState' would name the KV inputs like"),
        (dict(kv_cache_prefix="retainedstate"), r"kv_cache_prefix 'retainedstate' would name the KV inputs like"),
        # two graph inputs of one name, found by onnx.checker after the whole trace
        (dict(retained_buffers=["vis", "vis"]), r"retained_buffers names \['vis'\] more than once"),
        (dict(retained_buffers=[3]), r"retained_buffers must be buffer names \(strings\), got \(3,\)"),
    ],
)
def test_invalid_options_are_refused(options, message):
    with pytest.raises(ExportError, match=message):
        ExportOptions.from_options(**options)


def test_a_block_that_fails_to_trace_leaves_no_annotation_open(tmp_path, monkeypatch):
    """Layerwise: a block whose trace fails left torch.fx.traceback.annotate open; the
    garbage collector closed it later and printed "Exception ignored ... KeyError"."""
    import gc
    import sys

    from transformers import LlamaConfig

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=2,
    )
    cfg.hidden_size, cfg.head_dim = 60, 7  # set after the config's own check: 8 heads x 7 != 60
    model = hf_model_from_config(cfg)
    with pytest.raises(ExportError, match="size of tensor"):
        export_for_qaic(model, tmp_path, run_compiler=False, **SHAPE)
    gc.collect()
    assert not unraisable, [str(u.exc_value) for u in unraisable]
    assert "custom" not in torch.fx.traceback.current_meta


def test_qaic_compile_command_refuses_an_option_with_its_dash():
    from qaic_dynamo.runtime import qaic_compile_command

    with pytest.raises(ValueError, match=r"without the leading dash .*\['-aic-num-cores'\]"):
        qaic_compile_command(Path("/a"), Path("/a/qpc"), extra={"-aic-num-cores": 4})


def test_a_retained_buffer_that_is_not_a_buffer_is_refused(tmp_path):
    with pytest.raises(ExportError, match=r"retained_buffers \['vision_embeds'\] are not buffers of the model"):
        export_for_qaic(llama(2), tmp_path, retained_buffers=["vision_embeds"], **SHAPE)


# --- compiler inputs ------------------------------------------------------------------------


def test_custom_io_pairs_every_kv_input_with_its_output():
    outs = apply_kv_cache_prefix(
        [
            "logits",
            *retained_state_names(("past_key", "past_value"), 0),
            *retained_state_names(("past_key", "past_value"), 1),
        ],
        "P",
    )
    text = custom_io_yaml(outs)
    names = [line.split(": ")[1] for line in text.splitlines() if line.startswith("- IOName")]
    precisions = {line.split(": ")[1] for line in text.splitlines() if "Precision" in line}
    assert names == [
        "past_key.0_P",
        "past_key.0_P_RetainedState",
        "past_value.0_P",
        "past_value.0_P_RetainedState",
        "past_key.1_P",
        "past_key.1_P_RetainedState",
        "past_value.1_P",
        "past_value.1_P_RetainedState",
    ]
    assert precisions == {"float16"}
    assert {line.split(": ")[1] for line in custom_io_yaml(outs, "mxint8").splitlines() if "Precision" in line} == {
        "mxint8"
    }
    with pytest.raises(ExportError, match="kv_precision must be one of"):
        custom_io_yaml(outs, "fp8")


def precisions(text: str) -> dict[str, str]:
    """custom_io.yaml as {IOName: Precision}."""
    lines = [line for line in text.splitlines() if line.strip()]
    return {a.split(": ")[1]: b.split(": ")[1] for a, b in zip(lines[::2], lines[1::2], strict=True)}


@pytest.mark.parametrize("prefix", [None, "P"])
def test_custom_io_keeps_non_kv_buffers_at_their_own_precision(prefix):
    outs = apply_kv_cache_prefix(["logits", *retained_state_names(("past_key", "past_value"), 0)], prefix)
    outs += ["vision_embeds" + SUFFIX, "step" + SUFFIX]
    dtypes = {"vision_embeds" + SUFFIX: onnx.TensorProto.FLOAT, "step" + SUFFIX: onnx.TensorProto.INT64}
    kv = [n for n in outs if n.startswith("past_")]
    got = precisions(custom_io_yaml(outs, "mxint8", dtypes))
    # Two KV buffers, each input and output, at the KV precision; the float buffer at
    # float16 (never mxint8); the int64 one left out: the compiler keeps its type.
    assert got == {
        **{n: "mxint8" for n in kv},
        **{n[: -len(SUFFIX)]: "mxint8" for n in kv},
        "vision_embeds": "float16",
        "vision_embeds" + SUFFIX: "float16",
    }
    with pytest.raises(
        ExportError,
        match=r"'vision_embeds_RetainedState' is not a KV buffer and its element type "
        r"is unknown; pass dtypes",
    ):
        custom_io_yaml(outs, "mxint8")


def test_specializations_have_prefill_and_decode():
    specs = specializations(ExportOptions(batch_size=4, prefill_seq_len=16, ctx_len=256))
    assert specs == {
        "specializations": [
            # batch 4 in both: the retained KV (first dimension batch_size) keeps one shape (it had 1 in Prefill)
            {"name": "Prefill", "symbols": {"batch_size": "4", "seq_len": "16", "ctx_len": "256"}},
            {"name": "Decode", "symbols": {"batch_size": "4", "seq_len": "1", "ctx_len": "256"}},
        ]
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One small layerwise export, shared by the tests that only read it."""
    return export_for_qaic(
        llama(4),
        tmp_path_factory.mktemp("exp"),
        run_compiler=False,
        **SHAPE,
        compiler_options={"mxfp6_matmul": True, "mos": 1, "skipped": False},
    )


def test_compile_command(exported):
    cmd = exported.compile_command
    d = exported.export_dir
    from qaic_dynamo.config import qaic_compiler_path

    assert cmd[0] == str(qaic_compiler_path())
    assert cmd[1:] == [
        "-aic-hw",
        "-aic-hw-version=ai100",
        f"-m={d / 'model.onnx'}",
        "-retained-state",
        "-convert-to-fp16",
        "-aic-num-cores=16",
        f"-custom-IO-list-file={d / 'custom_io.yaml'}",
        f"-network-specialization-config={d / 'specializations.json'}",
        "-mos=1",
        "-mxfp6-matmul",
        f"-aic-binary-dir={exported.qpc_dir}",
    ]
    assert not exported.compiled and (d / "compile.sh").read_text().splitlines()[-1].startswith(cmd[0])
    params = json.loads((d / "export_params.json").read_text())
    assert params["compile"]["command"] == cmd and exported.qpc_dir.name == f"qpc-{params['compile']['hash']}"
    assert params["options"]["ctx_len"] == 32 and params["hash"] == d.name


def test_the_compiler_runs_when_present_and_its_log_is_kept(tmp_path, monkeypatch):
    fake = tmp_path / "qaic-compile"
    fake.write_text('#!/bin/sh\necho compiled "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("QAIC_COMPILER", str(fake))
    result = export_for_qaic(llama(2), tmp_path / "out", **SHAPE)
    assert result.compiled and result.compile_command[0] == str(fake)
    assert result.compile_log.read_text().startswith("compiled -aic-hw")
    assert "ran:" in result.summary()

    fake.write_text("#!/bin/sh\necho no card >&2\nexit 3\n")
    with pytest.raises(ExportError, match=r"qaic-compile failed \(3\); see .*compile.log"):
        export_for_qaic(llama(2), tmp_path / "out2", **SHAPE)


def test_the_compile_hash_covers_command_specializations_and_custom_io(tmp_path):
    model = llama(2)
    base = export_for_qaic(model, tmp_path, run_compiler=False, **SHAPE)
    cores = export_for_qaic(model, tmp_path, run_compiler=False, num_cores=4, **SHAPE)
    mx = export_for_qaic(model, tmp_path, run_compiler=False, kv_precision="mxint8", **SHAPE)
    assert len({base.qpc_dir.name, cores.qpc_dir.name, mx.qpc_dir.name}) == 3


# --- the artifact --------------------------------------------------------------------------


def test_io_names_axes_functions_and_external_weights(exported, tmp_path, monkeypatch):
    inputs, outputs = graph_io(exported.onnx_path)
    kv = [f"past_{kv}.{i}" for i in range(4) for kv in ("key", "value")]
    assert inputs == ["input_ids", "position_ids", *kv] == exported.input_names
    assert outputs == ["logits", *[n + SUFFIX for n in kv]] == exported.output_names
    m = onnx.load(str(exported.onnx_path), load_external_data=False)
    dims = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in (*m.graph.input, *m.graph.output)
    }
    assert dims["input_ids"] == dims["position_ids"] == ["batch_size", "seq_len"]
    assert all(dims[name] == dims[name + SUFFIX] == ["batch_size", 2, "ctx_len", 16] for name in kv)
    assert dims["logits"] == ["batch_size", 1, 256]
    assert {f"{f.domain}::{f.name}" for f in m.functions} == {
        "com.qualcomm.cloud::CtxScatter",
        "com.qualcomm.cloud::CtxGather",
    }
    assert all(n.domain in ("", "com.qualcomm.cloud") for n in m.graph.node)
    # Weights live beside the model, and it loads from any working directory.
    assert m.graph.initializer and all(t.data_location == onnx.TensorProto.EXTERNAL for t in m.graph.initializer)
    assert (exported.export_dir / "model.onnx.data").stat().st_size > exported.onnx_path.stat().st_size
    monkeypatch.chdir(tmp_path)
    onnx.checker.check_model(str(exported.onnx_path), full_check=True)
    ort.InferenceSession(str(exported.onnx_path), providers=["CPUExecutionProvider"])


def eager_reference(model, prompts, n):
    outs = LLM(model, backend="eager").generate_outputs(prompts, n, return_logits=True)
    return [o.token_ids for o in outs], [o.logits for o in outs]


@pytest.mark.parametrize(
    "kind, layerwise",
    [
        *[(k, lw) for k in ("reference-llama", "mla", "hf-llama") for lw in (True, False)],
        ("qwen2", True),
        ("mistral", True),  # the whole-model path is the same code for every family
    ],
)
def test_onnx_runtime_matches_eager(kind, layerwise, tmp_path):
    """Prefill, then decode feeding every _RetainedState back: the greedy tokens of eager
    PyTorch, and logits within 1e-4 at every decode step."""
    model = {
        "reference-llama": llama,
        "mla": mla,
        "hf-llama": lambda: hf("llama"),
        "qwen2": lambda: hf("qwen2"),
        "mistral": lambda: hf("mistral"),
    }[kind]()
    result = export_for_qaic(model, tmp_path, layerwise=layerwise, **SHAPE)
    tokens, logits = ort_generate(result.onnx_path, PROMPTS, 6, SHAPE["prefill_seq_len"])
    want_tokens, want_logits = eager_reference(model, PROMPTS, 6)
    assert tokens == want_tokens
    for step, got in enumerate(logits):  # decode steps: the tokens after the first
        want = torch.stack([w[step + 1] for w in want_logits])
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-4, rtol=0)


def test_a_local_model_directory_exports(tmp_path):
    model = hf("llama", 4)
    model.save_pretrained(tmp_path / "model")
    result = export_for_qaic(str(tmp_path / "model"), tmp_path / "out", **SHAPE)
    tokens, _ = ort_generate(result.onnx_path, PROMPTS, 4, SHAPE["prefill_seq_len"])
    assert tokens == LLM(str(tmp_path / "model"), backend="eager").generate(PROMPTS, 4)


def run_all(path, feeds):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def random_feeds(names_shapes, batch, seq, ctx, seed=0):
    g = np.random.default_rng(seed)
    feeds = {"input_ids": g.integers(0, 256, (batch, seq)).astype(np.int64)}
    pos = np.tile(np.arange(3, 3 + seq), (batch, 1)).astype(np.int64)
    pos[1, -2:] = -1  # a padded tail
    feeds["position_ids"] = pos
    for name, shape in names_shapes:
        feeds[name] = g.standard_normal([batch, shape[1], ctx, shape[3]]).astype(np.float32)
    return feeds


@pytest.mark.parametrize("layers", [4, pytest.param(6, marks=pytest.mark.slow)])
def test_stitched_equals_direct_whole_model_export(layers, tmp_path):
    model = llama(layers)
    stitched = export_for_qaic(model, tmp_path, layerwise=True, **SHAPE)
    direct = export_for_qaic(model, tmp_path, layerwise=False, **SHAPE)
    assert stitched.export_dir != direct.export_dir and stitched.output_names == direct.output_names
    sess = ort.InferenceSession(str(direct.onnx_path), providers=["CPUExecutionProvider"])
    shapes = [(i.name, i.shape) for i in sess.get_inputs()[2:]]
    feeds = random_feeds(shapes, batch=2, seq=5, ctx=32)
    a, b = run_all(stitched.onnx_path, feeds), run_all(direct.onnx_path, feeds)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-5, rtol=0)


def test_padding_never_writes_a_real_slot(exported):
    sess = ort.InferenceSession(str(exported.onnx_path), providers=["CPUExecutionProvider"])
    shapes = [(i.name, i.shape) for i in sess.get_inputs()[2:]]
    feeds = random_feeds(shapes, batch=2, seq=5, ctx=32)
    feeds["position_ids"][1] = [4, 5, -1, -1, -1]
    out = run_all(exported.onnx_path, feeds)
    for name, _ in shapes:
        new, old = out[name + SUFFIX], feeds[name]
        written = {(0, p) for p in range(3, 8)} | {(1, 4), (1, 5)}
        for b in range(2):
            for slot in range(32):
                if (b, slot) not in written:  # the last slot (where -1 would land) included
                    np.testing.assert_array_equal(new[b, :, slot], old[b, :, slot])
        assert not np.array_equal(new[1, :, 4], old[1, :, 4])
    # A row of padding only writes nothing at all.
    feeds["position_ids"][1] = -1
    out = run_all(exported.onnx_path, feeds)
    np.testing.assert_array_equal(out["past_key.0" + SUFFIX][1], feeds["past_key.0"][1])


def test_ctx_ops_and_their_onnx_functions_agree():
    from onnx import helper

    from qaic_dynamo.ops.onnx_functions import CtxGather, CtxScatter

    g = torch.Generator().manual_seed(0)
    data = torch.randn(2, 3, 7, 4, generator=g)
    pos = torch.tensor([[2, 6, -1], [-1, -1, -1]])
    upd = torch.randn(2, 3, 3, 4, generator=g)
    want = data.clone()
    want[0, :, 2], want[0, :, 6] = upd[0, :, 0], upd[0, :, 1]
    torch.testing.assert_close(torch.ops.qaic.ctx_scatter(data, pos, upd), want, atol=0, rtol=0)
    idx = torch.tensor([[[6, 0]] * 3, [[1, 1]] * 3])
    torch.testing.assert_close(
        torch.ops.qaic.ctx_gather(data, idx), torch.stack([data[0][:, [6, 0]], data[1][:, [1, 1]]]), atol=0, rtol=0
    )

    def run_fn(fn, inputs):
        proto = fn.to_function_proto()
        names = list(proto.input)
        node = helper.make_node(proto.name, names, ["out"], domain=proto.domain)
        vis = [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(names, inputs)
        ]
        graph = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info("out", 1, None)])
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(proto.domain, 1)],
            functions=[proto],
            ir_version=10,
        )
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, dict(zip(names, inputs))
        )[0]

    np.testing.assert_array_equal(run_fn(CtxScatter, [data.numpy(), pos.numpy(), upd.numpy()]), want.numpy())
    np.testing.assert_array_equal(
        run_fn(CtxGather, [data.numpy(), idx.numpy()]), torch.ops.qaic.ctx_gather(data, idx).numpy()
    )


def run_function(fn, inputs):
    """Run one onnxscript function as a one-node ONNX Runtime model."""
    from onnx import helper

    proto = fn.to_function_proto()
    names = list(proto.input)
    node = helper.make_node(proto.name, names, ["out"], domain=proto.domain)
    vis = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for n, v in zip(names, inputs)
    ]
    graph = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info("out", 1, None)])
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(proto.domain, 1)],
        functions=[proto],
        ir_version=10,
    )
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, dict(zip(names, inputs))
    )[0]


@pytest.mark.parametrize("seed", range(4))
def test_continuous_batching_ops_and_their_onnx_functions_agree_with_a_reference(seed):
    """ctx_scatter_cb / ctx_gather_cb against plain indexing, and CtxScatterCB / CtxGatherCB
    against the kernels: only the named cache rows change, padding (-1) writes nothing, and a
    row of padding alone leaves its cache row as it was."""
    from qaic_dynamo.ops.onnx_functions import CtxGatherCB, CtxScatterCB

    g = torch.Generator().manual_seed(seed)
    full, heads, ctx, dim, batch, seq = 5, 2, 9, 3, 3, 4
    data = torch.randn(full, heads, ctx, dim, generator=g)
    rows = torch.randperm(full, generator=g)[:batch].reshape(batch, 1)
    pos = torch.randint(0, ctx, (batch, seq), generator=g)
    pos[torch.rand(batch, seq, generator=g) < 0.3] = -1
    pos[seed % batch] = -1  # one row all padding
    for b in range(batch):  # distinct positions in a row (as every real step has)
        real = pos[b][pos[b] >= 0]
        pos[b][pos[b] >= 0] = torch.randperm(ctx, generator=g)[: len(real)]
    upd = torch.randn(batch, heads, seq, dim, generator=g)
    want = data.clone()
    for b in range(batch):
        for s in range(seq):
            if pos[b, s] >= 0:
                want[rows[b, 0], :, pos[b, s]] = upd[b, :, s]
    got = torch.ops.qaic.ctx_scatter_cb(data, rows, pos, upd)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    np.testing.assert_array_equal(
        run_function(CtxScatterCB, [data.numpy(), rows.numpy(), pos.numpy(), upd.numpy()]), want.numpy()
    )
    idx = torch.randint(0, ctx, (batch, heads, 6), generator=g)
    want_g = torch.stack([torch.stack([data[rows[b, 0], h, idx[b, h]] for h in range(heads)]) for b in range(batch)])
    torch.testing.assert_close(torch.ops.qaic.ctx_gather_cb(data, rows, idx), want_g, atol=0, rtol=0)
    np.testing.assert_array_equal(run_function(CtxGatherCB, [data.numpy(), rows.numpy(), idx.numpy()]), want_g.numpy())


def _cb_scatter_args():
    return torch.randn(4, 2, 7, 3), torch.tensor([[3], [1]]), torch.tensor([[2, -1], [0, 6]]), torch.randn(2, 2, 2, 3)


def _cb_gather_args():
    return torch.randn(4, 2, 7, 3), torch.tensor([[0], [2]]), torch.randint(0, 7, (2, 2, 5))


@pytest.mark.parametrize(
    "op, args", [("ctx_scatter_cb", _cb_scatter_args), ("ctx_gather_cb", _cb_gather_args)], ids=["scatter", "gather"]
)
def test_continuous_batching_ops_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.qaic, op).default, args())


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda d, b, p, u: torch.ops.qaic.ctx_scatter_cb(d, torch.tensor([[4], [1]]), p, u),
            r"batch_index\[0\] = 4 is not a row of the cache's 4 \(full_batch_size\)",
        ),
        (lambda d, b, p, u: torch.ops.qaic.ctx_scatter_cb(d, torch.tensor([[1], [1]]), p, u), "names row 1 twice"),
        (
            lambda d, b, p, u: torch.ops.qaic.ctx_scatter_cb(d, torch.tensor([3, 1]), p, u),
            r"batch_index must be \[batch, 1\]",
        ),
        (
            lambda d, b, p, u: torch.ops.qaic.ctx_scatter_cb(d, b, torch.tensor([[7, 0], [0, 1]]), u),
            "position 7 .* does not fit in ctx_len 7",
        ),
        (lambda d, b, p, u: torch.ops.qaic.ctx_gather_cb(d, b, torch.full((2, 2, 1), 7)), r"must lie in \[0, 7\)"),
        (
            lambda d, b, p, u: torch.ops.qaic.ctx_gather_cb(
                d, torch.tensor([[0]]), torch.zeros(2, 2, 1, dtype=torch.long)
            ),
            r"ctx_indices must be \[batch, heads, n\] with batch 1",
        ),
    ],
)
def test_continuous_batching_op_errors(call, message):
    with pytest.raises(RuntimeError, match=message):
        call(*_cb_scatter_args())


@pytest.mark.parametrize(
    "op, args",
    [
        (
            "ctx_scatter",
            lambda: (torch.randn(2, 3, 7, 4), torch.tensor([[2, 6, -1], [0, -1, 1]]), torch.randn(2, 3, 3, 4)),
        ),
        ("ctx_gather", lambda: (torch.randn(2, 3, 7, 4), torch.randint(0, 7, (2, 3, 5)))),
    ],
)
def test_ctx_ops_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.qaic, op).default, args())


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: torch.ops.qaic.ctx_scatter(
                torch.zeros(2, 3, 7, 4), torch.tensor([[7], [0]]), torch.zeros(2, 3, 1, 4)
            ),
            "position 7 .* does not fit in ctx_len 7",
        ),
        (
            lambda: torch.ops.qaic.ctx_scatter(
                torch.zeros(2, 3, 7, 4), torch.tensor([[1], [0]]), torch.zeros(2, 2, 1, 4)
            ),
            r"updates must be \[batch, heads, seq_len, head_dim\]",
        ),
        (
            lambda: torch.ops.qaic.ctx_gather(torch.zeros(2, 3, 7, 4), torch.full((2, 3, 1), 9)),
            r"ctx_indices must lie in \[0, 7\)",
        ),
    ],
)
def test_ctx_op_errors(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


# --- kv_cache_prefix and the three upstream bugs ---------------------------------------------


def test_prefix_changes_the_hash_directory_and_nothing_else(tmp_path):
    model = llama(4)
    plain = export_for_qaic(model, tmp_path, **SHAPE)
    again = export_for_qaic(model, tmp_path, **SHAPE)
    prefixed = export_for_qaic(model, tmp_path, kv_cache_prefix="vllm", **SHAPE)
    assert plain.export_dir == again.export_dir != prefixed.export_dir
    assert json.loads((prefixed.export_dir / "export_params.json").read_text())["options"]["kv_cache_prefix"] == "vllm"
    # Without a prefix the model is the same bytes as the prefixed one with the infix taken out.
    plain_bytes = plain.onnx_path.read_bytes()
    m = onnx.load(str(prefixed.onnx_path), load_external_data=False)

    def unprefix(name: str) -> str:
        return name.replace("_vllm", "")

    for v in (*m.graph.input, *m.graph.output):
        v.name = unprefix(v.name)
    for n in m.graph.node:
        n.input[:] = [unprefix(x) for x in n.input]
        n.output[:] = [unprefix(x) for x in n.output]
        n.name = unprefix(n.name)
    assert m.SerializeToString() == plain_bytes


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_bug1_kv_cache_prefix_reaches_every_export_path(layerwise, tmp_path):
    # QEfficient #1082 bug 1: the layerwise branch dropped kv_cache_prefix.
    result = export_for_qaic(llama(4), tmp_path, kv_cache_prefix="vllm", layerwise=layerwise, **SHAPE)
    inputs, outputs = graph_io(result.onnx_path)
    kv_in = [n for n in inputs if n.startswith("past_")]
    kv_out = [n for n in outputs if n.startswith("past_")]
    assert len(kv_in) == len(kv_out) == 8
    assert all(n.endswith("_vllm") for n in kv_in) and all(n.endswith("_vllm" + SUFFIX) for n in kv_out)
    assert (
        "past_key.0_vllm" in result.custom_io_path.read_text()
        and "past_key.0\n" not in result.custom_io_path.read_text()
    )


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_bug2_output_names_come_from_the_one_naming_function(layerwise, tmp_path, monkeypatch):
    # QEfficient #1082 bug 2: the layerwise export rebuilt output names from its own
    # templates. Here every path's names flow through apply_kv_cache_prefix: a change
    # there reaches both exports' outputs and, through alignment, their inputs.
    real = qexport_names.apply_kv_cache_prefix
    monkeypatch.setattr(
        qexport_names,
        "apply_kv_cache_prefix",
        lambda names, prefix: [n.replace(SUFFIX, "_marked" + SUFFIX) for n in real(names, prefix)],
    )
    result = export_for_qaic(llama(4), tmp_path, kv_cache_prefix="P", layerwise=layerwise, **SHAPE)
    inputs, outputs = graph_io(result.onnx_path)
    assert all(o.endswith("_P_marked" + SUFFIX) for o in outputs[1:]) and len(outputs) == 9
    assert all(i.endswith("_P_marked") for i in inputs[2:])


def test_bug3_layerwise_inputs_are_aligned_to_the_prefixed_outputs(tmp_path):
    # QEfficient #1082 bug 3: layerwise export did not rename the KV inputs to match the
    # prefixed outputs, so the compiler could not pair them (and dynamic axes were lost).
    result = export_for_qaic(llama(5), tmp_path, kv_cache_prefix="vllm", layerwise=True, **SHAPE)
    m = onnx.load(str(result.onnx_path), load_external_data=False)
    inputs = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in m.graph.input}
    for out in m.graph.output[1:]:
        x = out.name[: -len(SUFFIX)]
        assert x in inputs, f"{out.name} has no input {x}"
        assert inputs[x] == ["batch_size", 2, "ctx_len", 16]
    tokens, _ = ort_generate(result.onnx_path, PROMPTS, 4, SHAPE["prefill_seq_len"])
    assert tokens == LLM(llama(5), backend="eager").generate(PROMPTS, 4)


class VisionEmbeds(nn.Module):
    """Token embeddings plus a retained ``vision_embeds`` buffer (a multimodal stand-in)."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed
        self.register_buffer("vision_embeds", torch.full((embed.embedding_dim,), 0.01))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) + self.vision_embeds


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_a_non_kv_retained_buffer_keeps_its_name(layerwise, tmp_path):
    model = llama(4)
    model.embed_tokens = VisionEmbeds(model.embed_tokens)
    result = export_for_qaic(
        model,
        tmp_path,
        kv_cache_prefix="vllm",
        layerwise=layerwise,
        kv_precision="mxint8",
        retained_buffers=["embed_tokens.vision_embeds"],
        **SHAPE,
    )
    inputs, outputs = graph_io(result.onnx_path)
    assert "embed_tokens.vision_embeds" in inputs and outputs[-1] == "embed_tokens.vision_embeds" + SUFFIX
    assert all(n.endswith("_vllm") for n in inputs if n.startswith("past_"))
    # The KV at mxint8, the vision buffer (float32 in the model) at float16, never mxint8.
    got = precisions(result.custom_io_path.read_text())
    assert got.pop("embed_tokens.vision_embeds") == got.pop("embed_tokens.vision_embeds" + SUFFIX) == "float16"
    assert set(got.values()) == {"mxint8"} and len(got) == 2 * 2 * 4  # (key, value) x (in, out) x 4 layers
    sess = ort.InferenceSession(str(result.onnx_path), providers=["CPUExecutionProvider"])
    shapes = [(i.name, i.shape) for i in sess.get_inputs()[2:] if i.name.startswith("past_")]
    feeds = random_feeds(shapes, batch=2, seq=3, ctx=32)
    feeds["embed_tokens.vision_embeds"] = np.full(64, 0.5, dtype=np.float32)
    out = run_all(result.onnx_path, feeds)
    np.testing.assert_array_equal(out["embed_tokens.vision_embeds" + SUFFIX], feeds["embed_tokens.vision_embeds"])


def test_models_that_differ_anywhere_get_their_own_export_directory(tmp_path):
    """The directory hash sampled each tensor's first and last 4 KiB: two models differing
    in the middle of a tensor shared a directory, and the second export overwrote the
    first's artifact. A module setting outside config and weights counts too."""
    a, b, c = llama(2), llama(2), llama(2)
    with torch.no_grad():
        b.embed_tokens.weight[128] += 1.0  # row 128 of 256: the middle of the tensor
    c.layers[0].self_attn.scale *= 0.5  # not in the config, not a weight
    dirs = [export_for_qaic(m, tmp_path, run_compiler=False, **SHAPE).export_dir for m in (a, b, c)]
    assert len(set(dirs)) == 3, dirs
    assert (
        export_for_qaic(llama(2), tmp_path, run_compiler=False, **SHAPE).export_dir == dirs[0]
    )  # same model, same dir


def test_ctx_len_past_the_models_positions_is_refused(tmp_path):
    model = hf("llama", 2)
    limit = model.config.max_position_embeddings
    with pytest.raises(ExportError, match=f"ctx_len={limit + 1} exceeds the model's max_position_embeddings={limit}"):
        export_for_qaic(model, tmp_path, ctx_len=limit + 1, prefill_seq_len=8)


@pytest.mark.parametrize(
    "rope, limit",
    [
        ({"rope_type": "linear", "factor": 4.0}, 128),  # 32 trained positions stretched 4x, as vLLM counts them
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 64),
        ({"rope_type": "default"}, 32),
    ],
)
def test_rope_scaling_extends_the_positions_a_context_may_use(rope, limit, tmp_path):
    from transformers import LlamaConfig

    from qaic_dynamo.models import max_positions

    model = hf_model_from_config(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            rope_parameters={**rope, "rope_theta": 10000.0},
        )
    )
    assert max_positions(LLM(model, backend="eager").model) == limit
    export_for_qaic(model, tmp_path, ctx_len=limit, prefill_seq_len=8, run_compiler=False)  # refused at 128 before
    said = (
        f"max_position_embeddings={limit}"
        if limit == 32
        else rf"maximum of {limit} positions \(max_position_embeddings=32 stretched by its RoPE scaling factor\)"
    )
    with pytest.raises(ExportError, match=f"exceeds the model's {said}"):  # the limit named for what it is
        export_for_qaic(model, tmp_path, ctx_len=limit + 1, prefill_seq_len=8, run_compiler=False)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 4.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [8.0] * 8,
            "original_max_position_embeddings": 16,
        },
    ],
)
def test_rope_chosen_by_sequence_length_is_an_export_error(rope, tmp_path):
    # The engine serves these; the export crashed inside torch's tracer (data-dependent
    # guard, or a tensor attribute swapped in the forward) with no word of the cause.
    from transformers import LlamaConfig

    model = hf_model_from_config(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            rope_parameters={**rope, "rope_theta": 10000.0},
        )
    )
    with pytest.raises(ExportError, match=f"rope_type '{rope['rope_type']}' chooses its RoPE frequencies"):
        export_for_qaic(model, tmp_path, ctx_len=16, prefill_seq_len=8, run_compiler=False)


def test_an_architecture_the_qaic_ops_cannot_run_is_an_export_error(tmp_path, monkeypatch):
    from qaic_dynamo.models import hf as qhf

    # As for a hybrid model (Jamba) or non-causal attention: HFCausalLM raises NotImplementedError.
    monkeypatch.setattr(qhf, "unsupported_attention_features", lambda config, layers: ["non-causal attention (x)"])
    with pytest.raises(ExportError, match="non-causal attention"):
        export_for_qaic(hf("llama", 2), tmp_path, **SHAPE)


def test_a_float16_export_runs_on_onnx_runtime_with_float16_caches(tmp_path):
    """ort_generate fed float32 caches to every export: a float16 model (a local float16
    checkpoint) failed its validation."""
    model = llama(2).half()
    result = export_for_qaic(model, tmp_path, run_compiler=False, **SHAPE)
    got, _ = ort_generate(result.onnx_path, PROMPTS, 3, SHAPE["prefill_seq_len"])
    assert got == LLM(model, backend="eager", max_model_len=SHAPE["ctx_len"]).generate(PROMPTS, 3)


def test_ort_generate_names_what_it_cannot_feed(tmp_path):
    model = llama(2)
    model.embed_tokens = VisionEmbeds(model.embed_tokens)
    result = export_for_qaic(
        model, tmp_path / "v", retained_buffers=["embed_tokens.vision_embeds"], run_compiler=False, **SHAPE
    )
    with pytest.raises(ExportError, match=r"feeds KV caches only; .* also takes \['embed_tokens.vision_embeds'\]"):
        ort_generate(result.onnx_path, PROMPTS, 2, SHAPE["prefill_seq_len"])
    bf16 = export_for_qaic(
        hf("llama", 2).to(torch.bfloat16), tmp_path / "b", hw_version="ai200", run_compiler=False, **SHAPE
    )
    with pytest.raises(ExportError, match="ONNX Runtime cannot load .* lack bfloat16"):
        ort_generate(bf16.onnx_path, PROMPTS, 2, SHAPE["prefill_seq_len"])
    with pytest.raises(ExportError, match="ONNX Runtime cannot load") as e:  # any other failure: no bfloat16 hint
        ort_generate(tmp_path / "missing.onnx", PROMPTS, 2, SHAPE["prefill_seq_len"])
    assert "bfloat16" not in str(e.value)


@pytest.mark.parametrize(
    "prompts, new, message",
    [
        # ONNX Gather read -1 as the vocabulary's last row; 0 tokens gave one; [] crashed inside
        ([[-1, 6, 7]], 3, r"prompt 0 has token ids outside the vocabulary \[0, 256\): \[-1\]"),
        ([[5, 6], [256]], 3, r"prompt 1 has token ids outside the vocabulary \[0, 256\): \[256\]"),
        ([[5, 6, 7]], 0, "max_new_tokens must be a positive int, got 0"),
        ([[5], []], 3, "each with at least one token id"),
        ([5, 6, 7], 3, r"prompts must be a list of token-id lists, e.g. \[\[1, 2, 3\]\] for one prompt"),  # TypeError
    ],
)
def test_ort_generate_refuses_bad_input(exported, prompts, new, message):
    with pytest.raises(ExportError, match=message):
        ort_generate(exported.onnx_path, prompts, new, SHAPE["prefill_seq_len"])


# --- command line ----------------------------------------------------------------------------


def test_cli_exports_validates_and_summarises(tmp_path, capsys):
    from qaic_dynamo.cli import main

    rc = main(
        [
            "export",
            "--model",
            "llama",
            "--layers",
            "4",
            "--hidden-size",
            "64",
            "--out",
            str(tmp_path),
            "--kv-cache-prefix",
            "vllm",
            "--ctx-len",
            "48",
            "--prefill-seq-len",
            "16",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "past_key.0_vllm" in out and "layerwise: 2 traced, one block lowered, stitched" in out
    assert (
        "qaic-compile      not run: command written to" in out and "ONNX Runtime greedy tokens == eager PyTorch" in out
    )
    assert main(["export", "--model", "gpt9", "--out", str(tmp_path)]) == 2
    assert (
        main(["export", "--model", "llama", "--layers", "2", "--out", str(tmp_path), "--kv-cache-prefix", "a.b"]) == 1
    )
    assert "kv_cache_prefix must be" in capsys.readouterr().err


def test_cli_reports_an_unloadable_model_and_skips_a_validation_that_cannot_fit(tmp_path, capsys):
    """A model directory transformers cannot read gave a traceback (only ExportError was
    caught), and --ctx-len 1 exported and then crashed in the validation."""
    from qaic_dynamo.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", "--model", str(empty), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qaic-dynamo export: ") and "Traceback" not in err
    rc = main(
        [
            "export",
            "--model",
            "llama",
            "--layers",
            "2",
            "--hidden-size",
            "64",
            "--out",
            str(tmp_path / "out"),
            "--ctx-len",
            "1",
            "--prefill-seq-len",
            "1",
        ]
    )
    assert rc == 0
    assert "validation        skipped: ctx_len 1 leaves no room to generate a token" in capsys.readouterr().out
    # Past the model's positions (the built-in llama's 2048): refused up front, no traceback
    assert (
        main(
            [
                "export",
                "--model",
                "llama",
                "--layers",
                "2",
                "--hidden-size",
                "64",
                "--out",
                str(tmp_path / "out"),
                "--ctx-len",
                "4096",
            ]
        )
        == 1
    )
    assert "ctx_len=4096 exceeds the model's max_position_embeddings=2048" in capsys.readouterr().err


def test_cli_validates_a_bfloat16_checkpoint_exported_for_ai100_and_skips_it_for_ai200(tmp_path, capsys):
    from qaic_dynamo.cli import main

    hf("llama", 2).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    common = ["export", "--model", str(tmp_path / "bf16"), "--ctx-len", "32", "--prefill-seq-len", "8"]
    assert main([*common, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "bfloat16 checkpoint exported in float32 for ai100" in out
    assert "validation        ONNX Runtime greedy tokens == eager PyTorch in float32" in out
    assert main([*common, "--out", str(tmp_path / "out200"), "--hw", "ai200"]) == 0
    out = capsys.readouterr().out
    assert "weights and KV bfloat16" in out
    assert "validation        skipped: the export is bfloat16 (hw ai200)" in out
    hf("llama", 2).to(torch.float16).save_pretrained(tmp_path / "fp16")  # failed its validation (float32 caches)
    assert (
        main(
            [
                "export",
                "--model",
                str(tmp_path / "fp16"),
                "--out",
                str(tmp_path / "out"),
                "--ctx-len",
                "32",
                "--prefill-seq-len",
                "8",
            ]
        )
        == 0
    )
    assert "ONNX Runtime greedy tokens == eager PyTorch" in capsys.readouterr().out


def first_layer_differs() -> nn.Module:
    model = hf("llama", 5)
    model.model.layers[0].self_attn.scaling *= 0.5  # a constant in layer 0's graph only
    return model


@pytest.mark.parametrize(
    "kind, traced",
    [
        ("hf-llama", 2),  # every layer one graph: blocks 0 and 1 are the template
        ("reference-llama", 2),
        ("first-layer-differs", 3),  # blocks 1 and 2 are the template
    ],
)
def test_layerwise_traces_two_blocks_or_three_when_the_first_differs(kind, traced, tmp_path):
    model = {
        "reference-llama": lambda: llama(5),
        "hf-llama": lambda: hf("llama", 5),
        "first-layer-differs": first_layer_differs,
    }[kind]()
    stitched = export_for_qaic(model, tmp_path, layerwise=True, **SHAPE)
    direct = export_for_qaic(model, tmp_path, layerwise=False, **SHAPE)
    assert stitched.traced_layers == traced and direct.traced_layers == 5
    for result in (stitched, direct):  # one batch and one ctx_len axis, whichever ops tie them
        g = onnx.load(str(result.onnx_path), load_external_data=False).graph
        assert {tuple(d.dim_param for d in v.type.tensor_type.shape.dim if d.dim_param) for v in g.input} == {
            ("batch_size", "seq_len"),
            ("batch_size", "ctx_len"),
        }
    assert f"{traced} traced" in stitched.summary()
    sess = ort.InferenceSession(str(direct.onnx_path), providers=["CPUExecutionProvider"])
    feeds = random_feeds([(i.name, i.shape) for i in sess.get_inputs()[2:]], batch=2, seq=5, ctx=32)
    a, b = run_all(stitched.onnx_path, feeds), run_all(direct.onnx_path, feeds)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-5, rtol=0)


def test_a_later_layer_that_differs_is_refused_not_stitched_from_layer_1(tmp_path):
    # Layers 0-2 full attention, layer 3 sliding: the traced blocks (0, 1) agree, so only
    # comparing every layer's settings catches that layer 3 builds another graph.
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=4,
        layer_types=["full_attention"] * 3 + ["sliding_attention"],
    )
    model = hf_model_from_config(cfg)
    with pytest.raises(
        ExportError,
        match=r"decoder layer 3 of hf\.model\.layers differs from layer 1 .*sliding_window"
        r".*layerwise=False",
    ):
        export_for_qaic(model, tmp_path, layerwise=True, **SHAPE)
    result = export_for_qaic(model, tmp_path, layerwise=False, **SHAPE)
    tokens, _ = ort_generate(result.onnx_path, PROMPTS, 4, SHAPE["prefill_seq_len"])
    assert tokens == eager_reference(model, PROMPTS, 4)[0]


@pytest.mark.parametrize(
    "family, differs",
    [
        ("gemma2", r"decoder layer 2 .*sliding"),  # sliding / global alternate
        ("gpt_oss", r"decoder layer 2 .*sliding"),
        ("smollm3", r"decoder layer 3 .*use_rope"),  # every 4th layer has no RoPE: 1 and 2 agree
        ("qwen2_moe", None),  # every layer one graph: layerwise works
    ],
)
def test_newer_families_export_whole_and_layerwise_only_when_their_layers_agree(family, differs, tmp_path):
    import test_new_families

    model = getattr(test_new_families, family)(4)
    if differs is None:
        result = export_for_qaic(model, tmp_path, layerwise=True, **SHAPE)
        assert result.traced_layers == 2
    else:
        with pytest.raises(ExportError, match=differs + r".*export with layerwise=False"):
            export_for_qaic(model, tmp_path, layerwise=True, **SHAPE)
        result = export_for_qaic(model, tmp_path, layerwise=False, **SHAPE)
    tokens, logits = ort_generate(result.onnx_path, PROMPTS, 4, SHAPE["prefill_seq_len"])
    want_tokens, want_logits = eager_reference(model, PROMPTS, 4)
    assert tokens == want_tokens
    for step, got in enumerate(logits):
        torch.testing.assert_close(
            torch.from_numpy(got), torch.stack([w[step + 1] for w in want_logits]), atol=1e-4, rtol=0
        )
