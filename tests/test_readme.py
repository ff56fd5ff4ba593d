"""The README's usage example runs as written."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_example_runs(tmp_path):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None, "the README has no python example"
    proc = subprocess.run(
        [sys.executable, "-c", block.group(1)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={"QAIC_DYNAMO_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compilable" in proc.stdout  # the report's table
    tokens = ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # the generated token ids
    assert isinstance(tokens, list) and len(tokens) == 16 and all(isinstance(t, int) for t in tokens)
