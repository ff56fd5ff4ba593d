"""Disaggregated prefill/decode (issue 12): the slicing spec, sessions, the zero-copy
hand-off, the three transports, and the failure behaviour."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch

from qaic_dynamo import LLM
from qaic_dynamo.deploy.serving import (
    DisaggregatedServer,
    KVSliceError,
    KVSliceSpec,
    Session,
    SharedKVBuffers,
    kv_buffer_names,
)
from qaic_dynamo.deploy.serving.shm import SHM_PREFIX
from qaic_dynamo.errors import SamplingParamsError
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM, QaicMLAConfig, QaicMLAForCausalLM

CTX = 256


def llama(layers: int = 2) -> QaicLlamaForCausalLM:
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


def workload(n: int = 16, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompt lengths from 1 to 200; some requests stop after one or two tokens."""
    rng = random.Random(seed)
    lengths = [1, 200] + [rng.randint(1, 200) for _ in range(n - 2)]
    prompts = [[rng.randrange(256) for _ in range(k)] for k in lengths]
    max_tokens = [rng.choice([1, 2, 5, 8, 8]) for _ in range(n)]
    return prompts, max_tokens


def eager_tokens(model, prompts, max_tokens, stop=()):
    llm = LLM(model, backend="eager", max_num_seqs=1, max_model_len=CTX)
    out = []
    for p, n in zip(prompts, max_tokens):
        toks = llm.generate([p], n)[0]
        for i, t in enumerate(toks):
            if t in stop:
                toks = toks[: i + 1]
                break
        out.append(toks)
    return out


def shm_segments() -> set[str]:
    """The shared-memory segments this process created (a server names its segments after
    its pid; other test workers running at the same time have segments of their own)."""
    return {p.name for p in Path("/dev/shm").glob(f"{SHM_PREFIX}{os.getpid()}_*")}


# --- the slicing spec ------------------------------------------------------------------------


def test_buffer_names_follow_the_export_naming():
    model = llama(2)
    assert kv_buffer_names(model) == [["past_key.0", "past_value.0"], ["past_key.1", "past_value.1"]]
    assert kv_buffer_names(model, "vllm")[1] == ["past_key.1_vllm", "past_value.1_vllm"]
    torch.manual_seed(0)
    assert kv_buffer_names(QaicMLAForCausalLM(QaicMLAConfig(num_hidden_layers=1)))[0] == ["compressed_kv.0", "k_pe.0"]
    assert KVSliceSpec.for_model(model, "vllm").patterns == ("past_key.*_vllm", "past_value.*_vllm")


def test_slice_spec_selects_validates_and_views_without_copies():
    bufs = {
        "past_key.0": torch.zeros(4, 2, 16, 8),
        "past_value.0": torch.zeros(4, 2, 16, 8),
        "vision_embeds": torch.zeros(4, 8),
    }
    spec = KVSliceSpec()
    assert spec.select(bufs) == ["past_key.0", "past_value.0"]  # never the vision buffer
    views = spec.views(bufs, {"batch_index": 2, "ctx_start": 5})
    v = views["past_key.0"]
    assert v.shape == (1, 2, 11, 8) and v.data_ptr() == bufs["past_key.0"][2, 0, 5].data_ptr()
    v.fill_(1.0)
    assert bufs["past_key.0"][2, :, 5:].eq(1).all() and bufs["past_key.0"].sum() == 2 * 11 * 8
    with pytest.raises(KVSliceError, match=r"pattern 'past_key\.\*_vllm' matches no buffer"):
        KVSliceSpec(("past_key.*_vllm",)).select(bufs)
    with pytest.raises(KVSliceError, match="slicing dim ctx_start=5 is out of range for past_key.0 of rank 4"):
        KVSliceSpec(dims=(("ctx_start", 5),)).select(bufs)
    with pytest.raises(KVSliceError, match=r"batch_index=4 is out of range for past_key.0 \(dim 0 has 4\)"):
        spec.views(bufs, {"batch_index": 4})
    with pytest.raises(KVSliceError, match=r"unknown slicing index \['head'\]"):
        spec.views(bufs, {"head": 0})


def test_session_roles_have_their_execution_slots():
    model = llama(2)
    assert len(Session(model, "prefill", num_slots=4, ctx_len=CTX, stages=3, backend="eager").execution_slots) == 4
    assert len(Session(model, "decode", num_slots=4, ctx_len=CTX, backend="eager").execution_slots) == 1
    with pytest.raises(ValueError, match="role must be 'prefill' or 'decode'"):
        Session(model, "encode", num_slots=4, ctx_len=CTX)


