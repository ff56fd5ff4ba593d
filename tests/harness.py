"""A minimal paged-KV driver for backend tests: prefill a batch of variable-length
prompts, then decode greedily, with the forward context set for every step."""

from __future__ import annotations

import torch

from qaic_dynamo import build_attention_metadata, set_forward_context


class Driver:
    def __init__(self, model, prompts, block_size=16, max_len=64, dtype=torch.float32, pad_to=None, dynamic=True):
        self.model, self.prompts, self.block_size, self.pad_to = model, prompts, block_size, pad_to
        self.dynamic = dynamic  # mark the token dim dynamic: compile once for every count
        blocks = -(-max_len // block_size)
        self.tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(prompts))]
        shape = model.kv_cache_shape(blocks * len(prompts), block_size)
        self.caches = {
            n: (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for n in model.kv_cache_layers
        }
        self.seq_lens = [0] * len(prompts)

    def step(self, fn, tokens_per_seq):
        """Run one forward over the new tokens of every sequence; returns last-token logits."""
        q_lens = [len(t) for t in tokens_per_seq]
        self.seq_lens = [s + q for s, q in zip(self.seq_lens, q_lens)]
        ids = torch.tensor([t for ts in tokens_per_seq for t in ts])
        pos = torch.cat([torch.arange(s - q, s) for s, q in zip(self.seq_lens, q_lens)])
        num = ids.numel() if self.pad_to is None else max(self.pad_to, ids.numel())
        if num > ids.numel():  # pad rows: slot -1, they must change nothing
            ids = torch.cat([ids, ids.new_zeros(num - ids.numel())])
            pos = torch.cat([pos, pos.new_zeros(num - pos.numel())])
        if self.dynamic:
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(pos, 0)
        md = build_attention_metadata(self.seq_lens, q_lens, self.tables, self.block_size, num_tokens=num)
        with set_forward_context(md, self.caches, self.model.kv_cache_layers):
            logits = fn(ids, pos)
        last = torch.cumsum(torch.tensor(q_lens), 0) - 1
        return logits[last]

    def generate(self, fn, steps):
        out = [self.step(fn, self.prompts)]
        for _ in range(steps):
            out.append(self.step(fn, [[int(t)] for t in out[-1].argmax(-1)]))
        return out
