"""The scheduler: which requests run in the next step, and how many of their tokens.

vLLM V1's model. Each step has a budget of ``max_num_batched_tokens`` tokens. Running
requests come first, oldest first: a decoding request takes one token and a request
still prefilling takes the next chunk of its prompt that fits the budget (chunked
prefill). Waiting requests then join, in arrival order, while there is budget, a free
sequence slot (``max_num_seqs``) and KV blocks for their first chunk. So prefills and
decodes mix in one step, and a finished request's slot and blocks go to the next waiting
one at the next step.

KV blocks are taken as a request's tokens need them. When the next chunk of a running
request finds none free, the newest running request is preempted: its blocks are freed
and it goes back to the front of the queue with its generated tokens. When it runs again
it recomputes its KV from all its tokens (vLLM's recompute preemption). A request never
fails for want of blocks, and its tokens are the ones it would have had alone. A request
that could not fit even in an empty cache is refused when it is added.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from qaic_dynamo.engine.request import Request

__all__ = ["BlockPool", "ScheduledRequest", "Scheduler"]


class BlockPool:
    """The free KV blocks, handed out and returned in FIFO order."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = collections.deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """``n`` blocks, or None (and none taken) if fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


@dataclass
class ScheduledRequest:
    request: Request
    #: Tokens fed this step: ``all_token_ids[num_computed_tokens : num_computed_tokens + n]``.
    num_new_tokens: int


class Scheduler:
    """Waiting and running requests, and the KV blocks they hold (see the module docstring)."""

    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        #: Preemptions so far (each recomputes the preempted request's KV).
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """Take ``request`` out (finished or aborted) and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)

    def _free(self, request: Request) -> None:
        self.pool.give_back(request.block_ids)
        request.block_ids = []

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Give ``request`` blocks for ``num_tokens`` tokens; False (none taken) if too few
        are free."""
        need = -(-num_tokens // self.block_size) - len(request.block_ids)
        if need <= 0:
            return True
        blocks = self.pool.take(need)
        if blocks is None:
            return False
        request.block_ids.extend(blocks)
        return True

    def _preempt(self, request: Request) -> None:
        self._free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> list[ScheduledRequest]:
        """The next step's requests and token counts (empty only when nothing is waiting
        or running)."""
        budget = self.max_num_batched_tokens
        out: list[ScheduledRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._grow(req, req.num_computed_tokens + n):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.append(ScheduledRequest(req, n))
                budget -= n
                i += 1
                continue
            break  # ``req`` itself was the newest, and is preempted
        # As vLLM: no request joins in a step that had to preempt one.
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.running.append(req)
            out.append(ScheduledRequest(req, n))
            budget -= n
        return out