def test_bad_server_arguments_are_refused_before_any_worker_starts():
    model = llama(2)
    with pytest.raises(ValueError, match=r"transport must be one of \['shm', 'copy', 'gloo'\], got 'tcp'"):
        DisaggregatedServer(model, transport="tcp")
    with pytest.raises(
        ValueError, match="gloo_init_method is the gloo transport's rendezvous, but the transport is 'shm'"
    ):
        DisaggregatedServer(model, transport="shm", gloo_init_method="tcp://127.0.0.1:29500")
    with pytest.raises(ValueError, match="decode_slots must be a positive int, got 0"):
        DisaggregatedServer(model, decode_slots=0)
    # Both killed the workers before they could report, and start() waited out its timeout.
    with pytest.raises(ValueError, match="threads_per_worker must be a positive int, got 0"):
        DisaggregatedServer(model, threads_per_worker=0)
    with pytest.raises(ValueError, match=r"backend must be one of \['qaic', 'eager', 'inductor'\], got 'onnx'"):
        DisaggregatedServer(model, backend="onnx")


def test_prefill_writes_straight_into_the_decode_slot():
    """set_data_with_slices binds the shared buffers themselves: the prefill run writes
    slot 2 of them (same memory), no other slot changes, and nothing is copied."""
    model = llama(2)
    session = Session(model, "prefill", num_slots=4, ctx_len=CTX, backend="eager")
    shared = SharedKVBuffers(session.buffer_shapes, torch.float32)
    try:
        views = session.set_data_with_slices(shared.tensors, {"batch_index": 2, "ctx_start": 0})
        assert all(session.buffers[n].data_ptr() == shared.tensors[n].data_ptr() for n in shared.tensors)
        assert views["past_key.0"].data_ptr() == shared.tensors["past_key.0"][2].data_ptr()
        prompt = list(range(1, 40))
        session.execution_slots[0].request = type("Job", (), {"request_id": 0, "prompt": prompt})()
        done = []
        while not done:
            done = session.run_prefill_chunks(chunk_size=16)  # three chunks: 16 + 16 + 7 tokens
        ref = LLM(model, backend="eager", max_model_len=CTX).generate([prompt], 1)[0][0]
        assert done[0][1] == ref
        for name, t in shared.tensors.items():
            assert t[2, :, : len(prompt)].abs().sum() > 0 and t[2, :, len(prompt) :].eq(0).all(), name
            assert t[[0, 1, 3]].eq(0).all(), name
    finally:
        shared.close()
        shared.unlink()
    assert not shm_segments() & set(shared.segment_names)


def test_only_the_creator_registers_a_segment_and_the_one_unlink_that_succeeds_unregisters_it(monkeypatch):
    # Python's resource tracker keeps a set of names. A worker that registered on attach
    # could land its REGISTER after the server's UNREGISTER, and the tracker then reported
    # the (gone) segments as leaked at shutdown - the CLI's stop printed that warning now
    # and then. Attaching must not talk to the tracker; each segment is unregistered once.
    calls = []
    monkeypatch.setattr(resource_tracker, "register", lambda name, rtype: calls.append(("REGISTER", name, rtype)))
    monkeypatch.setattr(resource_tracker, "unregister", lambda name, rtype: calls.append(("UNREGISTER", name, rtype)))
    owner = SharedKVBuffers({"past_key.0": (2, 3), "past_value.0": (2, 3)}, torch.float32)
    names = [f"/{n}" for n in owner.segment_names]
    descriptor = owner.descriptor
    attached = SharedKVBuffers.attach(descriptor)
    attached.tensors["past_key.0"][1] = 5.0
    assert owner.tensors["past_key.0"][1].eq(5.0).all()  # the same memory
    assert calls == [("REGISTER", n, "shared_memory") for n in names]
    attached.close()
    attached.unlink()  # not the owner: unlinks nothing
    assert shm_segments() >= set(owner.segment_names)
    SharedKVBuffers.unlink_names(descriptor)  # a worker whose server died
    owner.unlink()  # the server after it: already gone, nothing more to unregister
    SharedKVBuffers.unlink_names(descriptor)
    owner.close()
    assert calls[len(names) :] == [("UNREGISTER", n, "shared_memory") for n in names]
    assert not shm_segments() & set(owner.segment_names)
    with pytest.raises(FileNotFoundError):
        SharedKVBuffers.attach(descriptor)


