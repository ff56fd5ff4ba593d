"""The backend's configuration: one frozen dataclass, built from ``torch.compile`` options.

``torch.compile(model, backend="qaic", options={...})`` hands the options dict to
:meth:`CompilationConfig.from_options`, which rejects unknown keys (listing the valid
ones) and bad values (listing the valid values). Environment variables are read here and
nowhere else, in :func:`_environment_defaults`; an explicit option wins over the
environment.

``compute_hash()`` covers exactly the fields that change a compiled artifact, so it is
part of every piece's fingerprint: two configs that would produce different ONNX never
share a cache entry, and configs that differ only in, say, ``dump_dir`` do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from qaic_dynamo.errors import ConfigError
from qaic_dynamo.ops import splitting_ops

__all__ = [
    "DEFAULT_SPLITTING_OPS",
    "OPSETS",
    "CompilationConfig",
    "ConfigError",
    "default_cache_dir",
    "qaic_compiler_path",
]

#: The op registry's splitting ops (attention).
DEFAULT_SPLITTING_OPS: tuple[str, ...] = splitting_ops()
RUNTIMES = ("onnxruntime", "qaic")
FALLBACKS = ("eager", "error")
REGION_DISPATCHES = ("guarded", "dynamo")
#: Opsets the lowering emits. onnxscript's torch library translates to opset 18; a newer
#: opset would need onnxscript's version converter, which inlines every function - the
#: qaic functions (KVCacheScatter) the QAIC compiler must see whole included. Translating
#: with a registry of a newer opset instead picks newer ops (Gelu-20) under an opset-18
#: import: a model the checker refuses.
OPSETS = (18,)


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class CompilationConfig:
    splitting_ops: tuple[str, ...] = field(
        default=DEFAULT_SPLITTING_OPS,
        metadata=_doc(
            "Ops at which the graph is split, as 'namespace::name' (e.g. "
            "'qaic::unified_attention', 'aten::scaled_dot_product_attention'). They run "
            "eagerly between compiled pieces. Empty: the whole graph is one piece."
        ),
    )
    runtime: str = field(
        default="onnxruntime",
        metadata=_doc(
            "'onnxruntime' runs pieces with ONNX Runtime; 'qaic' compiles them with "
            "qaic-compile (needs the Qualcomm SDK in /opt/qti-aic)."
        ),
    )
    opset: int = field(default=18, metadata=_doc("ONNX opset of the lowered pieces: 18 (see OPSETS)."))
    fallback: str = field(
        default="eager",
        metadata=_doc(
            "What to do with a piece that cannot be lowered or run: 'eager' runs it with "
            "PyTorch (counted, warned once), 'error' raises."
        ),
    )
    dump_dir: str | None = field(
        default=None,
        metadata=_doc(
            "Directory to write each unique piece's .onnx, readable FX code and a summary "
            "JSON to. Default: $QAIC_DYNAMO_DUMP_DIR, else nothing is dumped."
        ),
    )
    num_threads: int | None = field(
        default=None,
        metadata=_doc("ONNX Runtime intra-op threads. Default: torch.get_num_threads()."),
    )
    release_openmp_workers: bool = field(
        default=True,
        metadata=_doc(
            "Before each ONNX Runtime run, release PyTorch's OpenMP worker threads: after a "
            "parallel region they spin for milliseconds and share the cores with ONNX "
            "Runtime's threads (runtime.release_openmp_workers)."
        ),
    )
    region_dispatch: str = field(
        default="guarded",
        metadata=_doc(
            "How qaic_dynamo.compile's repeated blocks are called once compiled: 'guarded' "
            "checks Dynamo's own guards for the block and runs its compiled code directly "
            "(saves Dynamo's per-call entry on every layer and step); 'dynamo' "
            "enters through torch.compile's wrapper on every call. Whole-model compiles "
            "ignore it."
        ),
    )
    precompile: bool = field(
        default=True,
        metadata=_doc(
            "qaic_dynamo.compile saves each region's Dynamo trace in the persistent cache "
            "(Dynamo's aot_compile) and a restart loads it instead of tracing; the guards "
            "Dynamo cannot save, and the source files the trace read, are re-checked before "
            "a saved trace runs. Needs cache=True and region_dispatch='guarded'."
        ),
    )
    cache: bool = field(
        default=True,
        metadata=_doc(
            "Keep compiled artifacts on disk so a later process skips their export. "
            "QAIC_DYNAMO_DISABLE_CACHE=1 turns it off."
        ),
    )
    cache_dir: str | None = field(
        default=None,
        metadata=_doc(
            "Root of the persistent cache. Default: $QAIC_DYNAMO_CACHE_DIR, else "
            "$XDG_CACHE_HOME/qaic_dynamo, else ~/.cache/qaic_dynamo."
        ),
    )
    cache_size_limit: int = field(
        default=5 * 2**30,
        metadata=_doc("Bytes the persistent cache may hold; least recently used entries are evicted past it."),
    )
    progress: bool = field(
        default=False,
        metadata=_doc("Show a progress bar over the pieces while a graph compiles (tqdm, on stderr)."),
    )

    #: Fields that change what a piece compiles to; everything else is runtime behaviour.
    ARTIFACT_FIELDS = ("opset", "runtime")

    def __post_init__(self) -> None:
        if isinstance(self.splitting_ops, str) or not all(isinstance(s, str) for s in self.splitting_ops):
            raise ConfigError(
                "qaic option 'splitting_ops' must be a list of op names like "
                f"'qaic::unified_attention', got {self.splitting_ops!r}"
            )
        object.__setattr__(self, "splitting_ops", tuple(self.splitting_ops))
        # Integers of any kind (numpy's too) become int, so that equal configs hash alike;
        # a float such as 18.0 is refused below rather than hashed apart from 18.
        for name in ("opset", "num_threads"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))
        for name in self.splitting_ops:
            _check_op_name(name)
        _check_choice("runtime", self.runtime, RUNTIMES)
        _check_choice("fallback", self.fallback, FALLBACKS)
        _check_choice("opset", self.opset, OPSETS)
        _check_choice("region_dispatch", self.region_dispatch, REGION_DISPATCHES)
        if self.num_threads is not None and (
            not isinstance(self.num_threads, int) or isinstance(self.num_threads, bool) or self.num_threads < 1
        ):
            raise ConfigError(f"qaic option 'num_threads' must be a positive int or None, got {self.num_threads!r}")
        if not isinstance(self.release_openmp_workers, bool):
            raise ConfigError(
                f"qaic option 'release_openmp_workers' must be True or False, got {self.release_openmp_workers!r}"
            )
        if not isinstance(self.cache, bool):
            raise ConfigError(f"qaic option 'cache' must be True or False, got {self.cache!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ConfigError(f"qaic option 'cache_dir' must be a path or None, got {self.cache_dir!r}")
        if (
            isinstance(self.cache_size_limit, bool)
            or not isinstance(self.cache_size_limit, int)
            or self.cache_size_limit < 0
        ):
            raise ConfigError(
                f"qaic option 'cache_size_limit' must be a non-negative number of bytes, got {self.cache_size_limit!r}"
            )
        if not isinstance(self.progress, bool):
            raise ConfigError(f"qaic option 'progress' must be True or False, got {self.progress!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ConfigError(f"qaic option 'dump_dir' must be a path or None, got {self.dump_dir!r}")

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None) -> CompilationConfig:
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(
                f"qaic options must be a dict of option name -> value (e.g. {{'fallback': 'error'}}), got "
                f"{type(options).__name__} {options!r}; valid options are: {', '.join(cls.valid_keys())}"
            )
        options = dict(options or {})
        unknown = sorted(set(options) - set(cls.valid_keys()))
        if unknown:
            raise ConfigError(f"unknown qaic option(s) {unknown}; valid options are: {', '.join(cls.valid_keys())}")
        values = {**_environment_defaults(), **options}
        return cls(**values)

    def replace(self, **changes: Any) -> CompilationConfig:
        return dataclasses.replace(self, **changes)

    def artifact_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.ARTIFACT_FIELDS}

    def compute_hash(self) -> str:
        """sha256 of the fields that change an artifact (sorted-key JSON)."""
        blob = json.dumps(self.artifact_fields(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    @classmethod
    def describe(cls) -> str:
        """Every option with its default and documentation (for --help style output)."""
        return "\n".join(f"{f.name} (default {f.default!r}): {f.metadata.get('doc', '')}" for f in fields(cls))

    def resolved_cache_dir(self) -> str:
        """The cache root, absolute: the option, else the environment's choice (see
        cache_dir). A relative one is taken from the current directory now, so a later
        ``chdir`` does not move a cache that is in use."""
        root = str(self.cache_dir) if self.cache_dir is not None else default_cache_dir()
        return os.path.abspath(os.path.expanduser(root))


def default_cache_dir() -> str:
    """$QAIC_DYNAMO_CACHE_DIR, else $XDG_CACHE_HOME/qaic_dynamo, else ~/.cache/qaic_dynamo."""
    if os.environ.get("QAIC_DYNAMO_CACHE_DIR"):
        return os.environ["QAIC_DYNAMO_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "qaic_dynamo")


def qaic_compiler_path() -> Path:
    """The qaic-compile binary: $QAIC_COMPILER, else the SDK's /opt/qti-aic/exec/qaic-compile."""
    return Path(os.environ.get("QAIC_COMPILER") or "/opt/qti-aic/exec/qaic-compile")


