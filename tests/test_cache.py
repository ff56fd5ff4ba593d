"""The persistent compile cache: warm starts, invalidation, damage, concurrency, eviction."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import Driver

from qaic_dynamo import compilation_counter
from qaic_dynamo.cache import DiskCache, artifact_cache
from qaic_dynamo.config import CompilationConfig
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM

HERE = Path(__file__).parent
PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43]]


def child(cache_dir, *args):
    proc = subprocess.run(
        [sys.executable, str(HERE / "cache_child.py"), str(cache_dir), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def entries(root):
    return sorted(p.parent.name for p in Path(root).glob("v1/??/*/meta.json"))


def leftovers(root):
    tmp = Path(root) / "v1" / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.exists() else []


def compile_once(cache_dir, layers=3, **options):
    """Compile and run in this process, as a fresh start (no Dynamo or memory state)."""
    torch._dynamo.reset()
    artifact_cache.clear_memory()
    torch.manual_seed(0)
    model = QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=layers)).eval()
    compiled = torch.compile(model, backend="qaic", options={"cache_dir": str(cache_dir), **options})
    with torch.no_grad():
        out = Driver(model, PROMPTS).step(compiled, PROMPTS)
        ref = Driver(model, PROMPTS).step(model, PROMPTS)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    return out


def test_cold_then_warm_in_fresh_processes(tmp_path):
    cold = child(tmp_path)
    warm = child(tmp_path)
    assert (cold["num_onnx_exports"], cold["num_disk_cache_writes"], cold["num_disk_cache_hits"]) == (3, 3, 0)
    assert (warm["num_onnx_exports"], warm["num_backend_compilations"], warm["num_disk_cache_hits"]) == (0, 0, 3)
    assert warm["logits_sha256"] == cold["logits_sha256"], "a warm start gives the cold start's outputs"
    assert warm["max_diff_vs_eager"] < 1e-4
    assert len(entries(tmp_path)) == 3 and not leftovers(tmp_path)
    stats = DiskCache(tmp_path, 1 << 30).last_run()
    assert stats is not None and (stats["hits"], stats["misses"]) == (3, 0), stats


def test_config_change_misses(tmp_path, monkeypatch):
    compile_once(tmp_path)
    # Of the artifact fields, opset has one valid value and runtime="qaic" needs the SDK:
    # make num_threads one for this check, as a new artifact field would be.
    monkeypatch.setattr(CompilationConfig, "ARTIFACT_FIELDS", (*CompilationConfig.ARTIFACT_FIELDS, "num_threads"))
    with compilation_counter.expect(num_onnx_exports=3, num_disk_cache_hits=0, num_disk_cache_writes=3):
        compile_once(tmp_path, num_threads=1)  # a field in the config hash
    with compilation_counter.expect(num_onnx_exports=0, num_disk_cache_hits=3):
        compile_once(tmp_path, dump_dir=str(tmp_path / "dump"), num_threads=1)  # not an artifact field: hits
    assert len(entries(tmp_path)) == 6


def test_library_version_change_misses(tmp_path, monkeypatch):
    from qaic_dynamo.compiler import fingerprint

    compile_once(tmp_path)
    bumped = dict(fingerprint.library_versions(), onnxruntime="99.0")
    monkeypatch.setattr(fingerprint, "library_versions", lambda: bumped)
    with compilation_counter.expect(num_onnx_exports=3, num_disk_cache_hits=0):
        compile_once(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta", "no-meta", "meta-shape", "meta-of-another-key"])
def test_damaged_entry_is_detected_replaced_and_logged_once(tmp_path, damage, caplog):
    """Each kind of damage is a miss that replaces the entry: no crash (a meta.json of
    another shape raised TypeError), and no disabled disk cache (an entry without
    meta.json blocked its own replacement, which then turned the disk cache off)."""
    compile_once(tmp_path)
    victim = Path(tmp_path, "v1", entries(tmp_path)[0][:2], entries(tmp_path)[0])
    other = Path(tmp_path, "v1", entries(tmp_path)[1][:2], entries(tmp_path)[1])
    model = victim / "model.onnx"
    if damage == "truncate":
        model.write_bytes(model.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(model.read_bytes())
        data[len(data) // 2] ^= 0xFF
        model.write_bytes(bytes(data))
    elif damage == "meta":
        (victim / "meta.json").write_text("{not json")
    elif damage == "no-meta":
        (victim / "meta.json").unlink()
    elif damage == "meta-shape":
        (victim / "meta.json").write_text(json.dumps({"files": {"layout.json": 5}}))
    else:
        (victim / "meta.json").write_text((other / "meta.json").read_text())
    with compilation_counter.expect(num_onnx_exports=1, num_disk_cache_hits=2, num_disk_cache_writes=1):
        compile_once(tmp_path)
    assert sum("is damaged" in r.message for r in caplog.records) == 1
    assert DiskCache(tmp_path, 1 << 30).lookup(victim.name) is not None, "replaced by a valid entry"
    assert len(entries(tmp_path)) == 3 and not leftovers(tmp_path)


def test_unwritable_cache_degrades_with_one_warning(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    pattern = "compile cache at .* is not usable.*compiling without the persistent cache"
    with pytest.warns(RuntimeWarning, match=pattern) as record:
        with compilation_counter.expect(num_onnx_exports=3, num_disk_cache_writes=0):
            compile_once(blocker / "cache")
    assert len([w for w in record if re.search(pattern, str(w.message))]) == 1  # not one per piece


def test_full_disk_degrades_with_one_warning(tmp_path, monkeypatch):
    real_rename = os.rename

    def no_space(src, dst):
        if "v1" in str(dst):
            raise OSError(28, "No space left on device")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", no_space)
    from qaic_dynamo.cache import disk as cache_stage

    at_exit = []
    monkeypatch.setattr(
        cache_stage, "_at_exit_of_this_process", lambda fn, *args, **kwargs: at_exit.append(args[0] if args else fn)
    )
    with pytest.warns(RuntimeWarning, match="No space left on device") as record:
        compile_once(tmp_path)
    assert entries(tmp_path) == []
    assert len([w for w in record if "No space left on device" in str(w.message)]) == 1  # not one per piece
    # The first piece's private copy serves this process, then goes with it (it stayed,
    # keeping the disk full); the cache is off for the pieces after it.
    assert len(leftovers(tmp_path)) == 1
    assert sorted(p.name for p in at_exit if isinstance(p, Path) and p.parent == tmp_path / "v1" / "tmp") == leftovers(
        tmp_path
    )


def test_the_tmp_sweep_keeps_a_live_writers_entry_and_removes_a_dead_ones(tmp_path):
    """A qaic-compile that ran over an hour without touching its directory's own mtime had
    that directory swept from under it by the next process that wrote an entry. Liveness
    is a writer lock, not a pid (a container with its own pid namespace looked dead)."""
    import fcntl

    from qaic_dynamo.cache import STALE_TMP_SECONDS

    tmp, locks = tmp_path / "v1" / "tmp", tmp_path / "v1" / "locks"
    tmp.mkdir(parents=True)
    locks.mkdir()
    live, dead = "1" * 16, "2" * 16
    held = os.open(locks / f"writer-{live}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # a writer that lives (here: this test)
    (locks / f"writer-{dead}.lock").touch()  # its process exited: the kernel released the lock
    names = {
        "live_old": f"{'a' * 12}-w{live}-00000000",  # a compile running for two hours
        "dead_new": f"{'b' * 12}-w{dead}-00000000",  # killed a moment ago
        "no_lock_file": f"{'c' * 12}-w{'3' * 16}-00000000",
        "older_name_old": f"{'d' * 12}-4242-00000000",  # no writer lock to ask: by age
        "older_name_new": f"{'e' * 12}-4242-00000001",
        "trash_old": f"trash-{'f' * 12}-00000000",
    }
    old = time.time() - 2 * STALE_TMP_SECONDS
    for key, name in names.items():
        (tmp / name).mkdir()
        if key.endswith("_old"):
            os.utime(tmp / name, (old, old))
    try:
        new = DiskCache(tmp_path, 1 << 30).new_tmp_dir("f" * 64)
        assert leftovers(tmp_path) == sorted([names["live_old"], names["older_name_new"], new.name])
        assert sorted(p.name for p in locks.iterdir()) == sorted(
            [f"writer-{live}.lock", f"writer-{new.name.split('-w')[1][:16]}.lock"]
        )  # the dead writers' went too
        # this process's own entry is live to another sweep
        DiskCache(tmp_path, 1 << 30).new_tmp_dir("e" * 64)
        assert new.is_dir()
    finally:
        os.close(held)


def test_a_writer_whose_lock_file_was_cleared_takes_a_new_one(tmp_path):
    """``qaic-dynamo cache clear`` removed a live process's lock file: its lock then
    protected nothing, and the next writer's sweep removed that process's entries."""
    from qaic_dynamo.cache.disk import _try_flock

    disk = DiskCache(tmp_path, 1 << 30)
    first = disk.new_tmp_dir("a" * 64).name.split("-w")[1][:16]
    DiskCache(tmp_path, 1 << 30).clear()
    entry = disk.new_tmp_dir("b" * 64)
    token = entry.name.split("-w")[1][:16]
    assert token != first
    assert _try_flock(tmp_path / "v1" / "locks" / f"writer-{token}.lock") is None  # held: the entry is safe
    DiskCache(tmp_path, 1 << 30).new_tmp_dir("c" * 64)  # another writer's sweep
    assert entry.is_dir()


def test_the_sweep_removes_old_lock_files_of_writers_that_are_gone(tmp_path):
    """A process killed (or stopped by SIGTERM: no exit handlers) left its lock file for good."""
    import fcntl

    from qaic_dynamo.cache import STALE_TMP_SECONDS

    locks = tmp_path / "v1" / "locks"
    locks.mkdir(parents=True)
    gone, live, fresh = (locks / f"writer-{c * 16}.lock" for c in "123")
    for f in (gone, live, fresh):
        f.touch()
    old = time.time() - 2 * STALE_TMP_SECONDS
    for f in (gone, live):
        os.utime(f, (old, old))
    held = os.open(live, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        mine = DiskCache(tmp_path, 1 << 30).new_tmp_dir("d" * 64).name.split("-w")[1][:16]
        assert sorted(p.name for p in locks.iterdir()) == sorted([live.name, fresh.name, f"writer-{mine}.lock"])
    finally:
        os.close(held)


def test_last_run_leaves_no_partial_file_on_a_full_disk(tmp_path, monkeypatch):
    disk = DiskCache(tmp_path, 1 << 30)
    disk.hits = 1

    def no_space(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    disk.write_last_run()
    assert list((tmp_path / "v1").glob(".last_run.*")) == []  # one per process was left
    blocked = tmp_path / "a-file"  # the cache root cannot even be made: nothing escapes the exit handler
    blocked.write_text("")
    unmakeable = DiskCache(blocked / "cache", 1 << 30)
    unmakeable.hits = 1
    unmakeable.write_last_run()


def test_a_disk_that_fills_while_a_piece_is_written_degrades_and_still_compiles(tmp_path, monkeypatch):
    """ENOSPC from writing the model itself into the cache's tmp/ (not only at the commit)."""
    import onnx

    real_save = onnx.save

    def no_space(model, f, *args, **kwargs):
        if str(f).startswith(str(tmp_path)):
            raise OSError(28, "No space left on device", str(f))
        return real_save(model, f, *args, **kwargs)

    monkeypatch.setattr(onnx, "save", no_space)
    with (
        pytest.warns(RuntimeWarning, match="not usable.*No space left on device"),
        compilation_counter.expect(num_backend_compilations=3, num_eager_fallbacks=0, num_disk_cache_writes=0),
    ):
        compile_once(tmp_path)  # compares with eager
    assert entries(tmp_path) == [] and not leftovers(tmp_path)