def test_an_interrupt_while_stopping_still_ends_the_workers_and_frees_the_memory(monkeypatch):
    # The CLI turns SIGTERM / SIGINT into KeyboardInterrupt. One that landed while stop()
    # waited for a worker (the requests had just finished) cut stop() short: the segments
    # were never unlinked, and Python's resource tracker reported them leaked at exit.
    server = DisaggregatedServer(llama(2), decode_slots=2, ctx_len=CTX, backend="eager")
    server.start()
    segments = set(server.buffers.segment_names)
    workers = [server.prefill_pid, server._decode.pid]
    waits = []

    def interrupted(join):
        def interrupted_join(timeout=None):
            waits.append(timeout)
            if len(waits) == 1:
                raise KeyboardInterrupt  # Ctrl-C while stop() waits for a worker
            return join(timeout)

        return interrupted_join

    for worker in (server._prefill, server._decode):
        monkeypatch.setattr(worker, "join", interrupted(worker.join))
    with pytest.raises(KeyboardInterrupt):  # raised once the cleanup is done
        server.stop()
    assert not shm_segments() & segments
    deadline = time.monotonic() + 10
    while any(
        Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2] for pid in workers
    ):
        assert time.monotonic() < deadline, "a worker outlived stop()"
        time.sleep(0.05)
    server.stop()  # idempotent


def test_a_prefill_session_is_told_its_slot():
    # Without batch_index a prefill session wrote decode slot 0 - the KV of whatever request
    # decoded there; a negative execution_slot was taken as Python's index from the end.
    session = Session(llama(2), "prefill", num_slots=2, ctx_len=CTX, backend="eager")
    shared = SharedKVBuffers(session.buffer_shapes, torch.float32)
    try:
        with pytest.raises(KVSliceError, match=r"a prefill session writes the slot slices\['batch_index'\]"):
            session.set_data_with_slices(shared.tensors, {"ctx_start": 0})
        for slot in (-1, 99, True):
            with pytest.raises(KVSliceError, match=rf"execution_slot must be an int in \[0, \d+\) .*got {slot!r}"):
                session.set_data_with_slices(shared.tensors, {"batch_index": 0}, slot)
        session.set_data_with_slices(shared.tensors, {"batch_index": 1, "ctx_start": 0})  # and the right call binds
        assert session.execution_slots[0].binding == (1, 0)
    finally:
        shared.close()
        shared.unlink()


# Prefill and decode in one process over page-protected buffers: before each request the
# other slot's pages are made read-only (mprotect), as that slot belongs to another
# process's run. Any write there, whole-buffer or stray, kills the process with SIGSEGV.
#: The body both slot guards share: given ``prefill``, ``decode_step(req)``, ``shapes`` (the
#: buffers' names and shapes) and ``chunk``, it serves a request in each of two slots
#: while the other slot is read-only, and prints their tokens.
SLOT_GUARD_BODY = """
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
maps, bufs = [], {}
for name, shape in shapes.items():
    maps.append(mmap.mmap(-1, torch.Size(shape).numel() * 4))
    bufs[name] = torch.frombuffer(maps[-1], dtype=torch.float32).view(shape)
first = next(iter(bufs))
slot_bytes = bufs[first][0].numel() * 4
assert slot_bytes % mmap.PAGESIZE == 0, slot_bytes

def read_only(slot, yes):
    for t in bufs.values():
        assert libc.mprotect(t[slot].data_ptr(), slot_bytes, 1 if yes else 3) == 0, ctypes.get_errno()

decode.set_data_with_slices(bufs, {})
out = []
for slot, prompt in ((0, list(range(3, 40))), (1, list(range(50, 61)))):
    read_only(1 - slot, True)
    prefill.set_data_with_slices(bufs, {"batch_index": slot, "ctx_start": 0})
    prefill.execution_slots[0].request = type("Job", (), {"request_id": slot, "prompt": prompt})()
    done = []
    while not done:
        done = prefill.run_prefill_chunks(chunk_size=chunk)
    prefill.execution_slots[0].request = None
    req = Request(slot, prompt, 4, output_token_ids=[done[0][1]], block_ids=[slot], num_computed_tokens=len(prompt))
    for _ in range(3):
        req.num_computed_tokens = req.num_tokens - 1
        req.output_token_ids.append(int(decode.decode([req])[0].argmax()))
    if control:
        bufs[first][1 - slot].fill_(1.0)
    read_only(1 - slot, False)
    out.append(req.output_token_ids)
print(json.dumps(out))
"""

