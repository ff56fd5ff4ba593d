"""Release PyTorch's OpenMP worker threads before an ONNX Runtime run.

PyTorch's eager kernels run between compiled pieces (attention, above all); after a
parallel region their OpenMP workers keep spinning, and ONNX Runtime's own threads would
share the cores with them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

__all__ = ["release_openmp_workers"]


def _openmp_pause_function() -> Any:
    """``omp_pause_resource_all`` (OpenMP 5.0) of the OpenMP runtime PyTorch loaded, or None.

    Looked up in the library already mapped into this process (PyTorch's wheels ship
    their own ``libgomp``), so it is the runtime whose threads PyTorch uses.
    """
    paths: list[str | None] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.rsplit("/", 1)[-1]
                if name.startswith(("libgomp", "libomp", "libiomp")) and ".so" in name:
                    paths.append(line.split(None, 5)[-1].strip())
    except OSError:  # not Linux: try the process's global symbols
        pass
    # Another package may have mapped its own OpenMP runtime too: PyTorch's comes first.
    torch_lib = str(Path(torch.__file__).parent / "lib")
    paths.sort(key=lambda p: not p.startswith(torch_lib))
    paths.append(None)
    for path in dict.fromkeys(paths):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    return None


_omp_pause = _openmp_pause_function()
_OMP_PAUSE_SOFT = 1


def release_openmp_workers() -> bool:
    """Release the calling thread's OpenMP worker threads before ONNX Runtime runs; True
    if the OpenMP runtime did.

    After a parallel region PyTorch's OpenMP workers keep spinning for milliseconds
    (libgomp's default wait policy), and ONNX Runtime's own threads then share the cores
    with them: a piece right after a parallel eager op (attention, an index) runs markedly
    slower (docs/benchmarks.md, step latency). ``omp_pause_resource_all`` (OpenMP 5.0) ends the
    spinning at once; PyTorch's next parallel region starts fresh threads. It touches
    only the calling thread's team, and is a no-op inside a parallel region or when no
    OpenMP runtime is found. ``OMP_WAIT_POLICY=PASSIVE`` has the same effect but must be
    set before PyTorch is imported.
    """
    return _omp_pause is not None and _omp_pause(_OMP_PAUSE_SOFT) == 0
