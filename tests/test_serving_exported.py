"""Serving what you export (issue 37): the prefill-only and decode-only artifacts of
``export_prefill_decode`` behind ``DisaggregatedServer.from_export`` on ONNX Runtime, with
their KV buffers bound in place in shared memory."""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys

import pytest
import torch
from test_serving import (
    CTX,
    SLOT_GUARD_BODY,
    assert_only_the_prefilling_request_failed,
    eager_tokens,
    generate_killing_prefill,
    llama,
    shm_segments,
    workload,
)

from qaic_dynamo.deploy.export import export_for_qaic, export_prefill_decode
from qaic_dynamo.deploy.serving import DisaggregatedServer, ExportedModel
from qaic_dynamo.errors import ExportError


@pytest.fixture(scope="module")
def cb_pair(tmp_path_factory):
    """A continuous-batching pair (4 slots) with a kv_cache_prefix, as vLLM's disaggregated
    QEfficient flow exports it."""
    out = tmp_path_factory.mktemp("cb_pair")
    pair = export_prefill_decode(
        llama(2), out, full_batch_size=4, prefill_seq_len=16, ctx_len=CTX, kv_cache_prefix="vllm", run_compiler=False
    )
    return pair.prefill.export_dir.parent


@pytest.fixture(scope="module")
def static_pair(tmp_path_factory):
    """A pair without continuous batching: 3 decode rows, decoded in runs of consecutive slots."""
    out = tmp_path_factory.mktemp("static_pair")
    pair = export_prefill_decode(llama(2), out, batch_size=3, prefill_seq_len=16, ctx_len=CTX, run_compiler=False)
    return pair.prefill.export_dir.parent


def test_a_transformers_model_export_serves_its_own_tokens(tmp_path):
    from test_export import hf

    model = hf("llama", 3)
    pair = export_prefill_decode(model, tmp_path, full_batch_size=2, prefill_seq_len=16, ctx_len=64, run_compiler=False)
    prompts, max_tokens = [[5] * 20, [9, 8, 7], [3] * 40], [6, 9, 4]
    with DisaggregatedServer.from_export(pair.prefill.export_dir.parent) as server:
        results = server.generate(prompts, max_tokens)
    assert [r.token_ids for r in results] == eager_tokens(model, prompts, max_tokens)


def test_the_exported_model_reads_what_the_export_fixed(cb_pair):
    model = ExportedModel(cb_pair)
    assert (model.decode_slots, model.ctx_len, model.chunk_size, model.kv_cache_prefix) == (4, CTX, 16, "vllm")
    assert model.prefill.export_dir == cb_pair / "prefill" and model.decode.export_dir == cb_pair / "decode"
    assert model.buffer_shapes(4)["past_key.0_vllm"] == (4, 2, CTX, 16)
    assert model.dtype == torch.float32 and model.vocab == 256
    assert ExportedModel(cb_pair.parent).prefill.export_dir == cb_pair / "prefill"  # the output dir above it
    assert pickle.loads(pickle.dumps(model)).kv == model.kv  # what the spawned workers get


@pytest.mark.parametrize("pair", ["cb_pair", "static_pair"])
def test_exported_artifacts_serve_eager_tokens_with_a_zero_copy_hand_off(pair, request):
    directory = request.getfixturevalue(pair)
    model = llama(2)
    prompts, max_tokens = workload(12)
    free = eager_tokens(model, prompts, max_tokens)
    stop = (next(t for t, n in zip(free, max_tokens) if n >= 5)[2],)
    before = shm_segments()
    with DisaggregatedServer.from_export(directory) as server:
        assert server.cfg["backend"] == "onnxruntime"
        segments = set(server.buffers.segment_names)
        results = server.generate(prompts, max_tokens, stop_token_ids=stop)
    assert shm_segments() == before and not segments & shm_segments()  # every segment unlinked
    assert [r.error for r in results] == [None] * len(prompts)
    assert [r.token_ids for r in results] == eager_tokens(model, prompts, max_tokens, stop)
    assert all(r.kv_bytes_moved == 0 for r in results)


@pytest.mark.parametrize("transport", ["copy", "gloo"])
def test_exported_artifacts_over_copying_and_gloo_transports(cb_pair, transport):
    model = llama(2)
    prompts, max_tokens = workload(5, seed=1)
    with DisaggregatedServer.from_export(cb_pair, transport=transport) as server:
        results = server.generate(prompts, max_tokens)
    assert [r.token_ids for r in results] == eager_tokens(model, prompts, max_tokens)
    slot_bytes = 2 * 2 * 2 * CTX * 16 * 4  # layers x (key, value) x kv heads x ctx_len x head_dim x fp32
    assert all(r.kv_bytes_moved == slot_bytes for r in results)


def test_killing_the_exported_prefill_worker_fails_its_request_and_decode_serves_the_rest(cb_pair):
    model = llama(2)
    prompts = [[7] * 5, [8] * 6, [9] * 200, [10] * 4, [11] * 3]
    max_tokens = [40, 40, 4, 4, 4]
    # The 200-token prompt takes 13 chunks of 16, 50 ms each.
    with DisaggregatedServer.from_export(cb_pair, chunk_delay=0.05) as server:
        results = generate_killing_prefill(server, prompts, max_tokens, after=0.25)
        assert server.restarts == 1
    assert_only_the_prefilling_request_failed(model, results, prompts, max_tokens)


