"""Deployment on par with QEfficient (issue 37): the bf16 policy and hardware versions,
continuous batching, prefill-only / decode-only artifacts, compute-context lengths, the
CLI's compiler options and QEfficient's specializations."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
import torch
from test_export import hf, llama, mla

from qaic_dynamo import LLM
from qaic_dynamo.deploy.export import (
    ExportError,
    ExportOptions,
    continuous_batching_generate,
    export_for_qaic,
    export_prefill_decode,
    ort_generate,
)
from qaic_dynamo.deploy.export.specializations import ccl_lengths

PROMPT_LENGTHS = (3, 9, 17, 5, 12, 7, 20, 2, 11, 6)
BUDGETS = (4, 6, 3, 5, 7, 2, 4, 6, 3, 5)


def prompts(n: int = 10, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in PROMPT_LENGTHS[:n]]


def io(path: Path) -> dict[str, tuple[list, int]]:
    """name -> (dims, element type) of every graph input and output."""
    g = onnx.load(str(path), load_external_data=False).graph
    return {
        v.name: ([d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim], v.type.tensor_type.elem_type)
        for v in [*g.input, *g.output]
    }


def specs(result) -> list[dict]:
    return json.loads(Path(result.specializations_path).read_text())["specializations"]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own generate, greedy, for one prompt alone (no early stop at EOS: the
    export's loop runs a fixed budget)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


# --- the bf16 policy and hw_version ----------------------------------------------------------


def _float_types(result) -> dict[str, int]:
    shapes = io(result.onnx_path)
    return {"kv": shapes["past_key.0"][1], "logits": shapes["logits"][1]}


def test_a_bfloat16_checkpoint_exports_in_float32_for_ai100(tmp_path):
    result = export_for_qaic(
        hf("llama", 2).to(torch.bfloat16), tmp_path, run_compiler=False, prefill_seq_len=8, ctx_len=32
    )
    assert result.dtype == "float32" and result.source_dtype == "bfloat16"
    assert _float_types(result) == {"kv": onnx.TensorProto.FLOAT, "logits": onnx.TensorProto.FLOAT}
    weights = onnx.load(str(result.onnx_path), load_external_data=False).graph.initializer
    assert weights and {w.data_type for w in weights if w.name.endswith("weight")} == {onnx.TensorProto.FLOAT}
    assert "Precision: float16" in Path(result.custom_io_path).read_text()
    cmd = result.compile_command
    assert "-aic-hw-version=ai100" in cmd and "-convert-to-fp16" in cmd
    assert any(c.startswith("-custom-IO-list-file=") for c in cmd)
    assert "bfloat16 checkpoint exported in float32 for ai100" in result.summary()
    # and it runs here as the float32 model it is
    tokens, _ = ort_generate(result.onnx_path, prompts(3), 3, 8)
    want = LLM(hf("llama", 2), backend="eager", max_model_len=32).generate(prompts(3), 3)
    assert tokens == want


def test_a_bfloat16_checkpoint_stays_bfloat16_on_ai200(tmp_path):
    result = export_for_qaic(
        hf("llama", 2).to(torch.bfloat16),
        tmp_path,
        hw_version="ai200",
        run_compiler=False,
        prefill_seq_len=8,
        ctx_len=32,
    )
    assert result.dtype == "bfloat16"
    assert _float_types(result) == {"kv": onnx.TensorProto.BFLOAT16, "logits": onnx.TensorProto.FLOAT}
    assert "Precision: bfloat16" in Path(result.custom_io_path).read_text()
    cmd = result.compile_command
    assert "-aic-hw-version=ai200" in cmd and "-convert-to-fp16" not in cmd
    # model and KV both bfloat16: written, not passed (as QEfficient)
    assert not any(c.startswith("-custom-IO-list-file=") for c in cmd) and Path(result.custom_io_path).is_file()
    # mxint8 KV on a bfloat16 model does go to the compiler
    mx = export_for_qaic(
        hf("llama", 2).to(torch.bfloat16),
        tmp_path,
        hw_version="ai200",
        kv_precision="mxint8",
        run_compiler=False,
        prefill_seq_len=8,
        ctx_len=32,
    )
    assert any(c.startswith("-custom-IO-list-file=") for c in mx.compile_command)
    assert "Precision: mxint8" in Path(mx.custom_io_path).read_text()


@pytest.mark.parametrize("hw", ["ai100", "ai200"])
def test_float16_stays_float16_on_both(hw, tmp_path):
    result = export_for_qaic(
        hf("llama", 2).to(torch.float16), tmp_path, hw_version=hw, run_compiler=False, prefill_seq_len=8, ctx_len=32
    )
    assert result.dtype == "float16"
    assert _float_types(result) == {"kv": onnx.TensorProto.FLOAT16, "logits": onnx.TensorProto.FLOAT}
    assert "Precision: float16" in Path(result.custom_io_path).read_text()
    assert f"-aic-hw-version={hw}" in result.compile_command and "-convert-to-fp16" in result.compile_command


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(hw_version="ai300"), r"hw_version must be one of \['ai100', 'ai200'\], got 'ai300'"),
        (dict(hw_version="2.0"), r"hw_version must be one of"),
        (dict(full_batch_size=1, batch_size=2), r"full_batch_size \(1\) must be at least batch_size \(2\)"),
        (dict(full_batch_size=0), "full_batch_size must be a positive int or None"),
        (dict(comp_ctx_lengths_decode=[16, 64]), r"comp_ctx_lengths_decode \[16, 64\] has lengths over ctx_len \(32\)"),
        (dict(comp_ctx_lengths_prefill=[]), "must be a non-empty list of positive ints"),
        (dict(prefill_only="yes"), "prefill_only must be True, False or None"),
        (dict(specializations_format="flat"), r"specializations_format must be one of \['named', 'legacy'\]"),
        (dict(num_devices=0), "num_devices must be a positive int"),
        (dict(kv_precision="int4"), r"kv_precision must be one of \['float16', 'bfloat16', 'mxint8'\]"),
    ],
)
def test_bad_deployment_options_are_export_errors(options, message):
    with pytest.raises(ExportError, match=message):
        ExportOptions.from_options(**{"ctx_len": 32, **options})


def test_a_bfloat16_kv_on_a_float32_export_is_refused(tmp_path):
    with pytest.raises(ExportError, match=r"kv_precision='bfloat16' does not fit a float32 export on ai100"):
        export_for_qaic(llama(2), tmp_path, kv_precision="bfloat16", run_compiler=False, prefill_seq_len=8, ctx_len=32)


# --- continuous batching -------------------------------------------------------------------


CB_MODELS = {
    "llama": lambda: hf("llama", 3),
    "qwen2": lambda: hf("qwen2", 3),
    "mla": lambda: mla(3),
}


@pytest.mark.parametrize("family", list(CB_MODELS))
def test_continuous_batching_serves_ten_requests_in_four_slots_with_each_alones_tokens(family, tmp_path):
    model = CB_MODELS[family]()
    result = export_for_qaic(model, tmp_path, full_batch_size=4, prefill_seq_len=8, ctx_len=64, run_compiler=False)
    reqs = prompts(10, vocab=model.config.vocab_size if hasattr(model, "config") else 256)
    run = continuous_batching_generate(result.onnx_path, reqs, list(BUDGETS), 8, slots=4)
    if family == "mla":  # a reference model of this package: eager PyTorch is the reference
        llm = LLM(model, backend="eager", max_model_len=64)
        want = [llm.generate([p], n)[0] for p, n in zip(reqs, BUDGETS)]
    else:
        want = [hf_greedy(model, p, n) for p, n in zip(reqs, BUDGETS)]
    assert run.tokens == want
    # every request prefilled alone into a free slot while others decoded; slots reused
    assert sorted(set(run.slots)) == [0, 1, 2, 3] and len(run.slots) == 10
    prefills = [e for e in run.events if e[0] == "prefill"]
    assert len(prefills) == 10 and any(run.slots.count(s) >= 3 for s in range(4))
    first_finish = next(i for i, e in enumerate(run.events) if e[0] == "finish")
    assert any(e[0] == "prefill" for e in run.events[first_finish:])  # a slot freed, then refilled
    assert run.decode_steps < sum(BUDGETS)  # requests decoded together


def test_continuous_batching_model_io_specializations_and_custom_io(tmp_path):
    result = export_for_qaic(llama(3), tmp_path, full_batch_size=4, prefill_seq_len=8, ctx_len=32, run_compiler=False)
    shapes = io(result.onnx_path)
    assert shapes["batch_index"] == (["batch_size", 1], onnx.TensorProto.INT64)
    assert shapes["input_ids"][0] == ["batch_size", "seq_len"]
    assert shapes["past_key.0"][0] == ["full_batch_size", 2, "ctx_len", 16]
    assert shapes["past_key.0_RetainedState"][0] == ["full_batch_size", 2, "ctx_len", 16]
    model = onnx.load(str(result.onnx_path), load_external_data=False)
    assert {(f.domain, f.name) for f in model.functions} == {
        ("com.qualcomm.cloud", "CtxScatterCB"),
        ("com.qualcomm.cloud", "CtxGatherCB"),
    }
    assert specs(result) == [
        {
            "name": "Prefill",
            "symbols": {
                "batch_size": "1",
                "seq_len": "8",
                "ctx_len": "32",
                "full_batch_size": "4",
                "full_batch_exec_size": "1",
            },
        },
        {"name": "Decode", "symbols": {"batch_size": "4", "seq_len": "1", "ctx_len": "32", "full_batch_size": "4"}},
    ]
    text = Path(result.custom_io_path).read_text()
    assert "- IOName: past_key.0\n  Precision: float16" in text and "past_value.2_RetainedState" in text


def test_continuous_batching_with_prefill_seq_len_1_has_one_specialization(tmp_path):
    result = export_for_qaic(llama(2), tmp_path, full_batch_size=3, prefill_seq_len=1, ctx_len=32, run_compiler=False)
    assert specs(result) == [
        {
            "name": "Prefill",
            "symbols": {
                "batch_size": "3",
                "seq_len": "1",
                "ctx_len": "32",
                "full_batch_size": "3",
                "full_batch_exec_size": "3",
            },
        }
    ]


def test_prefill_only_with_continuous_batching_is_refused_where_qefficient_refuses_it(tmp_path):
    import test_new_families

    with pytest.raises(ExportError, match=r"prefill_only=True with continuous batching .* 'gpt_oss'"):
        export_for_qaic(
            test_new_families.gpt_oss(2),
            tmp_path,
            prefill_only=True,
            full_batch_size=2,
            layerwise=False,
            run_compiler=False,
            prefill_seq_len=8,
            ctx_len=32,
        )
    # other architectures: allowed, as QEfficient allows them
    result = export_for_qaic(
        llama(2), tmp_path, prefill_only=True, full_batch_size=2, run_compiler=False, prefill_seq_len=8, ctx_len=32
    )
    assert [s["name"] for s in specs(result)] == ["Prefill"]


# --- prefill-only / decode-only, and the pair ------------------------------------------------


@pytest.mark.parametrize("only, names", [(True, ["Prefill"]), (False, ["Decode"]), (None, ["Prefill", "Decode"])])
def test_prefill_only_keeps_the_prefill_specialization_and_false_the_decode_one(only, names, tmp_path):
    result = export_for_qaic(llama(2), tmp_path, prefill_only=only, run_compiler=False, prefill_seq_len=8, ctx_len=32)
    assert [s["name"] for s in specs(result)] == names
    assert json.loads((result.export_dir / "export_params.json").read_text())["options"]["prefill_only"] == only


def test_a_pair_export_is_one_trace_one_model_two_artifacts(tmp_path, monkeypatch):
    from qaic_dynamo.deploy.export import build

    traces = []
    real = build.trace_model
    monkeypatch.setattr(build, "trace_model", lambda *a, **k: traces.append(1) or real(*a, **k))
    pair = export_prefill_decode(
        llama(4), tmp_path, kv_cache_prefix="vllm", prefill_seq_len=8, ctx_len=32, run_compiler=False
    )
    assert len(traces) == 1  # one (two-block) trace for both artifacts
    assert pair.prefill.onnx_path == pair.decode.onnx_path
    assert pair.prefill.export_dir.name == "prefill" and pair.decode.export_dir.name == "decode"
    assert pair.prefill.export_dir.parent == pair.decode.export_dir.parent == pair.prefill.onnx_path.parent
    assert len(list(pair.prefill.onnx_path.parent.glob("*.onnx.data"))) == 1  # the weights written once
    assert [s["name"] for s in specs(pair.prefill)] == ["Prefill"]
    assert [s["name"] for s in specs(pair.decode)] == ["Decode"]
    for r in (pair.prefill, pair.decode):
        assert any(n.endswith("_vllm") for n in r.input_names)  # the prefix on both
        assert f"-m={r.onnx_path}" in r.compile_command
        params = json.loads((r.export_dir / "export_params.json").read_text())
        assert params["onnx"] == "../model.onnx" and params["options"]["kv_cache_prefix"] == "vllm"
    with pytest.raises(ExportError, match="writes both artifacts; pass prefill_only to export_for_qaic"):
        export_prefill_decode(llama(2), tmp_path, prefill_only=True)


def test_retain_full_kv_is_recorded_and_said_to_change_nothing_without_a_window(tmp_path):
    result = export_for_qaic(llama(2), tmp_path, retain_full_kv=True, run_compiler=False, prefill_seq_len=8, ctx_len=32)
    assert any("retain_full_kv changes nothing" in n for n in result.notes)
    assert result.options.retain_full_kv is True


# --- compute-context lengths -----------------------------------------------------------------


def test_ccl_exports_give_the_same_tokens_as_without(tmp_path):
    model = llama(3)
    reqs = prompts(4)
    plain = export_for_qaic(model, tmp_path, prefill_seq_len=8, ctx_len=64, run_compiler=False)
    ccl = export_for_qaic(
        model,
        tmp_path,
        prefill_seq_len=8,
        ctx_len=64,
        comp_ctx_lengths_prefill=[16, 32],
        comp_ctx_lengths_decode=[24, 48],
        ccl_min_length=8,
        run_compiler=False,
    )
    assert io(ccl.onnx_path)["comp_ctx_lengths"][0] == ["comp_ctx_lengths"]
    assert [s["name"] for s in specs(ccl)] == ["Prefill_0", "Prefill_1", "Decode_0", "Decode_1", "Decode_2"]
    assert [s["symbols"]["comp_ctx_lengths"] for s in specs(ccl)] == ["16", "32", "24", "48", "64"]
    want, _ = ort_generate(plain.onnx_path, reqs, 10, 8)
    got, _ = ort_generate(ccl.onnx_path, reqs, 10, 8)
    assert got == want
    # with continuous batching too
    cb = export_for_qaic(
        model,
        tmp_path,
        prefill_seq_len=8,
        ctx_len=64,
        full_batch_size=2,
        comp_ctx_lengths_decode=[24, 48],
        ccl_min_length=8,
        run_compiler=False,
    )
    assert continuous_batching_generate(cb.onnx_path, reqs, 10, 8, slots=2).tokens == want


def test_a_step_past_the_longest_prefill_ccl_is_refused_not_truncated(tmp_path):
    # QEfficient's rule lowers a prefill length that equals a decode one (64 -> 32): a prompt
    # reaching past it cannot be prefilled with these specializations.
    ccl = export_for_qaic(
        llama(2),
        tmp_path,
        prefill_seq_len=8,
        ctx_len=64,
        comp_ctx_lengths_prefill=[32],
        comp_ctx_lengths_decode=[64],
        ccl_min_length=8,
        run_compiler=False,
    )
    assert [s["symbols"]["comp_ctx_lengths"] for s in specs(ccl)] == ["32", "64"]
    with pytest.raises(ExportError, match="reaches position 39, past the longest prefill compute-context length 32"):
        ort_generate(ccl.onnx_path, [list(range(40))], 2, 8)


@pytest.mark.parametrize(
    "options, prefill, decode",
    [
        (
            dict(ctx_len=4096, comp_ctx_lengths_prefill=[512, 2048], comp_ctx_lengths_decode=[1024, 3000]),
            [992, 2048, 4064],
            [1024, 3000, 4096],
        ),  # raised to 1024, ctx_len appended, a prefill length equal to a decode one lowered by 32
        (dict(ctx_len=4096, comp_ctx_lengths_decode=[2048]), [4064], [2048, 4096]),  # the missing list is [ctx_len]
        (
            dict(ctx_len=4096, prefill_seq_len=1, comp_ctx_lengths_prefill=[2048], comp_ctx_lengths_decode=[1024]),
            [1024, 2048, 4096],
            [1024, 2048, 4096],
        ),  # prefill_seq_len 1: one union
        (dict(ctx_len=128, comp_ctx_lengths_decode=[64]), [96], [128]),  # raised, capped at ctx_len, then unique
        (dict(ctx_len=4096), None, None),
    ],
)
def test_ccl_lists_follow_qefficients_rules(options, prefill, decode):
    assert ccl_lengths(ExportOptions.from_options(**options)) == (prefill, decode)


# --- the CLI and the compiler options ----------------------------------------------------------


def cli(tmp_path, *flags) -> Path:
    from qaic_dynamo.cli import main

    out = tmp_path / "out"
    code = main(
        [
            "export",
            "--model",
            "llama",
            "--layers",
            "2",
            "--hidden-size",
            "64",
            "--out",
            str(out),
            "--ctx-len",
            "32",
            "--prefill-seq-len",
            "8",
            "--no-validate",
            *flags,
        ]
    )
    assert code == 0
    return out


def only_dir(out: Path) -> Path:
    (d,) = [p for p in out.iterdir() if p.is_dir()]
    return d


def test_cli_compiler_options_reach_the_command(tmp_path):
    d = only_dir(
        cli(
            tmp_path,
            "--hw",
            "ai200",
            "--mxfp6-matmul",
            "--mxint8-kv",
            "--num-devices",
            "2",
            "--mos",
            "1",
            "--aic-enable-depth-first",
            "--num-cores",
            "8",
        )
    )
    cmd = (d / "compile.sh").read_text().splitlines()[-1].split()
    assert "-aic-hw-version=ai200" in cmd and "-mxfp6-matmul" in cmd and "-mos=1" in cmd
    assert "-aic-enable-depth-first" in cmd and "-aic-num-cores=8" in cmd
    assert f"-mdp-load-partition-config={d / 'mdp_ts_2.json'}" in cmd
    assert json.loads((d / "mdp_ts_2.json").read_text()) == {
        "connections": [{"devices": [0, 1], "type": "p2p"}],
        "partitions": [
            {"name": "Partition0", "devices": [{"deviceId": 0, "numCores": 8}, {"deviceId": 1, "numCores": 8}]}
        ],
    }
    assert "Precision: mxint8" in (d / "custom_io.yaml").read_text()


def test_cli_one_specialization_at_prefill_seq_len_1_and_the_legacy_form(tmp_path):
    d = only_dir(cli(tmp_path, "--prefill-seq-len", "1", "--specializations-format", "legacy"))
    assert json.loads((d / "specializations.json").read_text()) == {
        "specializations": [{"batch_size": "1", "seq_len": "1", "ctx_len": "32"}]
    }


def test_cli_prefill_only_decode_only_and_the_pair(tmp_path):
    for flag, names in (("--prefill-only", ["Prefill"]), ("--decode-only", ["Decode"])):
        d = only_dir(cli(tmp_path / flag, flag))
        assert [s["name"] for s in json.loads((d / "specializations.json").read_text())["specializations"]] == names
    pair = only_dir(cli(tmp_path / "pair", "--disagg", "--kv-cache-prefix", "vllm", "--full-batch-size", "2"))
    assert (pair / "model.onnx").is_file() and (pair / "prefill" / "compile.sh").is_file()
    assert (pair / "decode" / "specializations.json").is_file()


def test_cli_refuses_an_unknown_hw_version(tmp_path, capsys):
    from qaic_dynamo.cli import main

    with pytest.raises(SystemExit) as e:
        main(["export", "--out", str(tmp_path), "--hw", "ai300"])
    assert e.value.code == 2 and "invalid choice: 'ai300'" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["llama-layerwise", "llama-whole", "mla"])
def test_splits_export_as_split_nodes_not_sequences(kind, tmp_path):
    """onnxscript lowers split / chunk to SplitToSequence + SequenceAt: a sequence-typed
    graph, which onnx's checker refuses in bfloat16 and QEfficient's models never hold."""
    model = mla(3) if kind == "mla" else llama(3)
    result = export_for_qaic(
        model, tmp_path, layerwise=kind != "llama-whole", prefill_seq_len=8, ctx_len=32, run_compiler=False
    )
    ops = {n.op_type for n in onnx.load(str(result.onnx_path), load_external_data=False).graph.node}
    assert "Split" in ops and not ops & {"SplitToSequence", "SequenceAt"}, sorted(ops)
    prompt = prompts(1)[0]
    tokens, _ = ort_generate(result.onnx_path, [prompt], 4, 8)
    assert tokens == LLM(model, "eager").generate([prompt], 4)


def test_the_reference_llama_in_bfloat16_exports_for_ai200(tmp_path):
    # Its fused q/k/v and gate/up projections are split: as sequences, onnx's checker
    # refused the bfloat16 model.
    result = export_for_qaic(
        llama(2).to(torch.bfloat16), tmp_path, hw_version="ai200", prefill_seq_len=8, ctx_len=32, run_compiler=False
    )
    assert _float_types(result) == {"kv": onnx.TensorProto.BFLOAT16, "logits": onnx.TensorProto.FLOAT}


@pytest.mark.parametrize("layerwise", [True, False])
def test_retained_state_outputs_are_the_scatters_own(layerwise, tmp_path):
    """Stitching named outputs through Identity nodes: a runtime binding a KV input and its
    retained-state output to one buffer then copied the whole cache on every call."""
    result = export_for_qaic(
        hf("llama", 3),
        tmp_path,
        layerwise=layerwise,
        full_batch_size=2,
        prefill_seq_len=8,
        ctx_len=32,
        run_compiler=False,
    )
    g = onnx.load(str(result.onnx_path), load_external_data=False).graph
    producer = {o: n for n in g.node for o in n.output}
    for o in g.output[1:]:
        node = producer[o.name]
        assert node.op_type == "CtxScatterCB" and node.input[0] == o.name.removesuffix("_RetainedState"), o.name
    assert producer["logits"].op_type != "Identity"
