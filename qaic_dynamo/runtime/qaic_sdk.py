"""Compile an artifact with the Qualcomm Cloud AI SDK's ``qaic-compile``.

One command builder serves the backend (``runtime="qaic"``: each new artifact is also
compiled into ``<artifact>/qpc``) and the deployment export (which writes the command
beside the model, and runs it where the SDK is installed), so both follow QEfficient's
flags the same way.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from qaic_dynamo.config import qaic_compiler_path
from qaic_dynamo.errors import QaicCompileError

__all__ = [
    "HW_VERSIONS",
    "QAIC_COMPILE_OWN_FLAGS",
    "extra_flag_problem",
    "qaic_compile",
    "qaic_compile_command",
    "qaic_sdk_available",
]


#: The qaic-compile flags :func:`qaic_compile_command` sets itself, and the argument of
#: its own that sets each (None: always set as shown).
QAIC_COMPILE_OWN_FLAGS: dict[str, str | None] = {
    "-aic-hw": None,
    "-aic-hw-version": "hw_version",
    "-m": None,
    "-retained-state": None,
    "-convert-to-fp16": "convert_to_fp16",
    "-mdp-load-partition-config": "mdp_partition_config",
    "-aic-num-cores": "num_cores",
    "-custom-IO-list-file": "custom_io",
    "-network-specialization-config": "specializations",
    "-aic-binary-dir": "out_dir",
}


_OPTION_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def extra_flag_problem(extra: Any) -> str | None:
    """Why ``extra`` options cannot go on the command, or None: not a dict, a key that is
    not an option name (``-x``, ``a=b``: it would become ``--x``, slipping past the check
    for flags the command sets itself), or a flag the command sets itself."""
    if not isinstance(extra, dict):
        return (
            f"compiler options must be a dict of option names to values (e.g. {{'mxfp6_matmul': True}}), got "
            f"{type(extra).__name__} {extra!r}"
        )
    bad = [k for k in extra if not isinstance(k, str) or not _OPTION_KEY.fullmatch(k)]
    if bad:
        return (
            f"compiler option names must be letters, digits, '_' and '-', without the leading dash (key_name=v "
            f"becomes -key-name=v), got {bad}"
        )
    own = {flag.lower(): (flag, arg) for flag, arg in QAIC_COMPILE_OWN_FLAGS.items()}
    clashes = [own[("-" + k.replace("_", "-")).lower()] for k in extra if ("-" + k.replace("_", "-")).lower() in own]
    if not clashes:
        return None
    said = ", ".join(f"{flag} (set by {arg})" if arg else f"{flag} (always set)" for flag, arg in clashes)
    return (
        f"compiler options repeat flags the qaic-compile command sets itself: {said}; pass num_cores= for the "
        "cores, and leave the others to the command"
    )


#: The card generations ``-aic-hw-version`` takes.
HW_VERSIONS = ("ai100", "ai200")


def qaic_compile_command(
    model: Path,
    out_dir: Path,
    num_cores: int = 16,
    custom_io: Path | None = None,
    specializations: Path | None = None,
    extra: dict[str, Any] | None = None,
    compiler: Path | None = None,
    hw_version: str = "ai100",
    convert_to_fp16: bool = True,
    mdp_partition_config: Path | None = None,
) -> list[str]:
    """The ``qaic-compile`` command line for the ONNX ``model`` (QEfficient's conventions);
    the deployment export builds its command here too.

    ``extra`` maps ``key_name=value`` to ``-key-name=value``; ``True`` gives a bare flag.
    A flag this command sets itself (:data:`QAIC_COMPILE_OWN_FLAGS`) is refused there: a
    second ``-aic-num-cores`` or ``-aic-binary-dir`` would silently win or lose (see
    :func:`extra_flag_problem`).
    ``compiler``: default ``$QAIC_COMPILER`` or the SDK's path. ``hw_version``: the card
    generation, ``ai100`` or ``ai200``. ``convert_to_fp16``: float32 becomes float16 on
    the card (not for a bfloat16 model). ``mdp_partition_config``: the tensor-slicing
    partition of a model over several devices.
    """
    problem = extra_flag_problem(extra if extra is not None else {})
    if problem:
        raise ValueError(problem)
    if hw_version not in HW_VERSIONS:
        raise ValueError(f"hw_version must be one of {list(HW_VERSIONS)}, got {hw_version!r}")
    cmd = [
        str(compiler or qaic_compiler_path()),
        "-aic-hw",
        f"-aic-hw-version={hw_version}",
        f"-m={model}",
        "-retained-state",
    ]
    if convert_to_fp16:
        cmd.append("-convert-to-fp16")
    cmd.append(f"-aic-num-cores={num_cores}")
    if mdp_partition_config is not None:
        cmd.append(f"-mdp-load-partition-config={mdp_partition_config}")
    if custom_io is not None:
        cmd.append(f"-custom-IO-list-file={custom_io}")
    if specializations is not None:
        cmd.append(f"-network-specialization-config={specializations}")
    for key, value in (extra or {}).items():
        flag = "-" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False and value is not None:
            cmd.append(f"{flag}={value}")
    cmd.append(f"-aic-binary-dir={out_dir}")
    return cmd


def qaic_sdk_available() -> bool:
    path = qaic_compiler_path()
    return (path.exists() and os.access(path, os.X_OK)) or shutil.which("qaic-compile") is not None


def qaic_compile(model: Path, out_dir: Path, **kwargs: Any) -> Path:
    """Compile the ONNX ``model`` with the Qualcomm SDK into ``out_dir`` (a QPC directory)."""
    if not qaic_sdk_available():
        raise QaicCompileError(
            f"runtime='qaic' needs the Qualcomm Cloud AI SDK ({qaic_compiler_path()} not found); "
            "install it, or use runtime='onnxruntime'"
        )
    cmd = qaic_compile_command(model, out_dir, **kwargs)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise QaicCompileError(f"qaic-compile failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return out_dir
