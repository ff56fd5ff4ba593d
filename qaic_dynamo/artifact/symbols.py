"""Canonical size symbols: the names ``S0, S1, ...`` a layout's size expressions use.

Dynamo names a graph's symbolic sizes ``s0``, ``s12``, ... as it happens to meet them, so
the same piece traced in two graphs gets different names. A piece's artifact is shared by
every call site with its structure, so its layout names each symbol by where it first
appears among the piece's inputs instead: tensor sizes, then strides, input by input.
The fingerprint (``compiler.fingerprint``) keys pieces with the same names, so an
artifact's expressions mean the same thing at every call site that finds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch

__all__ = ["SymbolNames", "canonical_names"]

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class SymbolNames:
    """Canonical names for the symbols of one piece, in order of first appearance."""

    def __init__(self) -> None:
        #: Dynamo's symbol -> its canonical symbol.
        self.symbols: dict[sympy.Symbol, sympy.Symbol] = {}

    def expr(self, e: Any) -> str:
        """``e`` in canonical symbols (naming the symbols it meets first)."""
        e = sympy.sympify(e)
        for s in sorted(e.free_symbols, key=str):
            if s not in self.symbols:
                self.symbols[s] = sympy.Symbol(f"S{len(self.symbols)}", integer=True)
        return str(e.xreplace(self.symbols))

    def size(self, x: Any) -> Any:
        """A size as the key writes it: an int, or ``{"sym": expr}`` in canonical symbols."""
        if isinstance(x, _SYMBOLIC):
            if x.node.expr.is_number:  # specialised: a SymInt that is really a constant
                return int(x.node.expr) if isinstance(x, torch.SymInt) else {"sym": str(x.node.expr)}
            return {"sym": self.expr(x.node.expr)}
        return x

    def name_inputs(self, example_args: Sequence[Any]) -> None:
        """Name the symbols of a piece's inputs, in the fingerprint's order: a tensor's
        sizes then strides, a symbolic scalar's expression, and the symbols inside a
        constant (lists and tuples in order, dicts by key, slices' bounds)."""
        for a in example_args:
            if isinstance(a, torch.Tensor):
                for d in (*a.shape, *a.stride()):
                    self.size(d)
            elif isinstance(a, _SYMBOLIC):
                self.expr(a.node.expr)
            else:
                self._name_within(a)

    def _name_within(self, a: Any) -> None:
        if isinstance(a, _SYMBOLIC):
            self.expr(a.node.expr)
        elif isinstance(a, (list, tuple)):
            for x in a:
                self._name_within(x)
        elif isinstance(a, dict):
            for _, v in sorted(a.items(), key=lambda kv: str(kv[0])):
                self._name_within(v)
        elif isinstance(a, slice):
            for x in (a.start, a.stop, a.step):
                self._name_within(x)


def canonical_names(example_args: Sequence[Any]) -> SymbolNames:
    """The canonical names of a piece's symbols, exactly as its fingerprint assigns them."""
    names = SymbolNames()
    names.name_inputs(example_args)
    return names
