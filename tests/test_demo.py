"""The demo command runs end to end and reports honestly (small model, smoke only)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize("model", ["llama", "mla"])
def test_demo_runs_and_matches_eager(model):
    proc = subprocess.run(
        [sys.executable, "-m", "qaic_dynamo", "demo", "--model", model, "--layers", "3", "--hidden-size", "64",
         "--max-new-tokens", "3"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = dict(re.findall(r"^  (\S.*?)\s{2,}(\S.*)$", proc.stdout, re.M))
    assert rows["layers"] == "3"
    assert rows["unique pieces compiled"] == "3"
    assert rows["pieces reused"] == "1"  # 4 compilable pieces: first, 2 middle, last
    assert rows["eager fallbacks"] == "0"
    assert rows["greedy tokens identical"] == "yes"
    assert "3 pieces loaded from disk, 0 exports" in rows["restart, persistent cache (s)"]
    assert float(rows["max |logit - eager logit|"]) < 1e-3
