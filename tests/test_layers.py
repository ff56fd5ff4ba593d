"""The architecture, checked: import layers, the private-API adapter, private names, and
one error hierarchy. Each rule is also shown to fail on a deliberately wrong tree."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import qaic_dynamo
from qaic_dynamo.errors import QaicError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "qaic_dynamo"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed next to {sys.executable}: install requirements-test.txt")
    return str(path)


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run(
        [tool("lint-imports"), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the package's sources and the project's configuration, to break."""
    shutil.copytree(PACKAGE, tmp_path / "qaic_dynamo", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_line(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_the_import_contracts_hold():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize(
    "module, line, contract",
    [
        # A lower stage reaching up the pipeline.
        ("runtime/fallback.py", "from qaic_dynamo.engine import LLM", "a stage imports only the stages below it"),
        (
            "artifact/load.py",
            "from qaic_dynamo.lowering import lower_piece",
            "a stage imports only the stages below it",
        ),
        (
            "ops/registry.py",
            "from qaic_dynamo.config import CompilationConfig",
            "a stage imports only the stages below it",
        ),
        # Siblings kept apart, and the forbidden pairs.
        ("models/llama.py", "from qaic_dynamo.compiler import compile", "a stage imports only the stages below it"),
        ("cache/memory.py", "from qaic_dynamo.lowering import lower_piece", "the cache never imports the lowering"),
        (
            "deploy/serving/session.py",
            "from qaic_dynamo.deploy.export import options",
            "serving never imports the export's internals",
        ),
    ],
)
def test_a_wrong_import_breaks_a_contract(tree, module, line, contract):
    add_line(tree / "qaic_dynamo" / module, line)
    proc = lint_imports(tree)
    assert proc.returncode != 0
    broken = proc.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, proc.stdout


def ruff(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [tool("ruff"), "check", "--no-cache", "--output-format", "concise", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ruff_passes():
    proc = ruff(ROOT, "qaic_dynamo", "tests", "benchmarks")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "line",
    [
        "import torch._dynamo",
        "from torch.onnx._internal.exporter import _core",
        "from torch.fx.experimental.symbolic_shapes import ShapeEnv",
    ],
)
def test_private_torch_names_only_through_the_adapter(tree, line):
    # Inside _compat they are allowed; anywhere else ruff's banned-API rule refuses them.
    add_line(tree / "qaic_dynamo" / "_compat" / "torch_2_13.py", line)
    assert ruff(tree, "--select", "TID251", "qaic_dynamo/_compat").returncode == 0
    add_line(tree / "qaic_dynamo" / "lowering" / "piece.py", line)
    proc = ruff(tree, "--select", "TID251", "qaic_dynamo/lowering/piece.py")
    assert proc.returncode != 0 and "TID251" in proc.stdout, proc.stdout


def private_imports(root: Path) -> list[str]:
    """``from qaic_dynamo.x import _name``: one module reaching into another's private names
    (the native extension ``_C`` and the ``_compat`` package are meant to be imported)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qaic_dynamo"):
                found += [
                    f"{path.relative_to(root)}:{node.lineno} {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and a.name not in ("_C", "_compat")
                ]
    return found


def test_no_module_imports_another_modules_private_names(tree):
    assert private_imports(PACKAGE) == []
    add_line(tree / "qaic_dynamo" / "compiler" / "backend.py", "from qaic_dynamo.cache.disk import _try_flock")
    assert private_imports(tree / "qaic_dynamo") == [
        "compiler/backend.py:"
        + str(len((tree / "qaic_dynamo" / "compiler" / "backend.py").read_text().splitlines()))
        + " _try_flock"
    ]


def exception_classes() -> list[type]:
    classes = []
    for info in pkgutil.walk_packages(qaic_dynamo.__path__, "qaic_dynamo."):
        module = importlib.import_module(info.name)
        classes += [
            c
            for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, BaseException) and c.__module__ == module.__name__
        ]
    return classes


def test_every_exception_class_derives_from_qaic_error():
    classes = exception_classes()
    assert len(classes) >= 10, classes  # the walk found them
    assert [c.__qualname__ for c in classes if not issubclass(c, QaicError)] == []
    # Each is defined in errors.py, the one place to read them all.
    assert {c.__module__ for c in classes} == {"qaic_dynamo.errors"}


def test_errors_keep_the_builtin_callers_catch():
    from qaic_dynamo import errors

    for name in ("ConfigError", "CacheLayoutError", "SamplingParamsError", "ExportError", "KVSliceError"):
        assert issubclass(getattr(errors, name), ValueError), name
    for name in ("LoweringError", "QaicCompileError", "ArtifactError", "PieceRunError"):
        assert issubclass(getattr(errors, name), RuntimeError), name
    assert issubclass(errors.LoweringError, errors.CompileError) and issubclass(
        errors.QaicCompileError, errors.CompileError
    )


def test_no_module_is_longer_than_700_lines():
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 700
    }
    assert long == {}
