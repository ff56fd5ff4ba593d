"""The smaller defects of issue 39, each reproduced by a test that failed before: lock
files that were never removed, bad arguments that surfaced as someone else's error, a
broken pipe, an unusable dump_dir, and a warning that did not say what it meant."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo
from test_serving import llama

from qaic_dynamo import LLM, SamplingParams
from qaic_dynamo.errors import ConfigError, ExportError


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def small_compile(cache_dir: Path, **options) -> None:
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    torch.compile(m, backend="qaic", options={"cache_dir": str(cache_dir), **options})(torch.randn(2, 8))


def test_a_keys_lock_file_goes_once_it_is_free(tmp_path):
    # The cache's file count grew without bound: one locks/<key>.lock per key ever compiled.
    small_compile(tmp_path)
    locks = [p.name for p in (tmp_path / "v1" / "locks").glob("*.lock") if not p.name.startswith("writer-")]
    assert locks == []
    entries = [p for p in (tmp_path / "v1").glob("??/*") if p.is_dir()]
    assert entries, "nothing was cached: the test would not see a lock"


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_cache_cli_refuses_a_cache_dir_that_is_not_one(kind, tmp_path, capsys):
    from qaic_dynamo.cli import main

    path = tmp_path / "nowhere"
    if kind == "file":
        path.write_text("not a cache")
    for action in ("info", "list", "clear"):
        assert main(["cache", action, "--cache-dir", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"--cache-dir {path} {'is a file, not a directory' if kind == 'file' else 'does not exist'}" in err


def test_cache_list_into_a_closed_pipe_ends_quietly(tmp_path):
    small_compile(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "qaic_dynamo", "cache", "list", "--cache-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # `| head -0`: the reader is gone before anything is written
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_llm_arguments_that_were_someone_elses_error():
    with pytest.raises(ValueError, match=r"dtype must be a torch dtype or one of \['bfloat16', 'float16'"):
        LLM(llama(2), "eager", dtype="fp17")
    llm = LLM(llama(2), "eager", dtype="float16", max_model_len=32)  # was "Invalid device string"
    assert llm.dtype == torch.float16
    with pytest.raises(ValueError, match="tokenizer '/nonexistent' is not a directory; pass a local directory"):
        LLM(llama(2), "eager", tokenizer="/nonexistent")
    with pytest.raises(ValueError, match=r"compile_options must be a dict of qaic option name -> value"):
        LLM(llama(2), "qaic", compile_options=["fallback"])
    with pytest.raises(ConfigError, match=r"unknown qaic option\(s\) \['bogus'\]"):
        LLM(llama(2), "qaic", regional=False, compile_options={"bogus": 1})  # at construction, not the first step
    with pytest.raises(ValueError, match=r"stop_token_ids \[256, 999\] are outside the vocabulary \[0, 256\)"):
        LLM(llama(2), "eager", max_model_len=32).generate([[1, 2]], SamplingParams(stop_token_ids=[5, 256, 999]))


def test_options_that_are_not_a_dict_are_named():
    # "dictionary update sequence element #0 has length 8; 2 is required"
    with pytest.raises(ConfigError, match=r"qaic options must be a dict .* got list \['fallback'\]"):
        from qaic_dynamo.config import CompilationConfig

        CompilationConfig.from_options(["fallback"])
    f = torch.compile(lambda x: x + 1, backend="qaic", options=["fallback"])
    with pytest.raises(ConfigError, match=r"^qaic options must be a dict"):
        f(torch.randn(3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"options": {"fallbak": "eager"}}, r"^unknown qaic option\(s\) \['fallbak'\]; valid options are: .*fallback"),
        (
            {"options": {"fallback": "sometimes"}},
            r"^qaic option 'fallback' must be one of \['eager', 'error'\], got 'sometimes'",
        ),
        ({"mode": "max-autotune"}, r"^backend 'qaic' has no modes"),
    ],
)
def test_torch_compile_option_errors_come_first_not_as_dynamos(kwargs, message):
    # torch.compile hands options over only at the first call; the error raised there was
    # BackendCompilerFailed("backend='qaic' raised:\nConfigError: ...").
    f = torch.compile(lambda x: x + 1, backend="qaic", **kwargs)
    with pytest.raises(ConfigError, match=message) as caught:
        f(torch.randn(3))
    assert not isinstance(caught.value, torch._dynamo.exc.BackendCompilerFailed)


def test_an_unusable_dump_dir_warns_and_the_compile_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.warns(RuntimeWarning, match=r"could not write the dump of graph \d+ to dump_dir="):
        small_compile(tmp_path / "cache", dump_dir=str(blocker / "dumps"))


def test_export_into_a_file_is_an_export_error(tmp_path):
    from qaic_dynamo.deploy.export import export_for_qaic

    out = tmp_path / "out"
    out.write_text("x")
    with pytest.raises(ExportError, match=f"the output directory {out} cannot be made: {out} is a file"):
        export_for_qaic(llama(2), out, run_compiler=False)


def test_a_reduced_float_piece_says_it_runs_eagerly_and_why(tmp_path):
    m = torch.nn.Linear(16, 16).to(torch.bfloat16)
    f = torch.compile(m, backend="qaic", options={"cache_dir": str(tmp_path)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(torch.randn(4, 16, dtype=torch.bfloat16))
    messages = " ".join(str(w.message) for w in caught)
    assert "ONNX Runtime's CPU kernels have no Gemm for bfloat16: this piece runs eagerly in bfloat16" in messages


def test_every_p90_is_one_definition():
    from qaic_dynamo.deploy.serving import RequestResult, percentile, summarize

    assert percentile([5, 1, 4, 2, 3], 0.9) == 5 and percentile(list(range(1, 11)), 0.9) == 9
    results = [
        RequestResult(i, [1], [1, 2], ttft=t, submitted=0.0, finished=1.0) for i, t in enumerate([5, 1, 4, 2, 3])
    ]
    assert summarize(results)["ttft_p90_s"] == 5
    for script in ("disagg.py", "serving_throughput.py"):  # the benchmarks take the servers' own
        source = (Path(__file__).parents[1] / "benchmarks" / script).read_text()
        assert "from qaic_dynamo.deploy.serving import percentile" in source and "0.9 * (len" not in source


FULL_DISK_CHILD = """
import resource, signal, sys, warnings
import torch, qaic_dynamo
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG (errno 27)
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))  # past it, every write fails
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
x = torch.randn(2, 64)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = torch.compile(m, backend="qaic", options={"cache_dir": sys.argv[1]})(x)
for w in caught:
    if "qaic" in str(w.message):
        print("WARNING", w.message)
print("MATCH", torch.allclose(y, m(x), atol=1e-5))
"""


def test_a_full_disk_compiles_on_and_says_why(tmp_path):
    # Was: BackendCompilerFailed: OSError [Errno 27] File too large - the cache fell back
    # to scratch space on the same full disk, whose write failed again and escaped.
    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK_CHILD, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (
        "is not usable (cannot write: [Errno 27] File too large); compiling without the persistent cache" in out.stdout
    )
    assert "runs eagerly: no room to write its artifact, in the disk cache or in scratch space" in out.stdout
    assert "MATCH True" in out.stdout