def test_a_ccl_export_serves_from_one_directory_and_refuses_prompts_past_its_prefill_ccl(tmp_path):
    # Prefill CCLs [64, 256] become [64, 224]: 256 is also a Decode length (QEfficient's rule).
    result = export_for_qaic(
        llama(2),
        tmp_path,
        full_batch_size=2,
        prefill_seq_len=16,
        ctx_len=CTX,
        comp_ctx_lengths_prefill=[64],
        comp_ctx_lengths_decode=[128],
        ccl_min_length=32,
        run_compiler=False,
    )
    model = llama(2)
    prompts, max_tokens = [[5] * 20, [6] * 100, [7] * 3], [30, 8, 40]  # decode crosses CCL 128
    with DisaggregatedServer.from_export(result.export_dir) as server:  # one full export: both roles
        assert server.max_prompt_len == 224
        with pytest.raises(ValueError, match=r"longer than the 224 positions .* comp_ctx_lengths_prefill"):
            server.generate([[1] * 225], 1)
        results = server.generate(prompts, max_tokens)
    assert [r.token_ids for r in results] == eager_tokens(model, prompts, max_tokens)


def test_from_export_refuses_what_the_export_fixed_and_artifacts_it_cannot_serve(cb_pair, tmp_path):
    with pytest.raises(ValueError, match=r"decode_slots=8, but the export serves decode_slots=4"):
        DisaggregatedServer.from_export(cb_pair, decode_slots=8)
    with pytest.raises(ValueError, match=r"chunk_size=64, but the export serves chunk_size=16"):
        DisaggregatedServer.from_export(cb_pair, chunk_size=64)
    with pytest.raises(ExportError, match="is a decode-only export"):
        DisaggregatedServer.from_export(cb_pair / "decode", cb_pair / "prefill")
    with pytest.raises(ExportError, match="holds no export"):
        DisaggregatedServer.from_export(tmp_path)
    other = export_prefill_decode(llama(3), tmp_path / "other", prefill_seq_len=16, ctx_len=CTX, run_compiler=False)
    with pytest.raises(ExportError, match="differ in model"):
        DisaggregatedServer.from_export(cb_pair / "prefill", other.decode.export_dir)
    bf16 = export_prefill_decode(
        llama(2).to(torch.bfloat16),
        tmp_path / "bf16",
        hw_version="ai200",
        prefill_seq_len=16,
        ctx_len=64,
        run_compiler=False,
    )
    with pytest.raises(ExportError, match=r"BFLOAT16.*float32 or float16 .*hw_version='ai100'"):
        DisaggregatedServer.from_export(bf16.prefill.export_dir.parent)


# One process, both sessions, over page-protected buffers: while a run works on one slot,
# the other slot's pages are read-only, as they belong to another process's run. A write
# there - ONNX Runtime copying a whole retained-state buffer, or a padding row writing its
# position 0 back - kills the process with SIGSEGV.
SLOT_GUARD = (
    """
import ctypes, json, mmap, sys
import torch
from qaic_dynamo.engine import Request
from qaic_dynamo.deploy.serving import ExportedModel, OrtSession

exported, control = ExportedModel(sys.argv[1]), sys.argv[2] == "control"
prefill, decode = OrtSession(exported, "prefill"), OrtSession(exported, "decode")
shapes, chunk = exported.buffer_shapes(2), exported.chunk_size
"""
    + SLOT_GUARD_BODY
)


@pytest.mark.parametrize("case", ["cb", "static", "control"])
def test_exported_prefill_and_decode_write_only_their_own_slot(case, cb_pair, static_pair, tmp_path):
    """The zero-copy hand-off is race-free only if a run writes nothing outside its own
    slot, with the cache bound as both input and output of the ONNX Runtime session."""
    script = tmp_path / "slot_guard.py"
    script.write_text(SLOT_GUARD)
    directory = static_pair if case == "static" else cb_pair
    run = subprocess.run(
        [sys.executable, str(script), str(directory), case], capture_output=True, text=True, timeout=300
    )
    if case == "control":  # the guard catches a write into the other slot
        assert run.returncode == -signal.SIGSEGV, (run.returncode, run.stderr[-2000:])
        return
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got == eager_tokens(llama(2), [list(range(3, 40)), list(range(50, 61))], [4, 4])


def test_cli_serves_an_export_directory(cb_pair, tmp_path, capsys):
    from qaic_dynamo.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3 4\n5 6\n" + " ".join(["7"] * 30) + "\n")
    rc = main(["serve-disagg", "--export-dir", str(cb_pair), "--prompts", str(prompts), "--max-tokens", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "ONNX Runtime" in out and "continuous batching, 4 slots" in out
    assert "summary: 3 requests, 0 failed" in out and "KV bytes moved per hand-off 0" in out
    assert main(["serve-disagg", "--export-dir", str(cb_pair), "--prompts", str(prompts), "--layers", "2"]) == 2
    assert "--layers describe a model to compile" in capsys.readouterr().err
    assert main(["serve-disagg", "--export-dir", str(tmp_path), "--prompts", str(prompts)]) == 2
    assert "holds no export" in capsys.readouterr().err


def test_cli_names_why_a_worker_could_not_start(cb_pair, tmp_path, capsys):
    import shutil

    from qaic_dynamo.cli import main

    broken = tmp_path / "pair"
    shutil.copytree(cb_pair, broken)
    (broken / "model.onnx.data").unlink()  # the graph reads fine; the weights are gone
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n")
    assert main(["serve-disagg", "--export-dir", str(broken), "--prompts", str(prompts)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "worker failed" in err and "ONNX Runtime cannot load" in err, err
