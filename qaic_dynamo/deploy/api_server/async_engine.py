"""An ``LLM`` behind asyncio: one thread steps the engine, coroutines await their deltas.

Every HTTP request adds its requests to the one engine core, so requests from many
clients are batched by the scheduler. The engine thread steps while anything is waiting
or running, and after each step hands every changed request its delta
(``RequestOutput`` with only the new tokens) on the event loop it came from. A request
whose consumer goes away - a client that disconnects mid-stream cancels its coroutine -
is aborted and releases its KV blocks at once.

The event loop never waits for a step: coroutines hand their requests (and releases) to
the engine thread through an inbox, which the thread drains between steps.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from qaic_dynamo.engine import LLM, RequestOutput, SamplingParams
from qaic_dynamo.errors import EngineStepError

__all__ = ["AsyncEngine"]

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    submitted: float
    first_token: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    last_token: float | None = None
    #: Seconds between consecutive output tokens of this request.
    gaps: list[float] = field(default_factory=list)
    #: Deltas (streaming), or only the final cumulative output.
    delta: bool = True


class AsyncEngine:
    """See the module docstring. ``on_finish(stream)`` is called (on the engine thread)
    when a request finishes, for metrics."""

    def __init__(self, llm: LLM, on_finish: Any = None, on_token: Any = None) -> None:
        self.llm = llm
        self.core = llm.core
        self.on_finish = on_finish
        self.on_token = on_token
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: Why the engine thread stopped on an unexpected error (None: it runs).
        self.dead: str | None = None

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="qaic-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def num_running(self) -> int:
        return len(self.llm.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.llm.scheduler.waiting)

    def _drain(self) -> None:
        """Add and release what the coroutines asked for (under the core's lock)."""
        while True:
            try:
                kind, rid, *args = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.core.add_request(rid, *args)
                except Exception as e:  # checked before it was sent: not expected
                    self._deliver(rid, e)
            else:
                self.core.release(rid)

    def _deliver(self, rid: str, item: Any) -> None:
        with self._streams_lock:
            stream = self._streams.get(rid)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # its event loop is closed: nobody is waiting any more
                pass

    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._iteration()
            except BaseException as e:  # a bug here must not leave every client waiting forever
                logger.exception("qaic-dynamo: the engine thread failed")
                self.dead = f"{type(e).__name__}: {e}".splitlines()[0]
                with self._streams_lock:
                    streams = dict(self._streams)
                for rid in streams:
                    self._deliver(rid, EngineStepError(f"the engine thread failed: {self.dead}"))
                return

    def _iteration(self) -> None:
        with self.core.lock:
            self._drain()
            busy = self.core.has_unfinished()
        if not busy:
            self._wake.wait(0.05)
            self._wake.clear()
            return
        with self.core.lock:
            try:
                self.core.step()
            except Exception:  # the core failed the requests of this step; they get the error
                logger.warning("qaic-dynamo: an engine step failed", exc_info=True)
            now = time.perf_counter()
            with self._streams_lock:
                streams = dict(self._streams)
            ready = [rid for rid in streams if rid in self.core.dirty]
            outs = [(rid, self.core.output(rid, delta=streams[rid].delta), self.core.error(rid)) for rid in ready]
        for rid, out, failed in outs:
            stream = streams[rid]
            total = sum(len(o.token_ids) for o in out.outputs)
            new = total if stream.delta else total - stream.tokens
            if new:
                if stream.first_token is None:
                    stream.first_token = now
                elif stream.last_token is not None:
                    stream.gaps.append(now - stream.last_token)  # one token per sample per step
                stream.last_token = now
                stream.tokens += new
                if self.on_token is not None:
                    self.on_token(new)
            if out.finished and self.on_finish is not None:
                self.on_finish(stream, failed)
            if failed is not None:
                self._deliver(rid, EngineStepError(f"the engine step that ran this request failed: {failed}"))
            elif stream.delta or out.finished:
                self._deliver(rid, out)

    async def generate(
        self,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        prefix: str = "cmpl",
        delta: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request until it finishes (``delta=False``: only its final,
        whole output); cancelling the consumer aborts it. A request that can never be
        served raises ValueError before anything is queued."""
        if self.dead is not None:
            raise EngineStepError(f"the engine thread failed ({self.dead}); restart the server")
        self.core.check_request(prompt_ids, params)
        rid = f"{prefix}-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter(), delta=delta)
        stream.prompt_tokens = len(prompt_ids)
        with self._streams_lock:
            self._streams[rid] = stream
        try:
            self._inbox.put(("add", rid, prompt, prompt_ids, params))
            self._wake.set()
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(rid, None)
            self._inbox.put(("release", rid))  # aborts it if it still runs, freeing its blocks
            self._wake.set()
