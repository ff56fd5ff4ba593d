"""The prefill and decode worker processes of a disaggregated server.

A worker never outlives the server that spawned it: a thread waits on the parent's
sentinel, and when the parent dies (killed, or stopped without cleaning up) the worker
unlinks every shared-memory segment and exits at once, so nothing is left running or
mapped. Workers ignore SIGINT: a Ctrl-C reaches the whole process group, and the server
(the parent) stops them itself.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from qaic_dynamo.deploy.serving.exported import make_session
from qaic_dynamo.deploy.serving.shm import SharedKVBuffers
from qaic_dynamo.deploy.serving.transports import make_transport
from qaic_dynamo.engine import Request

__all__ = ["Job", "decode_worker", "prefill_worker"]


@dataclass
class Job:
    request_id: int
    prompt: list[int]
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    decode_slot: int


def watch_parent(descriptor: dict, say: bool = False) -> None:
    """Exit this worker as soon as its parent dies, unlinking the shared memory first (the
    parent cannot any more). Also ignore SIGINT (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = mp.parent_process()
    if parent is None:  # run in-process (tests): nothing to watch
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        try:
            SharedKVBuffers.unlink_names(descriptor)
            if say:  # one worker says it, once
                print(
                    f"qaic-dynamo: the server process (pid {parent.pid}) is gone; its workers exit and its shared "
                    "memory is released",
                    flush=True,
                )
        finally:  # whatever failed above (a closed pipe, a permission), never outlive the parent
            os._exit(1)

    threading.Thread(target=wait, name="qaic-parent-watch", daemon=True).start()


def prefill_worker(model: Any, cfg: dict, descriptor: dict, jobs: Any, handoffs: Any, events: Any) -> None:
    decode = transport = None
    watch_parent(descriptor)
    try:  # everything inside: an error anywhere is posted, not left for the server to time out on
        torch.set_num_threads(cfg["threads"])
        decode = SharedKVBuffers.attach(descriptor) if cfg["transport"] != "gloo" else None
        session = make_session(model, "prefill", cfg)
        staging_slots = len(session.execution_slots)
        transport = make_transport(
            cfg["transport"], decode, session.buffer_shapes, session.dtype, 0, cfg.get("init_method"), staging_slots
        )
        events.put(("ready", "prefill", None))
        while True:
            free = [s for s in session.execution_slots if s.request is None]
            while free:
                try:
                    job = jobs.get(timeout=0.05) if len(free) == len(session.execution_slots) else jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    return
                s = free.pop(0)
                s.request = job
                session.set_data_with_slices(
                    transport.prefill_buffers(),
                    {"batch_index": transport.prefill_target(job.decode_slot, s.index), "ctx_start": 0},
                    s.index,
                )
            for s, first in session.run_prefill_chunks(cfg["chunk_size"]):
                job, t_first = s.request, time.perf_counter()
                if transport.receiver_waits:  # gloo: decode must be told before it can receive
                    handoffs.put(("job", job, first, t_first, transport.slot_bytes()))
                    transport.send(s.index, job.decode_slot, job.request_id)
                else:  # the KV is in the decode slot before decode hears of it
                    moved = transport.send(s.index, job.decode_slot, job.request_id)
                    handoffs.put(("job", job, first, t_first, moved))
                s.request, s.binding = None, None
            if cfg.get("chunk_delay"):
                time.sleep(cfg["chunk_delay"])
    except Exception:
        events.put(("worker_error", "prefill", traceback.format_exc()))
    finally:
        if transport is not None:
            transport.close()
        if decode is not None:
            decode.close()


def decode_worker(model: Any, cfg: dict, descriptor: dict, handoff_queues: list, control: Any, events: Any) -> None:
    decode = transport = None
    watch_parent(descriptor, say=True)
    try:  # everything inside: an error anywhere is posted, not left for the server to time out on
        torch.set_num_threads(cfg["threads"])
        decode = SharedKVBuffers.attach(descriptor)
        session = make_session(model, "decode", cfg)
        session.set_data_with_slices(decode.tensors, {})  # decode runs every slot of the shared buffers
        transport = make_transport(
            cfg["transport"], decode, session.buffer_shapes, session.dtype, 1, cfg.get("init_method"), 0
        )
        events.put(("ready", "decode", None))
        running: list[tuple[Request, Job]] = []
        handoffs = handoff_queues[0]  # the first prefill worker's; each replacement has its own

        def finish(req: Request, job: Job) -> None:
            events.put(("finished", job.request_id, (job.decode_slot, list(req.output_token_ids))))

        def admit(item: tuple) -> None:
            _, job, first, t_first, moved = item
            try:
                transport.receive(job.decode_slot, job.request_id)
            except Exception as e:
                # gloo: the prefill worker died with this hand-off posted and its KV not (all)
                # sent. Only this request is lost; the running ones need no transport. Its
                # slot holds a partial KV that nothing reads: the server frees it.
                events.put(("lost", job.request_id, (job.decode_slot, f"{type(e).__name__}: {e}".splitlines()[0])))
                return
            events.put(("admitted", job.request_id, (first, t_first, moved)))
            req = Request(
                job.request_id,
                job.prompt,
                job.max_tokens,
                output_token_ids=[first],
                block_ids=[job.decode_slot],
                num_computed_tokens=len(job.prompt),
            )
            if _finished(req, job):
                finish(req, job)
            else:
                running.append((req, job))

        while True:
            try:  # the server's messages: stop, or a sync after the prefill worker died
                message = control.get_nowait()
            except queue.Empty:
                message = False
            if message is None:
                return
            if message:
                # The prefill worker is dead, so nothing more is coming: admit everything it
                # handed off, then say so (the server fails only what was not handed off),
                # and read its replacement's queue from now on.
                while True:
                    try:
                        admit(handoffs.get_nowait())
                    except queue.Empty:
                        break
                _, marker, generation = message
                handoffs = handoff_queues[generation]
                events.put(("synced", marker, None))
            while True:  # admit every prefilled request that arrived
                try:
                    item = handoffs.get(timeout=0.05) if not running else handoffs.get_nowait()
                except queue.Empty:
                    break
                admit(item)
            if not running:
                continue
            logits = session.decode([r for r, _ in running])
            still = []
            for (req, job), row in zip(running, logits):
                req.num_computed_tokens = req.num_tokens
                req.output_token_ids.append(int(row.argmax()))
                if _finished(req, job):
                    finish(req, job)
                else:
                    still.append((req, job))
            running = still
    except Exception:
        events.put(("worker_error", "decode", traceback.format_exc()))
    finally:
        if transport is not None:
            transport.close()
        if decode is not None:
            decode.close()


def _finished(req: Any, job: Job) -> bool:
    return len(req.output_token_ids) >= job.max_tokens or req.output_token_ids[-1] in job.stop_token_ids