SLOT_GUARD = (
    """
import ctypes, json, mmap, sys
import torch
from qaic_dynamo.engine import Request
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM
from qaic_dynamo.deploy.serving import Session

torch.manual_seed(0)
model = QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256)).eval()
backend, control = sys.argv[1], sys.argv[2] == "control"
prefill = Session(model, "prefill", num_slots=2, ctx_len=256, backend=backend)
decode = Session(model, "decode", num_slots=2, ctx_len=256, backend=backend)
shapes, chunk = prefill.buffer_shapes, 16
"""
    + SLOT_GUARD_BODY
)


@pytest.mark.parametrize("backend", ["qaic", "control"])
def test_prefill_and_decode_write_only_their_own_slot(backend, tmp_path):
    """The zero-copy hand-off is race-free only if a run writes nothing outside its own
    slot: no whole-buffer rewrite of the retained state (ONNX Runtime's ScatterND with the
    cache bound as both input and output) and no stray write from padding."""
    script = tmp_path / "slot_guard.py"
    script.write_text(SLOT_GUARD)
    run = subprocess.run(
        [sys.executable, str(script), "eager" if backend == "control" else backend, backend],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if backend == "control":  # the guard catches a write into the other slot
        assert run.returncode == -signal.SIGSEGV, (run.returncode, run.stderr[-2000:])
        return
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got == eager_tokens(llama(2), [list(range(3, 40)), list(range(50, 61))], [4, 4])


# --- the server ---------------------------------------------------------------------------------


def test_disaggregated_tokens_equal_eager_with_a_zero_copy_hand_off():
    model = llama(2)
    prompts, max_tokens = workload(16)
    # A stop token that occurs: the third token of the first request that may run for 5.
    free = eager_tokens(model, prompts, max_tokens)
    stop = (next(t for t, n in zip(free, max_tokens) if n >= 5)[2],)
    before = shm_segments()
    with DisaggregatedServer(model, decode_slots=4, ctx_len=CTX, chunk_size=64, backend="qaic") as server:
        segments = set(server.buffers.segment_names)
        assert segments <= shm_segments()
        results = server.generate(prompts, max_tokens, stop_token_ids=stop)
    assert shm_segments() == before and not segments & shm_segments()  # every segment unlinked
    want = eager_tokens(model, prompts, max_tokens, stop)
    assert [r.error for r in results] == [None] * 16
    assert [r.token_ids for r in results] == want
    assert all(r.kv_bytes_moved == 0 for r in results)  # slicing: nothing copied at the hand-off
    assert all(r.ttft is not None and r.ttft > 0 for r in results)
    assert any(len(t) < n for t, n in zip(want, max_tokens)), "no request stopped on the stop token"


@pytest.mark.parametrize("transport", ["copy", "gloo"])
def test_copying_and_gloo_transports_give_the_same_tokens_and_count_bytes(transport):
    model = llama(2)
    prompts, max_tokens = workload(6, seed=1)
    with DisaggregatedServer(model, decode_slots=2, ctx_len=CTX, transport=transport, backend="eager") as server:
        results = server.generate(prompts, max_tokens)
    assert [r.token_ids for r in results] == eager_tokens(model, prompts, max_tokens)
    slot_bytes = 2 * 2 * 2 * CTX * 16 * 4  # layers x (key, value) x kv heads x ctx_len x head_dim x fp32
    assert all(r.kv_bytes_moved == slot_bytes for r in results)


def generate_killing_prefill(server, prompts, max_tokens, after: float = 0.3):
    """``server.generate``, with the prefill worker SIGKILLed ``after`` seconds once two
    requests have their first token (prompt 2, the long one, is then mid-prefill)."""

    def killer():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sum(r.ttft is not None for r in server.results.values()) >= 2:
                time.sleep(after)
                os.kill(server.prefill_pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    t = threading.Thread(target=killer)
    t.start()
    results = server.generate(prompts, max_tokens)
    t.join()
    return results


def assert_only_the_prefilling_request_failed(model, results, prompts, max_tokens):
    assert results[2].error is not None and "prefill worker died (exit code -9)" in results[2].error
    want = eager_tokens(model, prompts, max_tokens)
    for i in (0, 1, 3, 4):  # the decoding ones kept going; the queued ones went to the new worker
        assert results[i].error is None and results[i].token_ids == want[i], i


def test_killing_the_prefill_worker_fails_its_request_and_decode_serves_the_rest():
    model = llama(2)
    # Two short requests decode for long; the 180-token prompt takes 23 chunks of 8, 50 ms each.
    prompts = [[7] * 5, [8] * 6, [9] * 180, [10] * 4, [11] * 3]
    max_tokens = [40, 40, 4, 4, 4]
    with DisaggregatedServer(
        model, decode_slots=4, ctx_len=CTX, chunk_size=8, backend="eager", chunk_delay=0.05
    ) as server:
        results = generate_killing_prefill(server, prompts, max_tokens)
        assert server.restarts == 1
    assert_only_the_prefilling_request_failed(model, results, prompts, max_tokens)


def test_an_exception_inside_the_server_still_unlinks_shared_memory():
    before = shm_segments()
    with pytest.raises(RuntimeError, match="boom"):
        with DisaggregatedServer(llama(2), decode_slots=2, ctx_len=64, backend="eager") as server:
            assert set(server.buffers.segment_names) <= shm_segments()
            raise RuntimeError("boom")
    assert shm_segments() == before


def test_a_request_that_does_not_fit_is_rejected_before_any_write():
    with DisaggregatedServer(llama(2), decode_slots=2, ctx_len=64, backend="eager") as server:
        with pytest.raises(
            ValueError, match=r"prompt \(60 tokens\) \+ max_tokens=8 would not fit in a slot's ctx_len=64"
        ):
            server.generate([[1, 2, 3], [5] * 60], 8)
        assert all(t.eq(0).all() for t in server.buffers.tensors.values())  # not even the valid one ran
        assert server.results == {}
        with pytest.raises(ValueError, match="outside the vocabulary"):
            server.generate([[999]], 2)
        with pytest.raises(TypeError, match=r"token ids that are not integers: \[True\]"):
            server.generate([[True, 5]], 2)  # not served as token 1
        with pytest.raises(ValueError, match="max_tokens must be a positive int, got True"):
            server.generate([[1, 2]], True)  # was served as 1 token
        with pytest.raises(SamplingParamsError, match="stop_token_ids must be"):
            server.generate([[1, 2]], 2, stop_token_ids=[1.5])
        assert server.results == {}  # nothing registered by a refused call
        # A tensor or array prompt (as LLM.generate takes), numpy counts, no stop ids: served
        import numpy as np

        got = server.generate([torch.tensor([1, 2, 3]), np.array([4, 5])], np.int64(2), stop_token_ids=None)
        assert [r.token_ids for r in got] == eager_tokens(server.model, [[1, 2, 3], [4, 5]], [2, 2])


def test_a_generate_that_raises_leaves_the_server_refusing_until_restarted():
    """A generate() that ended by an exception (its timeout, a raising progress callback,
    Ctrl-C) left its requests in the workers: the next call saw their events (KeyError)
    and would have handed their decode slots to new prompts."""
    model = llama(1)
    with DisaggregatedServer(
        model, decode_slots=2, ctx_len=96, chunk_size=4, backend="eager", chunk_delay=0.1
    ) as server:
        with pytest.raises(TimeoutError, match="not finished after 0 s"):
            server.generate([[5] * 40, [6] * 40], 40, timeout=0.3)
        with pytest.raises(
            RuntimeError,
            match=r"an earlier generate\(\) ended \(TimeoutError\) with 2 request\(s\) "
            r"still in the workers; stop\(\) and start\(\) the server again",
        ):
            server.generate([[7] * 3], 2)
        with pytest.raises(RuntimeError, match="already started; stop"):
            server.start()  # leaked the first workers and their shared memory
        server.stop()
        server.start()
        got = server.generate([[7] * 3, [8] * 5], 3)
    assert [r.token_ids for r in got] == eager_tokens(model, [[7] * 3, [8] * 5], [3, 3])


def test_a_worker_that_dies_before_it_reports_fails_the_start_at_once():
    """A worker killed during start-up posts nothing: start() waited its whole timeout
    (600 s by default), then said "no start"."""
    server = DisaggregatedServer(llama(1), decode_slots=2, ctx_len=64, backend="eager", startup_timeout=300)

    def killer():
        while server._decode is None or server._decode.pid is None:
            time.sleep(0.01)
        os.kill(server._decode.pid, signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()
    with pytest.raises(RuntimeError, match=r"the decode worker exited \(exit code -9\) while waiting for its start"):
        server.start()
    assert server.buffers is None  # stopped: shared memory unlinked


@pytest.mark.parametrize("queue_name", ["events", "hand-offs"])
def test_a_prefill_worker_killed_while_writing_to_a_queue_is_replaced_and_serves(queue_name):
    """A process killed inside Queue.put keeps that queue's write lock for good; holding
    the lock stands in for that kill. Events: both workers wrote one events queue, so
    decode could never post the "synced" the server waits for after a prefill death (a
    fresh-clone CI run hung 600 s in the gloo test below); each queue now has one writing
    process. Hand-offs: the replacement worker inherited the dead one's queue and its
    hand-offs never reached decode (TimeoutError); each worker now has a queue of its own."""
    model = llama(1)
    with DisaggregatedServer(model, decode_slots=2, ctx_len=64, backend="eager", startup_timeout=120) as server:
        locked = server._prefill_events if queue_name == "events" else server._handoff_queues[0]
        locked._wlock.acquire()  # multiprocessing.Queue's cross-process write lock
        os.kill(server.prefill_pid, signal.SIGKILL)
        time.sleep(0.5)
        first = server.generate([[4, 5]], 2, timeout=60)[0]
        assert first.error is None or "prefill worker died (exit code -9)" in first.error
        assert server.restarts == 1
        assert [r.token_ids for r in server.generate([[6, 7]], 2, timeout=60)] == eager_tokens(model, [[6, 7]], [2])


def test_past_max_prefill_restarts_requests_fail_until_the_server_restarts():
    model = llama(1)
    with pytest.raises(ValueError, match=r"max_prefill_restarts must be an int in \[0, 64\], got -1"):
        DisaggregatedServer(model, max_prefill_restarts=-1)
    with pytest.raises(ValueError, match=r"max_prefill_restarts must be an int in \[0, 64\], got 1000"):
        DisaggregatedServer(model, max_prefill_restarts=1000)
    with DisaggregatedServer(
        model, decode_slots=2, ctx_len=64, backend="eager", startup_timeout=120, max_prefill_restarts=0
    ) as server:
        os.kill(server.prefill_pid, signal.SIGKILL)
        time.sleep(0.5)
        # Sent to the dead worker before its death was seen, or failed for want of a worker:
        assert "the prefill worker died (exit code -9)" in server.generate([[4, 5]], 2, timeout=60)[0].error
        with pytest.raises(
            RuntimeError,
            match=r"after 0 restart\(s\), the most this server makes "
            r"\(max_prefill_restarts=0\); stop\(\) and start\(\) the server again",
        ):
            server.generate([[6, 7]], 2)
        server.stop()
        server.start()
        assert [r.token_ids for r in server.generate([[6, 7]], 2, timeout=60)] == eager_tokens(model, [[6, 7]], [2])


def test_after_the_gloo_prefill_worker_died_generate_fails_at_once():
    with DisaggregatedServer(llama(1), decode_slots=2, ctx_len=64, transport="gloo", backend="eager") as server:
        os.kill(server.prefill_pid, signal.SIGKILL)
        time.sleep(0.5)
        assert "the prefill worker died (exit code -9)" in server.generate([[4, 5]], 2, timeout=60)[0].error
        with pytest.raises(
            RuntimeError,
            match=r"prefill worker died \(exit code -9\) and the gloo transport cannot "
            r"replace it; stop\(\) and start\(\)",
        ):
            server.generate([[6, 7]], 2, timeout=60)  # spun until its timeout


def test_a_gloo_hand_off_cut_by_the_prefill_workers_death_fails_only_that_request():
    """The prefill worker posts a gloo hand-off before sending its KV (decode must be
    receiving for the send to finish). Killed in between, its request fails; decode keeps
    serving the running one (it died with "Connection closed by peer" before)."""
    model = llama(2)
    ctx = 1 << 16  # a 16 MB slot: more than loopback's socket buffers, so the send blocks
    running, handed_off = [5, 6, 7], list(range(1, 41))
    with DisaggregatedServer(
        model, decode_slots=2, ctx_len=ctx, chunk_size=8, transport="gloo", backend="eager", chunk_delay=0.05
    ) as server:
        handoffs, failures = server._handoff_queues[0], []

        def killer():
            try:
                deadline = time.monotonic() + 60
                while not any(r.ttft is not None for r in server.results.values()):  # `running` is decoding
                    assert time.monotonic() < deadline, "the first request was never admitted"
                    time.sleep(0.005)
                os.kill(server._decode.pid, signal.SIGSTOP)  # decode busy: it takes nothing off the queue
                try:
                    # The hand-off in the queue's pipe (not only put(): a worker killed before
                    # its feeder thread wrote it loses it, and then "prefill worker died" is
                    # right): the worker is in its send, or about to be.
                    assert handoffs._reader.poll(60), "the second request was never handed off"
                    os.kill(server.prefill_pid, signal.SIGKILL)
                    time.sleep(0.2)
                finally:
                    os.kill(server._decode.pid, signal.SIGCONT)
            except BaseException as e:
                failures.append(e)

        t = threading.Thread(target=killer)
        t.start()
        results = server.generate([running, handed_off], [40, 4], timeout=120)
        t.join()
        assert not failures, failures
    assert results[1].error is not None and "the KV hand-off of request" in results[1].error, results[1].error
    assert results[1].token_ids == []
    assert results[0].error is None and results[0].token_ids == eager_tokens(model, [running], [40])[0]


def test_summary_of_a_run_where_every_request_failed():
    from qaic_dynamo.deploy.serving import RequestResult, summarize

    failed = [RequestResult(i, [1, 2], submitted=0.0, error="the prefill worker died") for i in range(3)]
    s = summarize(failed)  # was {}, and the CLI's summary line raised KeyError
    assert (s["requests"], s["failed"], s["ttft_median_s"], s["decode_tokens_per_s"]) == (3, 3, None, None)


def test_cli_serves_a_prompt_file(tmp_path, capsys):
    from qaic_dynamo.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3 4\n\n5 6\n" + " ".join(["7"] * 30) + "\n")
    rc = main(
        [
            "serve-disagg",
            "--model",
            "llama",
            "--layers",
            "2",
            "--hidden-size",
            "64",
            "--prompts",
            str(prompts),
            "--max-tokens",
            "3",
            "--decode-slots",
            "2",
            "--ctx-len",
            "64",
            "--backend",
            "eager",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("TTFT") >= 3 and "summary: 3 requests, 0 failed" in out and "KV bytes moved per hand-off 0" in out
    bad = tmp_path / "bad.txt"
    bad.write_text("1 two 3\n")
    assert main(["serve-disagg", "--prompts", str(bad)]) == 2
    assert "whitespace-separated token ids" in capsys.readouterr().err


def test_cli_names_why_the_server_could_not_start(tmp_path, capsys):
    # A context past the model's positions is refused inside the workers; the CLI printed
    # the parent's traceback around the worker's.
    from transformers import LlamaConfig

    from qaic_dynamo.cli import main
    from qaic_dynamo.models import hf_model_from_config

    hf_model_from_config(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
    ).save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n")
    rc = main(
        [
            "serve-disagg",
            "--model",
            str(tmp_path / "model"),
            "--prompts",
            str(prompts),
            "--ctx-len",
            "64",
            "--backend",
            "eager",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    # Checked in the server before any worker starts (issue 38; a worker used to find it).
    assert "ctx_len=64 exceeds the model's max_position_embeddings=32" in err and "worker" not in err, err


@pytest.mark.parametrize("kind", ["prefixed-llama", "mla"])
def test_prefixed_buffers_and_mla_caches_serve_the_same_tokens(kind):
    if kind == "mla":
        torch.manual_seed(0)
        model, prefix, stem = QaicMLAForCausalLM(QaicMLAConfig(num_hidden_layers=2)).eval(), None, "compressed_kv.0"
    else:
        model, prefix, stem = llama(2), "vllm", "past_key.0_vllm"
    prompts, max_tokens = workload(5, seed=2)
    with DisaggregatedServer(model, decode_slots=2, ctx_len=CTX, backend="eager", kv_cache_prefix=prefix) as server:
        assert stem in server.buffers.tensors
        results = server.generate(prompts, max_tokens)
    assert [r.token_ids for r in results] == eager_tokens(model, prompts, max_tokens)
