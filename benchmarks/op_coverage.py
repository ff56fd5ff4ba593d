"""How much of PyTorch's op surface backend="qaic" compiles, and compiles right.

Sweeps PyTorch's OpInfo database (``op_db``): every op that supports float32 on CPU and is
not random, its first ``--samples`` float32 CPU sample inputs, each called as
``op.op(sample.input, *sample.args, **sample.kwargs)`` with the tensors as graph inputs
(the other arguments are constants). Every sample runs eagerly and through
``torch.compile(fn, backend="qaic")`` (fallback "eager", disk cache off, Dynamo reset
before each), and lands in exactly one class, the first that applies:

  error_both           eager raises, and so does the compiled call
  error_compiled_only  eager works, the compiled call raises (also: its child process timed out or crashed)
  wrong                outputs differ (structure, dtype, shape, or values beyond atol=rtol=1e-4,
                       exact for integer/bool; NaNs equal), or eager raises and compiled does not
  graph_break          output matches, but Dynamo broke the graph or no graph reached the backend
  eager_piece          output matches, but a piece (or the whole graph, or the call) ran eagerly
  match                output matches, every piece compiled

The headline share "with no eager piece" is match / (all samples - error_both). The
eager-piece reasons table counts every sample with an eager piece, whatever its class.
A sample whose eager output changes with the random seed is skipped (as are the random ops
named in RANDOM_OPS). Ops run in child processes (``--threads`` 1), ``--chunk`` ops each,
one at a time; a child that crashes, is silent for ``--sample-timeout`` s or runs past
``--timeout`` s costs the op in progress its remaining samples (error_compiled_only,
"timeout"/"crash"), and the next child goes on with the next op.

    python benchmarks/op_coverage.py [--quick] [--ops add topk ...] [--samples 8] [--limit-ops N]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
CLASSES = ["match", "eager_piece", "graph_break", "error_both", "error_compiled_only", "wrong"]
RANDOM_OPS = {
    "bernoulli", "multinomial", "normal", "rand_like", "randint_like", "randn_like", "randn", "randint",
    "uniform", "cauchy", "exponential", "geometric", "log_normal", "nn.functional.rrelu",
}  # fmt: skip
QUICK_OPS = [
    "add", "matmul", "amax", "topk", "argsort", "cumsum", "fft.fft", "nonzero",
    "nn.functional.interpolate.nearest", "where", "masked_select", "item",
]  # fmt: skip
ATOL = RTOL = 1e-4
OPTIONS = {"fallback": "eager", "cache": False}  # the disk cache would only fill up with one-op pieces


def full_name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def select_ops(names: list[str] | None, limit: int | None) -> tuple[list, dict[str, str]]:
    """(ops to sweep, skipped op -> why); ``names`` match an op's name or its full name."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops, skipped = [], {}
    for op in op_db:
        if names and op.name not in names and full_name(op) not in names:
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            skipped[full_name(op)] = "no float32 on CPU"
        elif (
            op.name in RANDOM_OPS
            or re.search(r"empty|^nn\.functional\..*dropout", op.name)
            or op.has_nondeterministic_output
        ):
            skipped[full_name(op)] = "random or uninitialized output"
        else:
            ops.append(op)
    unknown = set(names or ()) - {n for op in op_db for n in (op.name, full_name(op))}
    if unknown:
        print(f"no OpInfo named {sorted(unknown)}", flush=True)
    return ops[:limit], skipped


# ---- child: runs samples, one JSON line each --------------------------------------------------


