"""Round-trip a batch through the layer-agnostic KV-cache ops and check it against PyTorch.

This is the smallest honest thing the op layer does on its own: for every layer of a
decoder-shaped stack it writes a mixed prefill/decode batch into a paged cache with
``unified_kv_cache_update(..., "from_forward_context")`` and reads it back with
``unified_attention``, then compares with ``scaled_dot_product_attention`` on the unpaged
sequences and prints the timings.
"""

from __future__ import annotations

import argparse
import time

import torch

from qaic_dynamo import build_attention_metadata, ops, set_forward_context


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=8, help="decode steps after the prefill")


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    prompts = [37, 5, 120, 64]  # prefill lengths of four sequences
    bs, L = args.block_size, args.layers
    max_len = max(prompts) + args.steps
    blocks_per_seq = -(-max_len // bs)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    num_blocks = blocks_per_seq * len(prompts)
    shape = (num_blocks, args.kv_heads, bs, args.head_size)
    layers = [f"layers.{i}" for i in range(L)]
    kv = {n: (torch.zeros(shape), torch.zeros(shape)) for n in layers}
    history_k = {n: [[] for _ in prompts] for n in layers}
    history_v = {n: [[] for _ in prompts] for n in layers}

    seq_lens = [0] * len(prompts)
    worst, update_s, attn_s, tokens = 0.0, 0.0, 0.0, 0
    for step in range(args.steps + 1):
        q_lens = prompts if step == 0 else [1] * len(prompts)
        seq_lens = [s + q for s, q in zip(seq_lens, q_lens)]
        md = build_attention_metadata(seq_lens, q_lens, tables, bs)
        T = sum(q_lens)
        tokens += T
        with set_forward_context(md, kv):
            for name in layers:
                k = torch.randn(T, args.kv_heads, args.head_size)
                v = torch.randn(T, args.kv_heads, args.head_size)
                q = torch.randn(T, args.heads, args.head_size)
                t0 = time.perf_counter()
                dep = ops.unified_kv_cache_update(k, v)  # the layer comes from the context
                t1 = time.perf_counter()
                out = ops.unified_attention(q, k, v, name, kv_cache_dependency=dep)
                t2 = time.perf_counter()
                update_s += t1 - t0
                attn_s += t2 - t1
                start = 0
                for b, n in enumerate(q_lens):
                    history_k[name][b].append(k[start:start + n])
                    history_v[name][b].append(v[start:start + n])
                    kk = torch.cat(history_k[name][b]).repeat_interleave(args.heads // args.kv_heads, 1)
                    vv = torch.cat(history_v[name][b]).repeat_interleave(args.heads // args.kv_heads, 1)
                    Lb = kk.shape[0]
                    mask = torch.arange(Lb).unsqueeze(0) <= torch.arange(Lb - n, Lb).unsqueeze(1)
                    ref = torch.nn.functional.scaled_dot_product_attention(
                        q[start:start + n].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                        attn_mask=mask).transpose(0, 1)
                    worst = max(worst, (out[start:start + n] - ref).abs().max().item())
                    start += n
    calls = L * (args.steps + 1)
    print("qaic_dynamo op-layer demo: paged KV round trip, layer taken from the forward context")
    print(f"  layers                     {L}")
    print(f"  sequences                  {len(prompts)} (prefill {prompts}, then {args.steps} decode steps)")
    print(f"  cache                      {num_blocks} blocks x {bs} tokens, {args.kv_heads} kv heads x {args.head_size}")
    print(f"  tokens written per layer   {tokens}")
    print(f"  kv update                  {update_s / calls * 1e6:8.1f} us per layer call")
    print(f"  attention                  {attn_s / calls * 1e6:8.1f} us per layer call")
    print(f"  max |attention - SDPA|     {worst:.2e}")
    ok = worst < 1e-4
    print("  result                     " + ("OK" if ok else "MISMATCH"))
    return 0 if ok else 1