@pytest.mark.parametrize("when", ["while_lowering", "before_commit", "after_commit"])
def test_an_entry_removed_while_it_compiles_is_compiled_again_not_failed(tmp_path, monkeypatch, when):
    """``qaic-dynamo cache clear`` (or another process's eviction) between lowering and
    loading: the piece ran eagerly for the rest of the process (or raised under
    fallback="error") with "cannot read layout.json"."""
    import qaic_dynamo.compiler.backend as backend

    lower = backend.lower_piece
    commit = DiskCache.commit

    def lower_then_clear(*a, **k):
        lower(*a, **k)
        DiskCache(str(tmp_path), 1 << 30).clear()

    def commit_then_clear(self, key, tmp):
        out = commit(self, key, tmp)
        DiskCache(str(tmp_path), 1 << 30).clear()
        return out

    if when == "while_lowering":
        import onnx

        save = onnx.save

        def clear_then_save(model, f, *args, **kwargs):
            DiskCache(str(tmp_path), 1 << 30).clear()  # the model file's directory is gone
            return save(model, f, *args, **kwargs)

        monkeypatch.setattr(onnx, "save", clear_then_save)
    elif when == "before_commit":
        monkeypatch.setattr(backend, "lower_piece", lower_then_clear)
    else:
        monkeypatch.setattr(DiskCache, "commit", commit_then_clear)
    with compilation_counter.expect(num_backend_compilations=3, num_eager_fallbacks=0):  # first, middle, last
        compile_once(tmp_path, fallback="error")  # compares with eager
    monkeypatch.undo()
    with compilation_counter.expect(num_backend_compilations=3, num_disk_cache_writes=3):
        compile_once(tmp_path)  # the disk cache still works
    assert len(entries(tmp_path)) == 3


