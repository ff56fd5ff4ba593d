"""Retained-state names: the one place they are made, for the export and the serving.

:func:`retained_state_names` gives each layer's output names from the op registry's
stems, and :func:`apply_kv_cache_prefix` is the one function that inserts
``kv_cache_prefix`` into a list of names. Every path derives each KV input from its
output (:func:`align_inputs_to_outputs`), so no path can drop the prefix or leave an input
unpaired (the three upstream bugs in QEfficient's layerwise export).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from qaic_dynamo.errors import ExportError
from qaic_dynamo.ops import QAIC_OPS, OpRole

__all__ = [
    "RETAINED_STATE_SUFFIX",
    "align_inputs_to_outputs",
    "apply_kv_cache_prefix",
    "is_kv_retained_state",
    "kv_stems",
    "retained_state_names",
    "validate_kv_cache_prefix",
]

RETAINED_STATE_SUFFIX = "_RetainedState"


def validate_kv_cache_prefix(prefix: Any) -> str | None:
    """``prefix`` if it is a valid ``kv_cache_prefix`` (None: no prefix), else ExportError.

    ASCII letters and digits only, as QEfficient: the prefix sits between ``past_key.{i}`` and
    ``_RetainedState``, so a dot, underscore, dash or space would make names ambiguous."""
    if prefix is None:
        return None
    if not isinstance(prefix, str):
        raise ExportError(f"kv_cache_prefix must be a string, got {type(prefix).__name__} {prefix!r}")
    # ASCII: str.isalnum() also takes letters and digits of other scripts ('é', '²'), which
    # neither the compiler's names nor is_kv_retained_state would read as part of a KV name.
    if not (prefix.isascii() and prefix.isalnum()):
        raise ExportError(
            f"kv_cache_prefix must be a non-empty string of ASCII letters and digits (no dots, underscores, "
            f"dashes, spaces or other scripts), got {prefix!r}; e.g. 'vllm' or 'KV0'"
        )
    if prefix.lower() == RETAINED_STATE_SUFFIX[1:].lower():
        # The inputs would be past_key.{i}_RetainedState: named as the retained-state
        # outputs are, which the compiler and is_kv_retained_state tell apart by that suffix.
        raise ExportError(
            f"kv_cache_prefix {prefix!r} would name the KV inputs like retained-state outputs "
            f"(past_key.0_{prefix}); choose another, e.g. 'vllm' or 'KV0'"
        )
    return prefix


def kv_stems() -> tuple[str, ...]:
    """Every retained-state stem of the registry's KV-cache updates (past_key, ...)."""
    return tuple(
        dict.fromkeys(s for op in QAIC_OPS.values() if op.role is OpRole.KV_CACHE_UPDATE for s in op.retained_state)
    )


def retained_state_names(stems: Sequence[str], layer: int) -> list[str]:
    """The plain retained-state *output* names of one layer's caches
    (``past_key.3_RetainedState``, ...); the prefix, if any, is applied to these by
    :func:`apply_kv_cache_prefix`, and inputs follow from them."""
    return [f"{stem}.{layer}{RETAINED_STATE_SUFFIX}" for stem in stems]


# A KV retained-state output, plain or with a kv_cache_prefix: past_key.3[_P]_RetainedState.
_KV_OUTPUT = re.compile(
    r"^(?P<stem>[A-Za-z_]+)\.(?P<layer>\d+)(?:_(?P<prefix>[A-Za-z0-9]+))?" + RETAINED_STATE_SUFFIX + "$"
)


def apply_kv_cache_prefix(names: Sequence[str], prefix: str | None) -> list[str]:
    """``names`` with ``prefix`` inserted into each KV retained-state output:
    ``past_key.3_RetainedState`` -> ``past_key.3_P_RetainedState``. Other names (logits,
    ``vision_embeds_RetainedState``, ...) are returned unchanged; without a prefix the
    list is returned as is."""
    prefix = validate_kv_cache_prefix(prefix)
    if prefix is None:
        return list(names)
    stems = set(kv_stems())
    out = []
    for name in names:
        m = _KV_OUTPUT.match(name)
        if m and m["stem"] in stems and m["prefix"] is None:
            name = f"{m['stem']}.{m['layer']}_{prefix}{RETAINED_STATE_SUFFIX}"
        out.append(name)
    return out


def align_inputs_to_outputs(output_names: Sequence[str]) -> dict[str, str]:
    """Each retained-state output ``X_RetainedState`` -> its input ``X``: the compiler pairs
    them by name, so the input name is always derived from the output's."""
    return {o: o[: -len(RETAINED_STATE_SUFFIX)] for o in output_names if o.endswith(RETAINED_STATE_SUFFIX)}


def is_kv_retained_state(name: str) -> bool:
    """True if ``name`` is a KV retained-state output of the registry's KV updates, with
    or without a ``kv_cache_prefix`` (``past_key.3_RetainedState``, ``past_key.3_P_RetainedState``)."""
    m = _KV_OUTPUT.match(name)
    return bool(m) and m["stem"] in kv_stems()