def _environment_defaults() -> dict[str, Any]:
    """The one place environment variables are read (with default_cache_dir and
    qaic_compiler_path)."""
    env: dict[str, Any] = {}
    if os.environ.get("QAIC_DYNAMO_DUMP_DIR"):
        env["dump_dir"] = os.environ["QAIC_DYNAMO_DUMP_DIR"]
    if os.environ.get("QAIC_DYNAMO_FALLBACK"):
        env["fallback"] = os.environ["QAIC_DYNAMO_FALLBACK"]
    if os.environ.get("QAIC_DYNAMO_DISABLE_CACHE", "").strip().lower() in ("1", "true", "yes", "on"):
        env["cache"] = False
    return env


def _check_choice(key: str, value: Any, valid: tuple) -> None:
    # isinstance, not equality alone: 18.0 == 18 but would hash apart (a str enum is a str).
    if isinstance(value, bool) or not isinstance(value, type(valid[0])) or value not in valid:
        raise ConfigError(f"qaic option {key!r} must be one of {list(valid)}, got {value!r}")


def _check_op_name(name: str) -> None:
    import torch

    ns, sep, op = name.partition("::")
    packet = getattr(getattr(torch.ops, ns, None), op, None) if sep and ns and op else None
    if packet is None:
        raise ConfigError(
            f"qaic option 'splitting_ops': {name!r} is not a registered op; use "
            f"'namespace::name', e.g. {list(DEFAULT_SPLITTING_OPS) + ['aten::scaled_dot_product_attention']}"
        )
    for overload in packet.overloads():
        # Keyword-only written arguments are the ``out=`` variants every aten op has; the
        # op itself is functional.
        written = [
            a.name
            for a in getattr(packet, overload)._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and not a.kwarg_only
        ]
        if written:
            # A piece's outputs are the artifact's own tensors, not views of its inputs or
            # of each other: a write into one would not reach the tensor it was cut from.
            raise ConfigError(
                f"qaic option 'splitting_ops': {name!r} writes its argument(s) {written} in place; a splitting op "
                "must return its result (e.g. attention that returns its output rather than filling an 'output' "
                "argument)"
            )
