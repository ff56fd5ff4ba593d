"""What Dynamo's own precompile (``torch._dynamo`` aot_compile) would save on a warm start.

A warm start of the regional compile (``cold_start.py --methods warm``) loads every
lowered piece from the disk cache, but Dynamo still traces each region again in the new
process (1.1-1.5 s at 32 layers on the demo model). torch 2.13 can save a traced frame -
its transformed bytecode, guards and the backend's output - and load it in another
process without tracing (``torch.compile(fn, fullgraph=True).aot_compile(...)``,
``AOTCompiledFunction.save_compiled_function`` / ``deserialize``; vLLM's AOT compile mode
uses it). This measures that lever on the demo's decoder block, each step in a fresh
process, with a backend that returns the graph unchanged (so the figures are Dynamo's):

  trace   the block's first call through ``torch.compile`` (what a warm start pays today)
  save    ``aot_compile`` of the same call, then saving it
  load    in the next fresh process: deserialize, then the first call

and lists the guards the saved entry keeps and the ones Dynamo drops because they cannot
be serialized (identity guards on classes, functions and modules, and every guard on a
global). Those dropped guards are why qaic_dynamo does not use it yet (docs/benchmarks.md).

    python benchmarks/dynamo_precompile.py [--layers 32] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch._dynamo.aot_compile_types import SerializableCallable

sys.path.insert(0, str(Path(__file__).parent))
STEPS = ["trace", "save", "load"]


class Graph(SerializableCallable):
    """The backend's output: the graph itself, picklable (module level, so a new process finds it)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm

    def __call__(self, *args):
        return self.gm(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: Graph) -> bytes:
        return pickle.dumps(fn.gm)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Graph:
        return cls(pickle.loads(data))


def backend(gm, example_inputs):
    return Graph(gm)


def child(step: str, layers: int, path: Path) -> dict:
    from qaic_dynamo import LLM, build_attention_metadata, set_forward_context
    from qaic_dynamo.compiler.collector import collector_paused
    from qaic_dynamo.compiler.regions import find_repeated_blocks, mark_dynamic_dims, region_config
    from qaic_dynamo.demo import DEFAULT_LLAMA
    from qaic_dynamo.models import hf_config, hf_model_from_config

    torch.manual_seed(0)
    model = hf_model_from_config(hf_config(dict(DEFAULT_LLAMA, num_hidden_layers=layers)))
    llm = LLM(model, backend="eager", max_num_seqs=2, max_model_len=64)
    _, blocks = find_repeated_blocks(llm.model)[0]
    block = blocks[0]
    captured = []
    hook = block.register_forward_pre_hook(
        lambda m, a, k: captured.append((a, k)) if not captured else None, with_kwargs=True
    )
    ids = torch.randint(0, 1000, (64,))
    pos = torch.cat([torch.arange(32), torch.arange(32)])
    idx = torch.tensor([31, 63])
    md = build_attention_metadata([32, 32], [32, 32], [[0, 1], [2, 3]], 16)

    def context():
        return set_forward_context(md, llm.kv_caches, llm.kv_cache_layers)

    with context(), torch.no_grad():
        llm.model(ids, pos, idx)
    hook.remove()
    args, kwargs = captured[0]
    forward = type(block).forward
    # transformers wraps the layer's forward; the wrapped functions are the closure's
    closure = {f"cell{i}": c.cell_contents for i, c in enumerate(forward.__closure__ or ())}
    result: dict = {"step": step, "layers": layers}
    with context(), torch.no_grad(), region_config(), collector_paused():
        if step == "trace":
            compiled = torch.compile(block, backend=backend)
            mark_dynamic_dims(args, kwargs)
            t0 = time.perf_counter()
            compiled(*args, **kwargs)
            result["seconds"] = time.perf_counter() - t0
        elif step == "save":
            from torch._dynamo.guards import CheckFunctionManager

            unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
            kept, dropped = [0], collections.Counter()

            def guard_filter(entries):
                keep = [not (g.is_global or g.guard_type in unsupported) for g in entries]
                kept[0] = sum(keep)
                for g, k in zip(entries, keep):
                    if not k:
                        dropped[f"{g.guard_type} ({'global' if g.is_global else 'local'})"] += 1
                return keep

            mark_dynamic_dims(args, kwargs)
            t0 = time.perf_counter()
            fn = torch.compile(
                forward, fullgraph=True, backend=backend, options={"guard_filter_fn": guard_filter}
            ).aot_compile(((block, *args), kwargs))
            fn.save_compiled_function(str(path), external_data=closure)
            result["seconds"] = time.perf_counter() - t0
            result.update(guards_kept=kept[0], guards_dropped=dict(dropped), bytes=path.stat().st_size)
        else:
            from torch._dynamo.aot_compile import AOTCompiledFunction

            t0 = time.perf_counter()
            fn = AOTCompiledFunction.deserialize(path.read_bytes(), external_closure_data=closure)
            out = fn(block, *args, **kwargs)
            result["seconds"] = time.perf_counter() - t0
            ref = block(*args, **kwargs)
            result["max_abs_diff"] = float(
                (out[0] if isinstance(out, tuple) else out).sub(ref[0] if isinstance(ref, tuple) else ref).abs().max()
            )
            result["guards_pass_other_layer"] = bool(fn.guard_check(blocks[-1], *args, **kwargs))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=STEPS, help=argparse.SUPPRESS)
    ap.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 layers, one repeat (tests)")
    ap.add_argument("--results-dir", type=Path, default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.path)))
        return
    from common import markdown_table, save_results

    if args.quick:
        args.layers, args.repeats = 2, 1
    samples: dict[str, list[dict]] = {s: [] for s in STEPS}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, QAIC_DYNAMO_CACHE_DIR=f"{tmp}/qaic", TMPDIR=tmp)
            for step in STEPS:  # load reads what save wrote, in the next process
                proc = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        step,
                        "--layers",
                        str(args.layers),
                        "--path",
                        f"{tmp}/block.aot",
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=900,
                )
                if proc.returncode != 0:
                    raise RuntimeError(f"{step} failed:\n{proc.stderr[-3000:]}")
                s = json.loads(proc.stdout.strip().splitlines()[-1])
                samples[step].append(s)
                print(f"  {step:>5} {s['seconds']:6.3f} s", flush=True)
    med = {s: statistics.median(x["seconds"] for x in samples[s]) for s in STEPS}
    save = samples["save"][-1]
    load = samples["load"][-1]
    md = (
        f"### Dynamo precompile of the decoder block ({args.layers} layers, median of {args.repeats} fresh processes)\n\n"
        + markdown_table(["step", "seconds"], [[s, med[s]] for s in STEPS])
        + f"\nload / trace = {med['load'] / med['trace']:.3f}; saved entry {save['bytes']} bytes; output "
        f"max |diff| vs eager {load['max_abs_diff']:.3g}; the loaded guards pass for another layer: "
        f"{load['guards_pass_other_layer']}\n\nguards kept: {save['guards_kept']}; dropped (cannot be serialized):\n\n"
        + markdown_table(["guard type", "count"], sorted(save["guards_dropped"].items(), key=lambda kv: -kv[1]))
    )
    print(md)
    save_results(
        "dynamo_precompile_quick" if args.quick else "dynamo_precompile",
        {"layers": args.layers, "repeats": args.repeats, "samples": samples, "median_seconds": med},
        md,
        args.results_dir,
    )


if __name__ == "__main__":
    main()
