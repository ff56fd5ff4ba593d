"""Build qaic_dynamo and its native op library ``qaic_dynamo._C``.

The extension is compiled against the torch that is already installed, so install with
``pip install --no-build-isolation -e .`` (``make`` does this). There is deliberately no
``[build-system] requires = ["torch"]``: build isolation would download a second, CUDA
build of torch just to compile against it.
"""

import os
from pathlib import Path

from setuptools import find_packages, setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as e:  # pragma: no cover - only hit on a misconfigured machine
    raise SystemExit(
        "qaic_dynamo builds against an installed torch: run `pip install torch==2.13.0` "
        "first, then `pip install --no-build-isolation -e .` (or just `make test`)."
    ) from e

ROOT = Path(__file__).parent
VERSION = "0.1.0"

ext = CppExtension(
    name="qaic_dynamo._C",
    sources=sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp")),
    include_dirs=[str(ROOT / "csrc")],
    # torch's CPU wheel is built with OpenMP; at::parallel_for is inlined into our code
    # and only runs in parallel when we compile with it too. libgomp resolves to the copy
    # torch has already loaded (same soname), so there is one OpenMP runtime.
    # C++20: torch 2.13's own headers use it (bit-field initialisers). -Wno-attributes:
    # torch's bundled pybind11 headers warn about their own lambdas' visibility for every
    # class bound (nothing a user of this package can act on).
    extra_compile_args=["-O3", "-std=c++20", "-fopenmp", "-Wno-attributes"],
    extra_link_args=["-fopenmp"],
)

# `make` compiles the extension in place with ninja (incremental) and then installs the
# package editable for its metadata and entry points; this flag keeps that editable install
# from compiling everything a second time in a throw-away directory.
ext_modules = [] if os.environ.get("QAIC_DYNAMO_SKIP_EXT_BUILD") == "1" else [ext]

setup(
    name="qaic_dynamo",
    version=VERSION,
    description="torch.compile backend and KV-cache op layer for Qualcomm Cloud AI 100 style accelerators",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["qaic_dynamo", "qaic_dynamo.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    # Compatible ranges; requirements*.txt pin the exact versions tested. torch is held to
    # the tested minor release because qaic_dynamo._compat has one adapter per release.
    # Install torch first (CPU build, see the Makefile): with torch already installed this
    # range is met and pip fetches no other build.
    install_requires=[
        "torch>=2.13,<2.14",
        "numpy>=2.0,<3",
        "onnx>=1.23,<2",
        "onnxscript>=0.7.2,<0.8",
        "onnx-ir>=1.1,<2",
        "onnxruntime>=1.31,<2",
        "transformers>=5.23,<6",
        "tokenizers>=0.23,<0.24",
        "sympy>=1.14,<2",
        "safetensors>=0.8,<1",
        "pyyaml>=6,<7",
        "filelock>=4.2,<5",
        "tqdm>=4.70,<5",
        # qaic-dynamo serve: the OpenAI-compatible server
        "fastapi>=0.165,<1",
        "pydantic>=2.14,<3",
        "uvicorn>=0.54,<1",
        "sse-starlette>=3.7,<4",
        "prometheus-client>=0.26,<1",
    ],
    extras_require={
        # Plots of the benchmarks (benchmarks/*.py write PNGs with it).
        "bench": ["matplotlib>=3.11,<4"],
    },
    entry_points={
        "console_scripts": ["qaic-dynamo = qaic_dynamo.cli:main"],
        # torch.compile(backend="qaic") finds the backend here without an import.
        "torch_dynamo_backends": ["qaic = qaic_dynamo.compiler.backend:qaic_backend"],
    },
)