def as_graph_fn(op, sample):
    """(fn, tensors): fn(*tensors) calls the op with the sample, its non-tensor leaves baked in."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def fn(*tensors):
        values = list(leaves)
        for i, t in zip(where, tensors):
            values[i] = t
        inp, args, kwargs = tree_unflatten(values, spec)
        return op.op(inp, *args, **kwargs)

    return fn, [leaves[i] for i in where]


def describe(sample) -> str:
    from torch.utils._pytree import tree_map

    short = lambda x: f"T{list(x.shape)}" if isinstance(x, torch.Tensor) else x
    return repr(tree_map(short, (sample.input, sample.args, sample.kwargs)))[:200]


def call(fn, tensors, seed: int):
    """(output, exception); inputs are cloned, since ops may write into them."""
    torch.manual_seed(seed)
    try:
        return fn(*[t.clone() for t in tensors]), None
    except Exception as e:
        return None, e


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def max_abs_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.double(), want.double()
    same = (g == w) | (g.isnan() & w.isnan())  # equal infinities and NaNs count as equal
    d = torch.where(same, 0.0, (g - w).abs().nan_to_num(nan=float("inf"), posinf=float("inf")))
    return float(d.max()) if d.numel() else 0.0


def compare(got, want) -> str | None:
    """Why ``got`` is not ``want`` (None: it is), leaf by leaf."""
    from torch.utils._pytree import tree_flatten

    g_leaves, g_spec = tree_flatten(got)
    w_leaves, w_spec = tree_flatten(want)
    if g_spec != w_spec:
        return f"output structure differs: {str(g_spec)[:100]} vs {str(w_spec)[:100]}"
    for i, (g, w) in enumerate(zip(g_leaves, w_leaves)):
        if type(g) is not type(w) and not (isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)):
            return f"output {i}: {type(g).__name__} instead of {type(w).__name__}"
        if isinstance(w, float):  # a Python float: compared with the same tolerance
            g, w = torch.tensor(g), torch.tensor(w)
        elif not isinstance(w, torch.Tensor):
            if g != w:
                return f"output {i}: {g!r} vs {w!r}"
            continue
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"output {i}: {g.dtype}{list(g.shape)} instead of {w.dtype}{list(w.shape)}"
        g, w = (x.to_dense() if x.layout != torch.strided else x for x in (g, w))
        if w.is_complex():
            g, w = torch.view_as_real(g.resolve_conj()), torch.view_as_real(w.resolve_conj())
        tol = ATOL if w.is_floating_point() else 0.0
        try:
            torch.testing.assert_close(g, w, rtol=tol, atol=tol, equal_nan=True, check_stride=False)
        except AssertionError:
            return f"output {i}: max abs diff {max_abs_diff(g, w):.3g}"
    return None


def short_break(reason: str) -> str:
    """Dynamo's graph-break reason: its first line and the first `name` its explanation gives."""
    m = re.search(r"`([^`]+)`", reason)
    return reason.strip().splitlines()[0] + (f" ({m[1]})" if m else "")


def run_sample(op, sample) -> dict:
    from torch._dynamo.utils import counters

    from qaic_dynamo.compiler import compile_reports
    from qaic_dynamo.counter import compilation_counter

    fn, tensors = as_graph_fn(op, sample)
    want, eager_err = call(fn, tensors, seed=0)
    if eager_err is None and compare(call(fn, tensors, seed=1)[0], want) is not None:
        return {"class": "skipped", "detail": "eager output depends on the random seed"}
    torch._dynamo.reset()
    counters.clear()
    before = len(compile_reports())
    unless_before = compilation_counter.num_eager_unless_calls
    fallbacks_before = compilation_counter.num_eager_fallbacks
    got, comp_err = call(torch.compile(fn, backend="qaic", options=OPTIONS), tensors, seed=0)
    reports = compile_reports()[before:]
    eager = [r.eager for r in reports if r.eager]
    eager += [p.fallback or f"splitting op {p.detail}" for r in reports for p in r.pieces if p.runs_eagerly]
    if compilation_counter.num_eager_unless_calls != unless_before:  # compiled, but this call ran eagerly
        eager.append("the call ran eagerly: an input outside the domain the translation is exact on")
    if compilation_counter.num_eager_fallbacks != fallbacks_before and not eager:  # the artifact failed to run
        eager.append("a piece failed in ONNX Runtime at run time and ran eagerly")
    breaks = sorted(map(short_break, counters["graph_break"])) or ([] if reports else ["no graph reached the backend"])
    rec = {"eager": eager, "breaks": breaks}
    if eager_err is not None:
        detail = first_line(eager_err) + ("" if comp_err else "; compiled returned")
        return dict(rec, **{"class": "error_both" if comp_err else "wrong", "detail": detail})
    if comp_err is not None:
        return dict(rec, **{"class": "error_compiled_only", "detail": first_line(comp_err)})
    try:
        diff = compare(got, want)
    except Exception as e:  # an output this harness cannot compare: listed with the wrong ones, to look at
        diff = f"could not compare: {first_line(e)}"
    cls = "wrong" if diff else "graph_break" if breaks else "eager_piece" if eager else "match"
    return dict(rec, **{"class": cls, "detail": diff or "; ".join(breaks or eager)[:300]})