def test_disabled_cache_writes_nothing(tmp_path, monkeypatch):
    compile_once(tmp_path, cache=False)
    assert entries(tmp_path) == []
    monkeypatch.setenv("QAIC_DYNAMO_DISABLE_CACHE", "1")
    compile_once(tmp_path)
    assert entries(tmp_path) == []


def test_cache_location_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("QAIC_DYNAMO_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert CompilationConfig().resolved_cache_dir() == str(tmp_path / "home" / ".cache" / "qaic_dynamo")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert CompilationConfig().resolved_cache_dir() == str(tmp_path / "xdg" / "qaic_dynamo")
    monkeypatch.setenv("QAIC_DYNAMO_CACHE_DIR", str(tmp_path / "env"))
    assert CompilationConfig().resolved_cache_dir() == str(tmp_path / "env")
    assert CompilationConfig(cache_dir=str(tmp_path / "opt")).resolved_cache_dir() == str(tmp_path / "opt")
    # Relative roots are taken from the directory they were resolved in: a later chdir
    # must not move a cache in use (entries would be looked up elsewhere).
    monkeypatch.chdir(tmp_path)
    assert CompilationConfig(cache_dir="rel").resolved_cache_dir() == str(tmp_path / "rel")
    monkeypatch.setenv("QAIC_DYNAMO_CACHE_DIR", "envrel")
    assert CompilationConfig().resolved_cache_dir() == str(tmp_path / "envrel")
    monkeypatch.setenv("QAIC_DYNAMO_CACHE_DIR", "~/envhome")  # set without a shell (docker, systemd)
    assert CompilationConfig().resolved_cache_dir() == str(tmp_path / "home" / "envhome")
    assert CompilationConfig(cache_dir="~/opt").resolved_cache_dir() == str(tmp_path / "home" / "opt")


def test_concurrent_writers_leave_one_valid_entry_each(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "cache_child.py"), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert len({r["logits_sha256"] for r in results}) == 1
    assert all(r["max_diff_vs_eager"] < 1e-4 for r in results)
    assert sum(r["num_disk_cache_writes"] for r in results) == 3, "each unique piece written once"
    assert len(entries(tmp_path)) == 3 and not leftovers(tmp_path)
    cache = DiskCache(tmp_path, 1 << 30)
    assert all(cache.lookup(k) is not None for k in entries(tmp_path))


def test_lock_of_a_killed_process_does_not_block(tmp_path, caplog):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from qaic_dynamo.cache import DiskCache\n"
                f"c = DiskCache({str(tmp_path)!r}, 1 << 30)\n"
                "with c.lock('k' * 64):\n"
                "    print('locked', flush=True); time.sleep(600)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    # No wait at all: the kernel released the dead holder's lock. A lock still held would
    # time out at once and log that it compiles anyway.
    with caplog.at_level(logging.WARNING, logger="qaic_dynamo"):
        with DiskCache(tmp_path, 1 << 30).lock("k" * 64, timeout=0):
            pass
    assert "waited" not in caplog.text


def test_lru_eviction_keeps_the_cache_bounded(tmp_path):
    compile_once(tmp_path)
    cache = DiskCache(tmp_path, 1 << 30)
    sizes = {e.key: e.size for e in cache.entries()}
    oldest, *rest = sorted(cache.entries(), key=lambda e: e.last_used)
    # Make one entry clearly the least recently used, then allow all but one.
    os.utime(oldest.path / "meta.json", (1, 1))
    for i, e in enumerate(rest):
        os.utime(e.path / "meta.json", (1000 + i, 1000 + i))
    cache.size_limit = sum(sizes.values()) - 1
    assert cache.evict() == 1
    assert oldest.key not in entries(tmp_path) and len(entries(tmp_path)) == 2


def test_tiny_limit_still_compiles_correctly(tmp_path):
    compile_once(tmp_path, cache_size_limit=1)  # every older entry is evicted as new ones land
    assert len(entries(tmp_path)) == 1


def test_cli_info_list_clear(tmp_path):
    child(tmp_path)

    def cli(*args):
        proc = subprocess.run(
            [sys.executable, "-m", "qaic_dynamo", "cache", *args, "--cache-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    info = cli("info")
    assert f"location  {tmp_path}" in info and "entries   3" in info
    assert "last run  3 misses, 0 hits, 3 written" in info
    listing = cli("list").strip().splitlines()
    assert listing[0].split() == ["key", "size", "created", "last", "used"]
    assert len(listing) == 4 and all(len(line.split()[0]) == 12 for line in listing[1:])
    assert "removed 3 entries" in cli("clear")
    assert entries(tmp_path) == []
