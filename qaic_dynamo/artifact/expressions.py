"""Size expressions in layouts: checked before sympy sees them, and compiled into functions.

A layout's output shapes, size leaves and size assumptions are sympy expressions over the
canonical symbols ``S0, S1, ...``. sympy parses with ``eval``, so text read from a cache
directory (which someone else may be able to write) is checked token by token first:
arithmetic over the symbols and sympy's size functions only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import sympy

from qaic_dynamo._compat import sympy_size_functions
from qaic_dynamo.artifact.files import LAYOUT_FILE
from qaic_dynamo.errors import ArtifactError

__all__ = [
    "CANONICAL_SYMBOL",
    "check_size_expression",
    "parse_size_assumption",
    "shape_function",
    "symbol_function",
]

_SYMPY_LOCALS = sympy_size_functions()
#: A canonical symbol's name.
CANONICAL_SYMBOL = re.compile(r"\bS\d+\b")


_EXPRESSION_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_]\w*)|\d+(?:\.\d+)?|\*\*|[-+*/%(),])")
# A relation adds comparisons and logic (sympy prints ``S0 <= 10``, ``Eq(Mod(S0, 4), 0)``).
_RELATION_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_]\w*)|\d+(?:\.\d+)?|\*\*|[<>]=?|[-+*/%(),&|~])")
# Names sympy prints in size expressions besides torch's own sympy functions.
_SYMPY_NAMES = frozenset({"Max", "Min", "floor", "ceiling", "Mod", "Abs", "Integer", "Rational"})
_RELATION_NAMES = frozenset({"Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "True", "False"})


# Of torch's sympy module only its sympy classes (FloorDiv, CeilDiv, ...), not the modules
# and helpers it imports.
_SYMPY_FUNCTION_NAMES = frozenset(
    name for name, v in _SYMPY_LOCALS.items() if isinstance(v, type) and issubclass(v, sympy.Basic)
)


def check_size_expression(text: str, symbols: Iterable[str], where: str, relation: bool = False) -> None:
    """Refuse a size expression that is not arithmetic over ``symbols`` and sympy's size
    functions (``relation``: or comparisons and logic over such). sympy parses with
    ``eval``, so layout.json must never reach it unchecked: a cache directory someone else
    can write would otherwise run their code."""
    allowed = set(symbols) | _SYMPY_NAMES | _SYMPY_FUNCTION_NAMES | (_RELATION_NAMES if relation else frozenset())
    token = _RELATION_TOKEN if relation else _EXPRESSION_TOKEN
    pos, previous = 0, ""
    while pos < len(text.rstrip()):
        m = token.match(text, pos)
        word = m.group().strip() if m is not None else ""
        # Sizes are small: a long literal is not one, nor a power but of a symbol or a
        # parenthesis by a small integer (sympy evaluates 9**9**9**9 while it parses).
        power_ok = word != "**" or previous == ")" or previous in allowed
        if (
            m is None
            or m.end() == pos
            or (m["name"] is not None and m["name"] not in allowed)
            or not power_ok
            or (word[:1].isdigit() and len(word) > 20)
            or (previous == "**" and not (word.isdigit() and len(word) <= 2))
        ):
            bad = m["name"] if m is not None and m["name"] else text[pos : pos + 12]
            raise ArtifactError(f"{LAYOUT_FILE}: {where} {text!r} is not a size expression (at {bad!r})")
        pos, previous = m.end(), word


def shape_function(
    shape: list[int | str] | None, symbols: dict[str, list[Any]]
) -> Callable[[dict[str, int]], list[int]]:
    """Compile an output's shape spec (ints and expressions in canonical symbols) into a
    function of the symbols' values."""
    if shape is None:
        return lambda sym: []
    parts: list[Callable[[dict[str, int]], int]] = []
    for dim in shape:
        if isinstance(dim, int):
            parts.append(lambda sym, d=dim: d)
        elif dim in symbols:
            parts.append(lambda sym, d=dim: sym[d])
        else:
            check_size_expression(str(dim), symbols, "an output size")
            expr = sympy.sympify(dim, locals={**_SYMPY_LOCALS, **{s: sympy.Symbol(s, integer=True) for s in symbols}})
            missing = {str(s) for s in expr.free_symbols} - set(symbols)
            if missing:
                raise ArtifactError(f"an output size {dim} uses {sorted(missing)}, which no input carries")
            parts.append(
                lambda sym, e=expr: int(e.xreplace({sympy.Symbol(k, integer=True): v for k, v in sym.items()}))
            )
    return lambda sym: [p(sym) for p in parts]


def symbol_function(expr: str, symbols: dict[str, list[Any]]) -> Callable[[dict[str, int]], int]:
    """Compile a size leaf's expression (``["sym", expr]``) into a function of the symbol
    values; checked first, as every expression read from a layout is."""
    shape = shape_function([expr], symbols)
    return lambda sym: shape(sym)[0]


def parse_size_assumption(text: str) -> sympy.Basic:
    """A ``size_assumptions`` entry as a sympy relation over integer symbols S0, S1, ...
    (checked first, as :meth:`PieceLayout.from_json` checks every entry it reads)."""
    names = CANONICAL_SYMBOL.findall(text)
    check_size_expression(text, names, "a size assumption", relation=True)
    symbols = {n: sympy.Symbol(n, integer=True) for n in names}
    return sympy.sympify(sympy.sympify(text, locals={**_SYMPY_LOCALS, **symbols}))  # "True" parses to a bool