def child(names: list[str], samples: int, out: Path) -> None:
    warnings.simplefilter("ignore")  # the backend warns once per fallback reason: the records have them
    logging.getLogger("qaic_dynamo").setLevel(logging.ERROR)
    from torch.testing._internal import common_methods_invocations as cmi

    import qaic_dynamo  # noqa: F401  (registers the backend)

    # A few ops (sdpa, item, ...) run inside wrapper_set_seed, whose freeze_rng_state Dynamo
    # cannot trace: a graph break of the harness, not of the op. Every call here is seeded.
    cmi.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)

    with out.open("a") as f:
        for op in select_ops(names, None)[0]:
            name = full_name(op)
            if name not in names:
                continue
            torch.manual_seed(0)  # sample inputs are random: the same ones on every run
            batch = list(itertools.islice(op.sample_inputs("cpu", torch.float32, requires_grad=False), samples))
            f.write(json.dumps({"op": name, "samples": len(batch)}) + "\n")
            f.flush()
            for i, sample in enumerate(batch):
                t0 = time.perf_counter()
                rec = run_sample(op, sample)
                rec.update(op=name, index=i, sample=describe(sample), seconds=round(time.perf_counter() - t0, 3))
                f.write(json.dumps(rec) + "\n")
                f.flush()


# ---- parent: chunks of ops in child processes, then the report -------------------------------


def watch(proc: subprocess.Popen, out: Path, sample_timeout: float, timeout: float) -> str | None:
    """None when the child finished; "timeout" when it was killed for taking too long."""
    start = last_change = time.monotonic()
    size = -1
    while proc.poll() is None:
        time.sleep(0.5)
        now, new = time.monotonic(), out.stat().st_size if out.exists() else 0
        if new != size:
            size, last_change = new, now
        if now - last_change > sample_timeout or now - start > timeout:
            proc.kill()
            proc.wait()
            return "timeout"
    return None


def run_chunk(names: list[str], args, tmp: Path) -> list[dict]:
    """Records of every sample of ``names``; an op whose child dies loses its remaining samples."""
    records: list[dict] = []
    todo = list(names)
    while todo:
        out, err = tmp / "child.jsonl", tmp / "child.err"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--child", "--out", str(out), "--samples", str(args.samples), "--ops", *todo]
        with err.open("w") as stderr:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
            failure = watch(proc, out, args.sample_timeout, args.timeout)
        lines = [json.loads(s) for s in out.read_text().splitlines()] if out.exists() else []
        records += [r for r in lines if "class" in r]
        if failure is None and proc.returncode != 0:
            tail = (err.read_text().strip().splitlines() or [""])[-1][:200]
            code = signal.Signals(-proc.returncode).name if proc.returncode < 0 else f"exit code {proc.returncode}"
            failure = f"crash ({code}): {tail}"
        if failure is None:
            return records
        headers = [r for r in lines if "class" not in r]
        done = sum(1 for r in lines if "class" in r and headers and r["op"] == headers[-1]["op"])
        if headers and done < headers[-1]["samples"]:
            bad, indices = headers[-1]["op"], range(done, headers[-1]["samples"])
        else:  # died between ops (the child runs them in todo's order): in the next one's sample generation
            rest = todo[todo.index(headers[-1]["op"]) + 1 :] if headers else todo
            if not rest:  # after its last op (at exit): nothing is lost
                return records
            bad, indices = rest[0], range(1)
        print(f"  {bad}: {failure}", flush=True)
        records += [{"op": bad, "index": i, "class": "error_compiled_only", "detail": failure} for i in indices]
        todo = todo[todo.index(bad) + 1 :]
    return records


def short_reason(reason: str) -> str:
    """Group eager-piece reasons: the op without an ONNX function when the reason names
    one, else the reason's start with paths and numbers (n0, out1, ": 1 :"; not float32 or im2col) blanked."""
    m = re.search(r"No ONNX function found for <OpOverload\(op='([\w.]+)', overload='(\w+)'", reason)
    if m:
        return f"no ONNX function: {m[1]}.{m[2]}"
    reason = re.sub(r"/\S+", "<path>", reason.strip().splitlines()[0])  # artifact paths differ per piece
    return re.sub(r"(?<![A-Za-z\d.])\d+|(?<=\bn)\d+|(?<=\bout)\d+", "N", reason)[:100]


def cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")  # a table cell: one line, no column breaks


