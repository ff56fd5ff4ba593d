"""What an export directory says: its model, its options and its specializations.

An export (``export_for_qaic``, or one half of ``export_prefill_decode``) is a directory
with ``export_params.json`` (the options and the model's identity; ``"onnx"`` names the
model relative to it) and ``specializations.json``. :class:`ExportedArtifact` reads them
for whoever runs the artifact - the export's own validation and the disaggregated server -
without importing the exporter. :func:`find_exports` turns what a user points at (a pair
directory, one export, or the output directory above either) into the prefill and decode
export directories.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qaic_dynamo.errors import ExportError

__all__ = ["ExportedArtifact", "find_exports", "specialization_ccls"]

PARAMS_NAME = "export_params.json"
SPECS_NAME = "specializations.json"


def _ccls(specs: list[dict[str, Any]]) -> tuple[list[int] | None, list[int] | None]:
    """The compute-context lengths of the Prefill and Decode specializations (either
    form of ``specializations.json``)."""
    prefill: list[int] = []
    decode: list[int] = []
    for spec in specs:
        symbols = spec.get("symbols", spec)
        if "comp_ctx_lengths" not in symbols:
            continue
        decoding = spec.get("name", "").startswith("Decode") if "name" in spec else symbols.get("seq_len") == "1"
        (decode if decoding else prefill).append(int(symbols["comp_ctx_lengths"]))
    return (sorted(prefill) or None), (sorted(decode) or None)


def specialization_ccls(export_dir: str | os.PathLike) -> tuple[list[int] | None, list[int] | None]:
    """The compute-context lengths of an export's Prefill and Decode specializations, read
    from its ``specializations.json``: (None, None) without CCL or without the file."""
    path = Path(export_dir) / SPECS_NAME
    if not path.is_file():
        return None, None
    return _ccls(json.loads(path.read_text()).get("specializations", []))


@dataclass(frozen=True)
class ExportedArtifact:
    """One export directory, read (see the module docstring)."""

    export_dir: Path
    onnx_path: Path
    #: The export options, as ``export_params.json`` records them (``ExportOptions.as_dict``).
    options: dict[str, Any]
    #: The model's identity (class, config, weights digest): equal for the two halves of a pair.
    model: dict[str, Any]
    #: The exported floating-point dtype ("float32", "float16", "bfloat16").
    dtype: str
    #: The specializations, as written.
    specializations: tuple[dict[str, Any], ...]
    prefill_ccls: list[int] | None
    decode_ccls: list[int] | None

    @classmethod
    def read(cls, export_dir: str | os.PathLike) -> ExportedArtifact:
        d = Path(export_dir).expanduser().absolute()
        params_path, specs_path = d / PARAMS_NAME, d / SPECS_NAME
        if not params_path.is_file() or not specs_path.is_file():
            raise ExportError(
                f"{d} is not an export directory: it lacks {PARAMS_NAME} or {SPECS_NAME} (write one with "
                "export_for_qaic / export_prefill_decode or `qaic-dynamo export`)"
            )
        try:
            params = json.loads(params_path.read_text())
            specs = json.loads(specs_path.read_text())["specializations"]
            onnx_path = (d / params["onnx"]).resolve()
            options, model, dtype = params["options"], params["model"], params["dtype"]["exported"]
        except (ValueError, KeyError, TypeError) as e:
            raise ExportError(f"cannot read the export in {d}: {type(e).__name__}: {e}") from None
        if not onnx_path.is_file():
            raise ExportError(f"the export in {d} names its model {params['onnx']!r}, which is not there ({onnx_path})")
        prefill, decode = _ccls(specs)
        return cls(d, onnx_path, options, model, dtype, tuple(specs), prefill, decode)

    # -- what the options say -------------------------------------------------------------
    @property
    def ctx_len(self) -> int:
        return int(self.options["ctx_len"])

    @property
    def prefill_seq_len(self) -> int:
        return int(self.options["prefill_seq_len"])

    @property
    def batch_size(self) -> int:
        return int(self.options["batch_size"])

    @property
    def full_batch_size(self) -> int | None:
        n = self.options.get("full_batch_size")
        return int(n) if n is not None else None

    @property
    def kv_rows(self) -> int:
        """Rows of the KV cache: full_batch_size with continuous batching, else batch_size."""
        return self.full_batch_size or self.batch_size

    @property
    def kv_cache_prefix(self) -> str | None:
        return self.options.get("kv_cache_prefix")

    @property
    def serves_prefill(self) -> bool:
        """Whether it has a Prefill specialization (prefill_only True or None; with
        prefill_seq_len 1 the one specialization serves both)."""
        return self.options.get("prefill_only") is not False or self.prefill_seq_len == 1

    @property
    def serves_decode(self) -> bool:
        return self.options.get("prefill_only") is not True or self.prefill_seq_len == 1

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt its Prefill specializations hold (the longest prefill CCL,
        which QEfficient's rules can make shorter than ctx_len)."""
        return max(self.prefill_ccls) if self.prefill_ccls else self.ctx_len


def _is_export(d: Path) -> bool:
    return (d / PARAMS_NAME).is_file()


def find_exports(path: str | os.PathLike, decode: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """The prefill and decode export directories of what ``path`` names: two directories
    (``path`` and ``decode``); a pair directory of ``export_prefill_decode`` (``prefill/``
    and ``decode/`` inside); one full export (both roles from it); or the output
    directory holding exactly one of those."""
    p = Path(path).expanduser().absolute()
    if decode is not None:
        return p, Path(decode).expanduser().absolute()
    if not p.is_dir():
        raise ExportError(f"no export directory at {p}")
    if _is_export(p / "prefill") and _is_export(p / "decode"):
        return p / "prefill", p / "decode"
    if _is_export(p):
        return p, p
    found = sorted(
        c
        for c in p.iterdir()
        if c.is_dir() and (_is_export(c) or (_is_export(c / "prefill") and _is_export(c / "decode")))
    )
    if len(found) == 1:
        return find_exports(found[0])
    if not found:
        raise ExportError(
            f"{p} holds no export: point at a pair directory (with prefill/ and decode/), one export "
            f"(with {PARAMS_NAME}), or the output directory above exactly one of them"
        )
    raise ExportError(f"{p} holds {len(found)} exports {[c.name for c in found]}; name one of them")
