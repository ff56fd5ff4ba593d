"""Size guards: the branches a lowering took on dynamic sizes, and whether they hold.

A decomposition may branch on a dynamic size (a split's remainder, adaptive pooling's
windows). The lowered artifact is then correct only where Dynamo's guards of the compile
it was lowered in imply that branch: the lowering refuses a branch they do not imply,
records the ones they do as the artifact's size assumptions, and every later reuse
checks them against its own compile's guards (:func:`unmet_size_assumptions`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch

from qaic_dynamo._compat import int_oo
from qaic_dynamo.artifact import canonical_names, parse_size_assumption

__all__ = ["guards_not_implied", "holds_over_range", "unmet_size_assumptions"]


def guards_not_implied(
    fakes: Sequence[torch.Tensor],
    shape_env: Any,
    dynamo_sizes: Sequence[tuple[Any, ...]],
    strict: bool = True,
    implied: list[sympy.Basic] | None = None,
) -> list[str]:
    """The trace's size guards that Dynamo's guards on the same sizes do not imply (all of
    them where that cannot be decided). ``strict=False`` leaves out guards on sizes Dynamo
    does not know (the KV caches' and slot mapping's, which the runtime binds as it finds
    them). ``implied`` receives the guards that are implied, in Dynamo's symbols: what the
    artifact assumes (see :func:`unmet_size_assumptions`). Reads the ShapeEnv's
    ``guards``, ``deferred_runtime_asserts``, ``get_axioms`` and ``_maybe_evaluate_static``
    (private, torch 2.13); if any is missing, nothing is taken as implied."""
    mapping: dict[sympy.Symbol, sympy.Expr] = {}
    dynamo_env = None
    for fake, sizes in zip(fakes, dynamo_sizes):
        for mine, theirs in zip(fake.shape, sizes):
            if isinstance(mine, torch.SymInt) and isinstance(theirs, torch.SymInt):
                mapping[mine.node.expr] = theirs.node.expr
                dynamo_env = theirs.node.shape_env
    try:
        exprs = [g.expr for g in shape_env.guards]
        exprs += [r.expr for rs in shape_env.deferred_runtime_asserts.values() for r in rs]
        if not exprs:
            return []
        axioms = None  # Dynamo's guards as axioms, read only if a guard needs proving
        unproven = []
        for expr in exprs:
            if not expr.free_symbols <= mapping.keys():
                if strict:
                    unproven.append(str(expr))
                continue
            if dynamo_env is None:
                unproven.append(str(expr))
                continue
            theirs = expr.xreplace(mapping)
            if axioms is None:
                axioms = dynamo_env.get_axioms()
            if not _implied(theirs, dynamo_env, axioms):
                unproven.append(str(expr))
            elif implied is not None and theirs not in (True, sympy.true):  # true of any sizes: nothing to check
                implied.append(theirs)
        return unproven
    except Exception as e:  # a private API moved: prove nothing
        return [f"(cannot check: {type(e).__name__})"]


def _implied(expr: sympy.Basic, shape_env: Any, axioms: Any) -> bool:
    """Whether ``expr`` (in ``shape_env``'s symbols) follows from that env's guards."""
    if expr is sympy.true or expr is True:
        return True
    return shape_env._maybe_evaluate_static(expr, axioms=axioms) == sympy.true or holds_over_range(
        expr, shape_env.var_to_range
    )


def unmet_size_assumptions(assumptions: Sequence[str], example_args: Sequence[Any]) -> list[str]:
    """The size assumptions of an artifact that Dynamo's guards of this call site do not imply.

    An artifact whose lowering branched on a dynamic size (a decomposition's split at a
    remainder, adaptive pooling's windows) is correct only where the guards of the compile
    it was lowered in hold; its layout lists them (``PieceLayout.size_assumptions``, in the
    fingerprint's canonical symbols), and the key does not: the same graph under weaker
    guards has the same key. So every reuse checks them against the reusing compile's
    guards, with the proof the lowering used. Anything undecidable counts as unmet."""
    if not assumptions:
        return []
    canon = canonical_names(example_args)
    symbol_of = {str(c): s for s, c in canon.symbols.items()}  # canonical name -> this compile's symbol
    shape_env = next(
        (
            x.node.shape_env
            for a in example_args
            for x in ((*a.shape, *a.stride()) if isinstance(a, torch.Tensor) else (a,))
            if isinstance(x, torch.SymInt)
        ),
        None,
    )
    unmet = []
    axioms = None
    for text in assumptions:
        try:
            expr = parse_size_assumption(text)
            if not {str(s) for s in expr.free_symbols} <= symbol_of.keys() or shape_env is None:
                unmet.append(text)
                continue
            theirs = expr.xreplace({s: symbol_of[str(s)] for s in expr.free_symbols})
            if axioms is None:
                axioms = shape_env.get_axioms()
            if not _implied(theirs, shape_env, axioms):
                unmet.append(text)
        except Exception:  # a private API moved, or an expression sympy cannot decide
            unmet.append(text)
    return unmet


def holds_over_range(expr: sympy.Basic, ranges: Mapping[sympy.Symbol, Any], limit: int = 4096) -> bool:
    """Whether a guard on one size holds at every value of that size's (finite, small)
    range: sympy does not simplify ``Eq(s, Min(10, s))`` under ``s <= 10``."""
    if len(expr.free_symbols) != 1:
        return False
    (sym,) = expr.free_symbols
    vr = ranges.get(sym)
    infinity = int_oo()  # sympy takes torch's integer infinity for finite
    if vr is None or any(b in (infinity, -infinity, sympy.oo, -sympy.oo) for b in (vr.lower, vr.upper)):
        return False
    if int(vr.upper) - int(vr.lower) > limit:
        return False
    return all(bool(expr.xreplace({sym: sympy.Integer(v)})) for v in range(int(vr.lower), int(vr.upper) + 1))