def summary(records: list[dict], skipped: dict[str, str], n_ops: int, seconds: float) -> str:
    from common import markdown_table

    recs = [r for r in records if r["class"] != "skipped"]
    counts, total = Counter(r["class"] for r in recs), len(recs)
    ran = total - counts["error_both"]
    shares = [[c, counts[c], f"{counts[c] / max(total, 1):.1%}"] for c in CLASSES]
    why_skipped = ", ".join(f"{n} {why}" for why, n in Counter(skipped.values()).items()) or "none"
    return (
        f"### qaic op coverage: {n_ops} OpInfo ops, {total} float32 CPU samples "
        f"({seconds:.0f} s, {seconds / max(total, 1):.2f} s/sample)\n\n"
        + markdown_table(["class", "samples", "share"], shares)
        + f"\nSamples with no eager piece: {counts['match'] / max(ran, 1):.1%} = match / (all samples - error_both) "
        f"= {counts['match']} / {ran}: of the samples that run in eager, those compiled whole (a graph break, "
        f"an eager piece, an error or a wrong result counts against).\n"
        f"Skipped ops: {why_skipped}; skipped samples (eager output depends on the seed): {len(records) - total}.\n\n"
    )


def details(records: list[dict]) -> str:
    """Eager-piece and graph-break reasons, the wrong and failing samples, the slowest ops."""
    from common import markdown_table

    recs = [r for r in records if r["class"] != "skipped"]
    md = ""
    groups: dict[str, dict] = defaultdict(lambda: {"samples": 0, "ops": set()})
    for r in recs:  # every sample with an eager piece, whatever its class
        for reason in set(map(short_reason, r.get("eager", []))):
            groups[reason]["samples"] += 1
            groups[reason]["ops"].add(r["op"])
    top = sorted(groups.items(), key=lambda kv: -kv[1]["samples"])[:30]
    rows = [[cell(k), g["samples"], ", ".join(sorted(g["ops"])[:8]) + " ..." * (len(g["ops"]) > 8)] for k, g in top]
    md += "#### Top eager-piece reasons\n\n" + markdown_table(["reason", "samples", "ops"], rows)
    breaks = Counter(cell(b[:120]) for r in recs if r["class"] == "graph_break" for b in r["breaks"])
    md += "\n#### Top graph-break reasons\n\n" + markdown_table(["reason", "samples"], breaks.most_common(15))
    for cls in ("wrong", "error_compiled_only"):
        rows = [[r["op"], r["index"], cell(r["detail"]), cell(r.get("sample", ""))] for r in recs if r["class"] == cls]
        md += f"\n#### {cls} ({len(rows)})\n\n" + markdown_table(["op", "sample", "detail", "input"], rows)
    per_op = Counter()
    for r in recs:
        per_op[r["op"]] += r.get("seconds", 0.0)
    return md + "\n#### Slowest ops\n\n" + markdown_table(["op", "seconds, all samples"], per_op.most_common(10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="+", help="only these ops (name, or name.variant)")
    ap.add_argument("--samples", type=int, default=8, help="first N samples per op")
    ap.add_argument("--limit-ops", type=int, default=None, help="first N ops")
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK_OPS)} ops, 2 samples (tests)")
    ap.add_argument("--chunk", type=int, default=20, help="ops per child process")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per child process")
    ap.add_argument("--sample-timeout", type=float, default=180, help="seconds a child may go without a result")
    ap.add_argument("--threads", type=int, default=1, help="torch (and ONNX Runtime) threads in the children")
    ap.add_argument("--results-dir", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        torch.set_num_threads(args.threads)
        return child(args.ops, args.samples, args.out)
    from common import save_results

    if args.quick:
        args.ops, args.samples = args.ops or QUICK_OPS, 2
    ops, skipped = select_ops(args.ops, args.limit_ops)
    names = [full_name(op) for op in ops]
    print(f"{len(names)} ops, {args.samples} samples each; {len(skipped)} skipped", flush=True)
    records: list[dict] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for start in range(0, len(names), args.chunk):
            records += run_chunk(names[start : start + args.chunk], args, Path(tmp))
            done = min(start + args.chunk, len(names))
            print(f"  {done}/{len(names)} ops, {time.perf_counter() - t0:.0f} s", flush=True)
    seconds = time.perf_counter() - t0
    md = summary(records, skipped, len(names), seconds) + details(records)
    counts = dict(Counter(r["class"] for r in records))
    payload = dict(samples_per_op=args.samples, ops=names, skipped_ops=skipped, seconds=seconds, counts=counts)
    payload["records"] = records  # per sample: op, index, class, detail (diff two runs by (op, index))
    path = save_results("op_coverage_quick" if args.quick else "op_coverage", payload, md, args.results_dir)
    print(md + f"\nwritten to {path}", flush=True)  # after saving: a closed pipe must not lose the results


if __name__ == "__main__":
    main()
