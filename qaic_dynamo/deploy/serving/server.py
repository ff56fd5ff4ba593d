"""DisaggregatedServer: a prefill worker and a decode worker sharing KV.

Failures:

* a request that would not fit in ``ctx_len`` is rejected before any write, and sizes
  (``ctx_len`` past the model's positions, buffers larger than ``/dev/shm``) before any
  shared memory is made;
* if the prefill worker dies, the requests it held fail with an error naming it while
  decode keeps serving the running ones (with ``"shm"``/``"copy"`` a new prefill worker
  takes the queued requests);
* if the decode worker dies, ``generate`` returns every request that had finished with
  its tokens and fails the others with an error naming it; the server must be stopped
  and started again;
* stopping the server, cleanly or by an exception, unlinks every shared-memory segment;
  if the server's process dies without stopping it (SIGKILL), the workers notice at once,
  unlink the segments and exit;
* started from a script's top level without ``if __name__ == "__main__":`` (whose
  spawned workers would import the script and start servers of their own), ``start``
  raises an error saying so before any worker starts.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import os
import queue
import shutil
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from qaic_dynamo.deploy.serving.exported import ExportedModel
from qaic_dynamo.deploy.serving.kv_slices import kv_buffer_names
from qaic_dynamo.deploy.serving.launch import check_main_guard, children_ignore_sigint
from qaic_dynamo.deploy.serving.results import RequestResult
from qaic_dynamo.deploy.serving.shm import SharedKVBuffers
from qaic_dynamo.deploy.serving.transports import TRANSPORTS
from qaic_dynamo.deploy.serving.workers import Job, decode_worker, prefill_worker
from qaic_dynamo.engine import BACKENDS, SamplingParams, is_token_id
from qaic_dynamo.models import load_model

__all__ = ["MAX_PREFILL_RESTARTS", "DisaggregatedServer"]


def _free_local_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it; it could be taken again
    before it is bound, as with any such probe)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The most prefill restarts a server can be given (see ``max_prefill_restarts``).
MAX_PREFILL_RESTARTS = 64


class DisaggregatedServer:
    """A prefill worker and a decode worker sharing KV through ``transport``.

    ``decode_slots`` sequences decode together; more requests wait until a slot is free,
    then are prefilled into it while decode keeps stepping the others. Use as a context
    manager (or call :meth:`stop`): that always ends the workers and unlinks the shared
    memory. ``chunk_delay`` (seconds after each prefill chunk) slows prefill down for
    fault tests and demos. ``gloo_init_method`` (transport ``"gloo"``) is where the two
    workers meet, by default a port on 127.0.0.1 that is free at start-up. A prefill worker
    that dies is replaced up to ``max_prefill_restarts`` times (never with gloo, whose
    process group dies with it); after that, requests fail with an error until the
    server is restarted.
    """

    def __init__(
        self,
        model: Any,
        *,
        decode_slots: int | None = None,
        ctx_len: int | None = None,
        prefill_stages: int = 1,
        chunk_size: int | None = None,
        transport: str = "shm",
        backend: str = "qaic",
        kv_cache_prefix: str | None = None,
        threads_per_worker: int = 1,
        gloo_init_method: str | None = None,
        startup_timeout: float = 600,
        chunk_delay: float = 0.0,
        max_prefill_restarts: int = 3,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"DisaggregatedServer: transport must be one of {list(TRANSPORTS)}, got {transport!r}")
        self.exported = model if isinstance(model, ExportedModel) else None
        if self.exported is not None:
            # The export's specializations fix these: anything else would not be what the
            # card runs (or would not fit the artifact's KV).
            fixed = {
                "decode_slots": (decode_slots, self.exported.decode_slots),
                "ctx_len": (ctx_len, self.exported.ctx_len),
                "chunk_size": (chunk_size, self.exported.chunk_size),
                "kv_cache_prefix": (kv_cache_prefix, self.exported.kv_cache_prefix),
            }
            for name, (given, theirs) in fixed.items():
                if given is not None and given != theirs:
                    raise ValueError(
                        f"DisaggregatedServer: {name}={given!r}, but the export serves {name}={theirs!r} "
                        "(set by its options and specializations); drop the argument or export again"
                    )
            decode_slots, ctx_len, chunk_size = (theirs for _, theirs in list(fixed.values())[:3])
            kv_cache_prefix = self.exported.kv_cache_prefix
            backend = "onnxruntime"
        else:
            decode_slots = 4 if decode_slots is None else decode_slots
            ctx_len = 256 if ctx_len is None else ctx_len
            chunk_size = 64 if chunk_size is None else chunk_size
            if backend not in BACKENDS:
                raise ValueError(f"DisaggregatedServer: backend must be one of {list(BACKENDS)}, got {backend!r}")
        for name, v in (
            ("decode_slots", decode_slots),
            ("ctx_len", ctx_len),
            ("chunk_size", chunk_size),
            ("prefill_stages", prefill_stages),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DisaggregatedServer: {name} must be a positive int, got {v!r}")
        # Each restart's hand-off queue is made at start() and held open by the server and
        # decode (two file descriptors each), so the count is bounded.
        if (
            not isinstance(max_prefill_restarts, int)
            or isinstance(max_prefill_restarts, bool)
            or not 0 <= max_prefill_restarts <= MAX_PREFILL_RESTARTS
        ):
            raise ValueError(
                f"DisaggregatedServer: max_prefill_restarts must be an int in [0, {MAX_PREFILL_RESTARTS}], "
                f"got {max_prefill_restarts!r}"
            )

        if not isinstance(threads_per_worker, int) or isinstance(threads_per_worker, bool) or threads_per_worker < 1:
            raise ValueError(
                f"DisaggregatedServer: threads_per_worker must be a positive int, got {threads_per_worker!r}"
            )
        if gloo_init_method is not None and transport != "gloo":
            raise ValueError(
                f"DisaggregatedServer: gloo_init_method is the gloo transport's rendezvous, but the "
                f"transport is {transport!r}; pass transport='gloo' or drop gloo_init_method"
            )
        self.model = model
        self.transport = transport
        self.ctx_len = ctx_len
        #: The longest prompt a request may have (an export's longest prefill CCL may be
        #: shorter than ctx_len).
        self.max_prompt_len = self.exported.max_prompt_len if self.exported is not None else ctx_len
        if transport == "gloo" and gloo_init_method is None:
            gloo_init_method = f"tcp://127.0.0.1:{_free_local_port()}"
        self.cfg = dict(
            slots=decode_slots,
            ctx_len=ctx_len,
            stages=prefill_stages,
            chunk_size=chunk_size,
            transport=transport,
            backend=backend,
            kv_cache_prefix=kv_cache_prefix,
            threads=threads_per_worker,
            init_method=gloo_init_method,
            chunk_delay=chunk_delay,
        )
        self.startup_timeout = startup_timeout
        self.max_prefill_restarts = max_prefill_restarts
        self._no_prefill: str | None = None
        self._ctx = mp.get_context("spawn")
        self.buffers: SharedKVBuffers | None = None
        self._prefill = self._decode = None
        self._ids = itertools.count()
        self._syncs = itertools.count()
        self.results: dict[int, RequestResult] = {}  # the running generate() call's requests
        self.restarts = 0
        # Why the workers may still hold requests no generate() call tracks (a call that
        # ended by an exception): slots would then be reused under them. None: clean.
        self._unusable: str | None = None

    @classmethod
    def from_export(
        cls, prefill_dir: str | os.PathLike, decode_dir: str | os.PathLike | None = None, **options: Any
    ) -> DisaggregatedServer:
        """A server of exported artifacts on ONNX Runtime: the prefill-only and decode-only
        exports of ``export_prefill_decode`` (its pair directory, or the two directories),
        or one full export for both roles. ``decode_slots``, ``ctx_len``, ``chunk_size`` and
        ``kv_cache_prefix`` come from the export; the other options are the server's."""
        return cls(ExportedModel(prefill_dir, decode_dir), **options)

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> DisaggregatedServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        if self.buffers is not None:
            raise RuntimeError("DisaggregatedServer: already started; stop() it before starting it again")
        check_main_guard()
        self._unusable = None
        flat, dtype, self.vocab = self._layout()
        self._check_shared_memory(flat, dtype)
        try:
            self.buffers = SharedKVBuffers(flat, dtype)
            # One writing process per queue: a worker killed while writing holds that queue's
            # write lock for good, and then only its own queues are stuck - jobs and its
            # events queue are replaced with it; its hand-offs are drained after its death,
            # and its replacement writes the next of the hand-off queues. Those must exist
            # before decode starts (a queue reaches a process only when it is created).
            self._jobs = self._ctx.Queue()  # server -> prefill
            self._handoff_queues = [
                self._ctx.Queue() for _ in range(self.max_prefill_restarts + 1)
            ]  # prefill -> decode
            self._generation = 0  # which prefill worker, and which hand-off queue, is running
            self._no_prefill = None  # why the prefill worker could not be replaced
            self._control, self._events = self._ctx.Queue(), self._ctx.Queue()  # server -> decode -> server
            self._prefill_events = self._ctx.Queue()  # prefill -> server
            self._decode = self._ctx.Process(
                target=decode_worker,
                daemon=True,
                name="qaic-decode",
                args=(self.model, self.cfg, self.buffers.descriptor, self._handoff_queues, self._control, self._events),
            )
            with children_ignore_sigint():
                self._decode.start()
            self._start_prefill()
            self._wait_for(lambda kind, who, payload: kind == "ready", {"prefill", "decode"}, "start")
        except BaseException:
            self.stop()
            raise

    def _layout(self) -> tuple[dict[str, tuple[int, ...]], torch.dtype, int]:
        """The decode KV buffers (name -> shape), their dtype and the vocabulary size."""
        if self.exported is not None:
            return self.exported.buffer_shapes(self.cfg["slots"]), self.exported.dtype, self.exported.vocab
        from qaic_dynamo.models import max_positions, max_positions_text

        probe = load_model(self.model)
        positions = max_positions(probe)
        if positions is not None and self.ctx_len > positions:
            raise ValueError(
                f"DisaggregatedServer: ctx_len={self.ctx_len} exceeds the model's {max_positions_text(probe)}; "
                f"pass ctx_len <= {positions}"
            )
        shapes = probe.kv_cache_shapes(self.cfg["slots"], self.ctx_len)
        names = kv_buffer_names(probe, self.cfg["kv_cache_prefix"])
        flat = {n: s for layer, ns in zip(probe.kv_cache_layers, names) for n, s in zip(ns, shapes[layer])}
        return flat, next(probe.parameters()).dtype, probe.vocab_size

    def _check_shared_memory(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        """Refuse buffers that /dev/shm cannot hold, before any is made."""
        need = sum(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()
        try:
            free = shutil.disk_usage("/dev/shm").free
        except OSError:  # no /dev/shm to measure (another OS): the OS will say
            return
        if need > free:
            raise ValueError(
                f"DisaggregatedServer: the decode KV buffers need {need / 2**20:,.0f} MiB of shared memory "
                f"(ctx_len={self.ctx_len} x decode_slots={self.cfg['slots']} x {len(shapes)} buffers) but /dev/shm "
                f"has {free / 2**20:,.0f} MiB free; lower ctx_len or decode_slots"
            )

    def _start_prefill(self) -> None:
        self._prefill = self._ctx.Process(
            target=prefill_worker,
            daemon=True,
            name="qaic-prefill",
            args=(
                self.model,
                self.cfg,
                self.buffers.descriptor,
                self._jobs,
                self._handoff_queues[self._generation],
                self._prefill_events,
            ),
        )
        with children_ignore_sigint():
            self._prefill.start()

    def _wait_for(self, match: Any, keys: set, what: str, on_other: Any = None) -> None:
        """Consume events until ``match`` has been true for every key (the event's second
        field); other events go to ``on_other``."""
        deadline = time.monotonic() + self.startup_timeout
        while keys:
            try:
                kind, who, payload = self._next_event(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                # A worker killed (out of memory, a signal) or crashed before it could post
                # an event says nothing: look, rather than wait out the timeout.
                for name, proc in (("prefill", self._prefill), ("decode", self._decode)):
                    if proc is not None and proc.exitcode is not None:
                        raise RuntimeError(
                            f"DisaggregatedServer: the {name} worker exited (exit code {proc.exitcode}) "
                            f"while waiting for its {what}"
                        ) from None
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"DisaggregatedServer: no {what} from {sorted(keys)} in {self.startup_timeout:.0f} s"
                    ) from None
                continue
            if kind == "worker_error":
                raise RuntimeError(f"DisaggregatedServer: the {who} worker failed:\n{payload}")
            if match(kind, who, payload):
                keys.discard(who)
            elif on_other is not None:
                on_other(kind, who, payload)

    def _next_event(self, timeout: float) -> tuple[str, Any, Any]:
        """The next event of either worker (the prefill worker's first); queue.Empty if
        none came within ``timeout``."""
        try:
            return self._prefill_events.get_nowait()
        except queue.Empty:
            return self._events.get(timeout=timeout)

    def stop(self) -> None:
        """End both workers and unlink the shared memory (idempotent).

        A KeyboardInterrupt (Ctrl-C, or the CLI's SIGTERM) that lands while stopping does
        not cut the cleanup short - that left the segments to Python's resource tracker,
        which reports them leaked: the workers still running are killed at once instead
        of waited for, the memory is unlinked, and the interrupt is raised after."""
        interrupted: KeyboardInterrupt | None = None
        patient = True
        while True:
            try:
                self._stop_once(patient)
                break
            except KeyboardInterrupt as e:
                interrupted, patient = e, False
        if interrupted is not None:
            raise interrupted

    def _stop_once(self, patient: bool) -> None:
        """One pass of :meth:`stop`; every step holds if run again. ``patient``: ask the
        workers to finish and wait for them before killing them."""
        if patient:
            for q in ("_jobs", "_control"):
                if hasattr(self, q):
                    try:
                        getattr(self, q).put(None)
                    except Exception:
                        pass
        for p in (self._prefill, self._decode):
            if p is not None and p.is_alive():
                if patient:
                    p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        self._prefill = self._decode = None
        if self.buffers is not None:
            self.buffers.close()
            self.buffers.unlink()
            self.buffers = None

    @property
    def prefill_pid(self) -> int | None:
        return self._prefill.pid if self._prefill is not None else None

    # -- serving --------------------------------------------------------------------------
    def validate(self, prompt: Sequence[int], max_tokens: int) -> None:
        """Reject, before anything is written, a request that cannot be served. A prompt
        is a sequence of token ids (a list, a 1-d tensor or array)."""
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise TypeError(
                f"DisaggregatedServer: a prompt must be a sequence of token ids, got {type(prompt).__name__}"
            )
        if len(prompt) == 0:
            raise ValueError("DisaggregatedServer: empty prompt")
        if not is_token_id(max_tokens) or max_tokens < 1:
            raise ValueError(f"DisaggregatedServer: max_tokens must be a positive int, got {max_tokens!r}")
        if len(prompt) > self.max_prompt_len:
            raise ValueError(
                f"DisaggregatedServer: prompt ({len(prompt)} tokens) is longer than the {self.max_prompt_len} "
                "positions the export's Prefill specializations hold (its longest prefill compute-context "
                "length); shorten it or export with longer comp_ctx_lengths_prefill"
            )
        if len(prompt) + max_tokens > self.ctx_len:
            raise ValueError(
                f"DisaggregatedServer: prompt ({len(prompt)} tokens) + max_tokens={max_tokens} would not fit "
                f"in a slot's ctx_len={self.ctx_len}; shorten it or start the server with a larger ctx_len"
            )
        not_ids = [t for t in prompt if not is_token_id(t)]
        if not_ids:
            raise TypeError(f"DisaggregatedServer: token ids that are not integers: {not_ids[:5]}")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(f"DisaggregatedServer: token ids outside the vocabulary [0, {self.vocab}): {bad[:5]}")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int | Sequence[int] = 16,
        stop_token_ids: Sequence[int] = (),
        progress: Any = None,
        timeout: float = 600,
    ) -> list[RequestResult]:
        """Serve ``prompts`` (greedy) and return one result per prompt, in order. Every
        request is validated before any is started. A request held by a prefill worker
        that died comes back with ``error`` set; the others are served."""
        if self.buffers is None:
            raise RuntimeError("DisaggregatedServer: not started (use it as a context manager or call start())")
        if self._unusable is not None:
            raise RuntimeError(f"DisaggregatedServer: {self._unusable}; stop() and start() the server again")
        if self._no_prefill is not None:  # _prefill_died could not replace it
            raise RuntimeError(f"DisaggregatedServer: {self._no_prefill}; stop() and start() the server again")
        # One count (an int, numpy's too) for every prompt, or one per prompt; anything else
        # (a bool) goes to validate, which names it.
        one = is_token_id(max_tokens) or not isinstance(max_tokens, Iterable)
        counts = [max_tokens] * len(prompts) if one else list(max_tokens)
        if len(counts) != len(prompts):
            raise ValueError("DisaggregatedServer: one max_tokens per prompt")
        for p, n in zip(prompts, counts):
            self.validate(p, n)
        stops = SamplingParams(stop_token_ids=stop_token_ids).stop_token_ids  # the engine's check and form
        waiting = []
        self.results = {}  # this call's requests only: results do not pile up across calls
        for p, n in zip(prompts, counts):
            rid = next(self._ids)
            ids = [int(t) for t in p]  # numpy or 0-d tensor ids become plain ints here
            self.results[rid] = RequestResult(rid, ids, submitted=time.perf_counter())
            waiting.append(Job(rid, ids, int(n), stops, -1))
        order = [j.request_id for j in waiting]
        free = list(range(self.cfg["slots"]))
        capacity = self.cfg["stages"] + 1  # prefill holds at most its execution slots
        at_prefill: dict[int, Job] = {}  # sent to prefill, not yet admitted by decode
        active: dict[int, Job] = {}  # admitted by decode
        deadline = time.monotonic() + timeout

        def on_event(kind: str, rid: Any, payload: Any) -> None:
            if kind == "admitted":
                first, t_first, moved = payload
                r = self.results[rid]
                r.ttft, r.kv_bytes_moved = t_first - r.submitted, moved
                active[rid] = at_prefill.pop(rid)
            elif kind == "lost":  # its KV never arrived (see decode_worker's admit)
                slot, reason = payload
                self.results[rid].error = (
                    f"the KV hand-off of request {rid} failed ({reason}); it was not served "
                    "(decode kept serving the running requests)"
                )
                at_prefill.pop(rid)
                free.append(slot)
            elif kind == "finished":
                slot, tokens = payload
                r = self.results[rid]
                r.token_ids, r.finished = tokens, time.perf_counter()
                active.pop(rid)
                free.append(slot)  # decode is done with it: the next prefill may overwrite it
                if progress is not None:
                    progress(r)

        try:
            self._serve(waiting, at_prefill, active, free, capacity, on_event, deadline, timeout)
        except BaseException as e:
            if at_prefill or active:
                # The workers still hold these requests and their slots; a later call
                # must not hand the slots out again.
                self._unusable = (
                    f"an earlier generate() ended ({type(e).__name__}) with {len(at_prefill) + len(active)}"
                    " request(s) still in the workers"
                )
            raise
        return [self.results[rid] for rid in order]

    def _serve(
        self,
        waiting: list[Job],
        at_prefill: dict[int, Job],
        active: dict[int, Job],
        free: list[int],
        capacity: int,
        on_event: Any,
        deadline: float,
        timeout: float,
    ) -> None:
        while waiting or at_prefill or active:
            while waiting and free and len(at_prefill) < capacity:
                job = waiting.pop(0)
                job.decode_slot = free.pop(0)
                at_prefill[job.request_id] = job
                self._jobs.put(job)
            try:
                kind, rid, payload = self._next_event(timeout=0.1)
                if kind == "worker_error":
                    raise RuntimeError(f"DisaggregatedServer: the {rid} worker failed:\n{payload}")
                on_event(kind, rid, payload)
            except queue.Empty:
                pass
            # Decode first: a dead prefill worker's replacement needs a sync with decode.
            if self._decode is not None and not self._decode.is_alive():
                self._decode_died(waiting, at_prefill, active, on_event)
                return
            if self._prefill is not None and not self._prefill.is_alive():
                self._prefill_died(at_prefill, free, waiting, on_event)
            if time.monotonic() > deadline:
                raise TimeoutError(f"DisaggregatedServer: requests not finished after {timeout:.0f} s")

    def _decode_died(
        self, waiting: list[Job], at_prefill: dict[int, Job], active: dict[int, Job], on_event: Any
    ) -> None:
        """Keep every result decode posted before it died; fail the rest, naming it."""
        code = self._decode.exitcode
        cause = ""
        for kind, rid, payload in self._drain(self._events):
            if kind in ("finished", "admitted", "lost") and (rid in active or rid in at_prefill):
                on_event(kind, rid, payload)
            elif kind == "worker_error":  # it failed and said why before it exited
                lines = [ln for ln in str(payload).strip().splitlines() if ln.strip()]
                cause = f": {lines[-1].strip()}" if lines else ""
        reason = f"the decode worker died (exit code {code}){cause}"
        for rid in [*at_prefill, *active, *(j.request_id for j in waiting)]:
            self.results[rid].error = (
                f"{reason} before request {rid} finished; it was not served (finished requests keep their "
                "tokens); stop() and start() the server to serve again"
            )
        at_prefill.clear()
        active.clear()
        waiting.clear()
        self._unusable = reason

    @staticmethod
    def _drain(q: Any, seconds: float = 2.0) -> list[tuple]:
        """What ``q`` holds, read for at most ``seconds``: a writer killed mid-message can
        leave a read blocked for good, so the read runs on a thread that is left behind."""
        got: list[tuple] = []

        def read() -> None:
            while True:
                try:
                    got.append(q.get(timeout=0.2))
                except (queue.Empty, OSError, EOFError):
                    return

        t = threading.Thread(target=read, name="qaic-drain", daemon=True)
        t.start()
        t.join(seconds)
        return list(got)

    def _prefill_died(self, at_prefill: dict[int, Job], free: list[int], waiting: list[Job], on_event: Any) -> None:
        """Fail the requests the dead prefill worker held, never a slot decode still uses:
        a marker sent after everything the worker handed off tells which ones decode took."""
        code = self._prefill.exitcode
        self._prefill = None
        marker = next(self._syncs)
        if self.transport == "gloo":  # its process group died with it: nothing can prefill
            self._no_prefill = f"the prefill worker died (exit code {code}) and the gloo transport cannot replace it"
        elif self._generation == self.max_prefill_restarts:
            self._no_prefill = (
                f"the prefill worker died (exit code {code}) after {self._generation} restart(s), the "
                f"most this server makes (max_prefill_restarts={self.max_prefill_restarts})"
            )
        else:
            self._generation += 1
        self._control.put(("sync", marker, self._generation))
        self._wait_for(
            lambda kind, who, payload: kind == "synced" and who == marker, {marker}, "sync", on_other=on_event
        )
        for rid, job in list(at_prefill.items()):
            self.results[rid].error = (
                f"the prefill worker died (exit code {code}) while prefilling request {rid}; "
                "it was not served (decode kept serving the running requests)"
            )
            free.append(job.decode_slot)
            del at_prefill[rid]
        if self._no_prefill is not None:
            for job in waiting:
                self.results[job.request_id].error = self._no_prefill
            waiting.clear()
            return
        # The dead worker's queues may hold a half-read job, or a write lock it never released
        # (its hand-off queue too: the replacement writes the next one).
        self._jobs, self._prefill_events = self._ctx.Queue(), self._ctx.Queue()
        self._start_prefill()
        self.restarts += 1
        self._wait_for(lambda kind, who, payload: kind == "ready", {"prefill"}, "restart", on_other=on_event)
