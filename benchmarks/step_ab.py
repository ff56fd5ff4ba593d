"""Step latency of ``LLM``'s default compile against an earlier checkout, side by side.

``decode_latency.py`` compares configurations of *this* checkout in one process: there the
regional compile (``LLM``'s default since issue 10) is slower than the whole-model compile
of the same code. Whether the default got slower than it *was* needs the earlier code
itself, run on the same machine at the same time. This runs decode_latency's model and
cases (prefill 1 x 128 tokens, decode batch 1 and 8 at 128 tokens deep) in fresh
processes, one per configuration, alternating configurations round by round so a drift of
the machine moves all of them alike:

* ``baseline``: ``LLM(model, backend="qaic")`` of the other checkout (its default);
* ``default``: the same call in this checkout (regional);
* ``whole``: this checkout with ``regional=False``.

Each process compiles, warms up, then times ``--steps`` engine steps per case; the figure
is the median over rounds of each process's median step. The other checkout needs its
extension built against this venv's torch:

    git clone -q . /tmp/base && git -C /tmp/base checkout <rev>
    (cd /tmp/base && /path/to/.venv/bin/python setup.py -q build_ext --inplace)
    python benchmarks/step_ab.py --baseline /tmp/base [--rounds 5] [--layers 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, save_results  # noqa: E402

HERE = Path(__file__).resolve().parent
CASES = [("prefill b1x128", "prefill", 1), ("decode b1", "decode", 1), ("decode b8", "decode", 8)]


def child(args: argparse.Namespace) -> None:
    """One configuration in this process: compile, warm up, time every case."""
    import contextlib

    import torch
    from decode_latency import CONTEXT, build

    import qaic_dynamo
    from qaic_dynamo import LLM, qaic_backend

    # torch.compile(backend="qaic") would load the installed package's entry point, whose
    # module path may not exist in the checkout measured here: register this checkout's.
    torch._dynamo.register_backend(qaic_backend, name="qaic")
    model = build(args.layers, args.hidden_size, args.vocab)
    extra = {"regional": False} if args.config == "whole" else {}
    llm = LLM(model, backend="qaic", max_num_seqs=8, max_model_len=CONTEXT + 8, block_size=16, **extra)

    if hasattr(llm, "execute_model"):  # this checkout's engine API
        from decode_latency import case_batch

        step = llm.execute_model
    else:  # before issue 9: sequences with blocks assigned by hand, LLM._step
        from qaic_dynamo.engine import _Seq

        step = llm._step

        @contextlib.contextmanager
        def case_batch(llm, kind: str, batch: int):
            per_seq = -(-(CONTEXT + 8) // llm.block_size)
            seqs = []
            for i in range(batch):
                blocks = list(range(i * per_seq, (i + 1) * per_seq))
                if kind == "prefill":
                    seqs.append((_Seq(i, [7] * CONTEXT, 1, blocks=blocks), [7] * CONTEXT))
                else:
                    seqs.append((_Seq(i, [7] * (CONTEXT - 1), 8, blocks=blocks, output=[9]), [9]))
            yield seqs

    out = {"config": args.config, "package": qaic_dynamo.__file__, "step_ms": {}}
    with torch.no_grad():
        for name, kind, b in CASES:
            with case_batch(llm, kind, b) as batch:
                for _ in range(3):  # the first call compiles
                    step(batch)
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step(batch)
                    times.append(time.perf_counter() - t0)
            out["step_ms"][name] = statistics.median(times) * 1e3
    print(json.dumps(out))


def run(config: str, package: Path, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="qaic-ab-") as tmp:
        env = dict(os.environ, PYTHONPATH=str(package), QAIC_DYNAMO_CACHE_DIR=f"{tmp}/qaic", TMPDIR=tmp)
        cmd = [
            sys.executable,
            str(HERE / "step_ab.py"),
            "--child",
            config,
            "--layers",
            str(args.layers),
            "--hidden-size",
            str(args.hidden_size),
            "--vocab",
            str(args.vocab),
            "--steps",
            str(args.steps),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} ({package}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["package"].startswith(str(package)):
        raise RuntimeError(f"{config} imported {result['package']}, not the checkout at {package}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="the earlier checkout (extension built)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="timed engine steps per case and process")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--child", choices=["default", "whole"], dest="config")
    ap.add_argument("--tag", default="", help="suffix for the result files")
    ap.add_argument("--quick", action="store_true", help="tiny model, one round, few steps (tests)")
    ap.add_argument("--results-dir", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.hidden_size, args.vocab, args.rounds, args.steps = 2, 64, 512, 1, 3
        args.tag = args.tag or "quick"
    if args.config:
        return child(args)
    if args.baseline is None or not (args.baseline / "qaic_dynamo").is_dir():
        ap.error("--baseline must be a checkout of qaic_dynamo (a directory holding qaic_dynamo/)")
    if not any((args.baseline / "qaic_dynamo").glob("_C*.so")):
        ap.error(f"{args.baseline} has no built extension: run `python setup.py build_ext --inplace` there")

    this = HERE.parent
    configs = {"baseline": ("default", args.baseline.resolve()), "default": ("default", this), "whole": ("whole", this)}
    samples: dict[str, dict[str, list[float]]] = {c: {n: [] for n, _, _ in CASES} for c in configs}
    names = list(configs)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who runs first
        for label in order:
            config, package = configs[label]
            res = run(config, package, args)
            for n, v in res["step_ms"].items():
                samples[label][n].append(v)
            print(
                f"round {r + 1} {label:>8}: " + ", ".join(f"{n} {v:.1f} ms" for n, v in res["step_ms"].items()),
                flush=True,
            )
    med = {c: {n: statistics.median(v) for n, v in per.items()} for c, per in samples.items()}
    rows = [
        [
            n,
            med["baseline"][n],
            med["default"][n],
            med["whole"][n],
            med["default"][n] / med["baseline"][n],
            med["default"][n] / med["whole"][n],
        ]
        for n, _, _ in CASES
    ]
    rev = subprocess.run(
        ["git", "-C", str(args.baseline), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip() or str(args.baseline)
    md = (
        f"### LLM default step latency against {rev}, ms (median of {args.rounds} rounds of fresh processes, "
        f"{args.steps} steps each; {args.layers} layers, hidden {args.hidden_size})\n\n"
        + markdown_table(
            [
                "case",
                f"baseline {rev} default (ms)",
                "this default, regional (ms)",
                "this, regional=False (ms)",
                "default / baseline",
                "regional / whole",
            ],
            rows,
        )
    )
    print(md)
    save_results(
        "step_ab" + (f"_{args.tag}" if args.tag else ""),
        {
            "baseline": rev,
            "layers": args.layers,
            "hidden": args.hidden_size,
            "rounds": args.rounds,
            "steps": args.steps,
            "samples_ms": samples,
            "median_ms": med,
        },
        md,
        args.results_dir,
    )


if __name__ == "__main__":
    main()
