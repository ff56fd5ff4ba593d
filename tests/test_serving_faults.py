"""Faults a disaggregated server meets every day (issue 38): its parent killed or
stopped, its decode worker killed, sizes too large for shared memory, and a script
without the ``__main__`` guard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from test_serving import CTX, eager_tokens, llama, shm_segments

from qaic_dynamo.deploy.serving import DisaggregatedServer
from qaic_dynamo.deploy.serving.shm import SHM_PREFIX

SERVER_SCRIPT = """
import json, sys, torch
from qaic_dynamo.deploy.serving import DisaggregatedServer
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM

def main():
    torch.manual_seed(0)
    model = QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256)).eval()
    with DisaggregatedServer(model, decode_slots=2, ctx_len=128, chunk_size=8, backend="eager",
                             chunk_delay=0.05) as server:
        print(json.dumps({"workers": [server._prefill.pid, server._decode.pid],
                          "segments": server.buffers.segment_names}), flush=True)
        server.generate([[7] * 100] * 4, 20)  # long enough to be killed in the middle

if __name__ == "__main__":
    main()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its new parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def start_script(tmp_path: Path, source: str, *args: str) -> subprocess.Popen:
    script = tmp_path / "server.py"
    script.write_text(source)
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_gone(pids: list[int], segments: list[str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) or any(Path("/dev/shm", s).exists() for s in segments):
        assert time.monotonic() < deadline, (
            f"after {seconds} s: workers alive {[p for p in pids if alive(p)]}, "
            f"segments left {[s for s in segments if Path('/dev/shm', s).exists()]}"
        )
        time.sleep(0.05)


def test_a_sigkilled_parent_leaves_no_worker_and_no_segment(tmp_path):
    proc = start_script(tmp_path, SERVER_SCRIPT)
    info = json.loads(proc.stdout.readline())
    time.sleep(0.5)  # serving
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    t0 = time.monotonic()
    wait_gone(info["workers"], info["segments"], 5)
    assert time.monotonic() - t0 < 2.5  # the workers notice within 2 s (the sentinel wakes them at once)
    err = proc.stderr.read() + proc.stdout.read()
    assert "is gone; its workers exit and its shared memory is released" in err
    # (A SIGKILLed server leaves its queues' semaphores to the resource tracker, which says so
    # and removes them; its shared memory the workers unlinked and unregistered.)
    assert "leaked shared_memory" not in err


@pytest.mark.parametrize(
    "sig, after",
    [(signal.SIGTERM, 3.0), (signal.SIGINT, 3.0), (signal.SIGINT, 0.0)],  # 0: workers still importing
)
def test_the_cli_stops_cleanly_on_sigterm_and_sigint_with_one_line(tmp_path, sig, after):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(" ".join(["7"] * 120) for _ in range(6)) + "\n")
    cli = "import sys\nfrom qaic_dynamo.cli import main\nif __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n"
    proc = start_script(
        tmp_path,
        cli,
        "serve-disagg",
        "--model",
        "llama",
        "--layers",
        "2",
        "--hidden-size",
        "64",
        "--prompts",
        str(prompts),
        "--ctx-len",
        "256",
        "--chunk-size",
        "8",
        "--decode-slots",
        "2",
        "--backend",
        "eager",
        "--max-tokens",
        "60",
    )
    assert "starting prefill and decode workers" in proc.stdout.readline()
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while len(workers) < 2:  # both spawned (their parent is the CLI)
        assert time.monotonic() < deadline
        out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        workers = [int(p) for p in out if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        time.sleep(0.1)
    time.sleep(after)  # serving, or (0) still starting
    segments = [p.name for p in Path("/dev/shm").glob(f"{SHM_PREFIX}{proc.pid}_*")]
    assert segments  # made before the workers start
    os.killpg(proc.pid, sig) if sig == signal.SIGINT else os.kill(proc.pid, sig)  # Ctrl-C reaches the group
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig.value, (proc.returncode, err[-2000:])
    lines = [ln for ln in err.splitlines() if ln.strip() and "requests:" not in ln]  # tqdm's bar aside
    assert lines == [f"qaic-dynamo serve-disagg: stopped by {sig.name}; workers ended, shared memory released"], err
    wait_gone(workers, segments, 5)


def generate_killing_after_three_finish(server, prompts, max_tokens, pids):
    """``server.generate``, SIGKILLing the processes ``pids()`` names once three requests
    have finished."""

    def killer():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if sum(r.finished is not None for r in server.results.values()) >= 3:
                for pid in pids():
                    os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    t = threading.Thread(target=killer)
    t.start()
    results = server.generate(prompts, max_tokens)
    t.join()
    return results


def test_a_killed_decode_worker_loses_no_finished_result_and_the_server_restarts():
    model = llama(2)
    prompts = [[3] * 4, [4] * 5, [5] * 6, [6] * 150, [7] * 150, [8] * 3]
    max_tokens = [2, 3, 2, 40, 40, 4]
    with DisaggregatedServer(model, decode_slots=2, ctx_len=CTX, chunk_size=8, backend="eager", chunk_delay=0.02) as s:
        results = generate_killing_after_three_finish(s, prompts, max_tokens, lambda: [s._decode.pid])
        want = eager_tokens(model, prompts, max_tokens)
        done = [i for i, r in enumerate(results) if r.error is None]
        assert len(done) >= 3 and all(results[i].token_ids == want[i] for i in done)
        failed = [r for r in results if r.error is not None]
        assert failed and all("the decode worker died (exit code -9)" in r.error for r in failed)
        with pytest.raises(RuntimeError, match=r"the decode worker died \(exit code -9\); stop\(\) and start\(\)"):
            s.generate([[1, 2]], 2)
        s.stop()
        s.start()
        again = s.generate(prompts[:2], max_tokens[:2])
        assert [r.token_ids for r in again] == want[:2]


def test_sizes_are_checked_before_any_shared_memory_is_made():
    from transformers import LlamaConfig

    from qaic_dynamo.models import hf_model_from_config

    before = shm_segments()
    small = hf_model_from_config(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
    )
    with pytest.raises(ValueError, match=r"ctx_len=64 exceeds the model's max_position_embeddings=32"):
        DisaggregatedServer(small, ctx_len=64, backend="eager").start()
    # 2**28 positions: 64 GiB of KV, more than /dev/shm holds; refused by size, naming ctx_len.
    with pytest.raises(ValueError, match=r"need .* MiB of shared memory \(ctx_len=268435456 x decode_slots=4"):
        DisaggregatedServer(llama(2), ctx_len=2**28, backend="eager").start()
    assert shm_segments() == before


def test_a_script_without_the_main_guard_gets_one_clear_error(tmp_path):
    unguarded = textwrap.dedent(
        """
        import torch
        from qaic_dynamo.deploy.serving import DisaggregatedServer
        from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM
        model = QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256)).eval()
        with DisaggregatedServer(model, decode_slots=1, ctx_len=64, backend="eager") as server:
            print(server.generate([[1, 2, 3]], 2))
        """
    )
    proc = start_script(tmp_path, unguarded)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert 'without an `if __name__ == "__main__":` guard' in err and "server.py (line 7)" in err
    assert "spawn_main" not in err and "freeze_support" not in err  # no worker ever started
    assert err.count("Traceback") == 1  # the parent's own, ending in the message


def test_both_workers_dying_still_returns_the_finished_results():
    """The dead prefill worker was handled first: its restart waited for a sync from the
    dead decode worker and generate raised, losing what had finished."""
    model = llama(2)
    prompts = [[3] * 4, [4] * 5, [5] * 6, [6] * 150, [7] * 150]
    max_tokens = [2, 3, 2, 40, 40]
    with DisaggregatedServer(model, decode_slots=2, ctx_len=CTX, chunk_size=8, backend="eager", chunk_delay=0.02) as s:
        results = generate_killing_after_three_finish(s, prompts, max_tokens, lambda: [s.prefill_pid, s._decode.pid])
    want = eager_tokens(model, prompts, max_tokens)
    done = [i for i, r in enumerate(results) if r.error is None]
    assert len(done) >= 3 and all(results[i].token_ids == want[i] for i in done)
    assert all("decode worker died" in r.error for r in results if r.error is not None)
