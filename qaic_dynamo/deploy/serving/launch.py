"""How the disaggregated server starts its worker processes safely: with SIGINT ignored
from their first instruction, and only from a script whose start is under an
``if __name__ == "__main__":`` guard (spawned workers import the main script again)."""

from __future__ import annotations

import ast
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["check_main_guard", "children_ignore_sigint"]


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Start processes with SIGINT ignored from their first instruction: a Ctrl-C reaches
    the whole process group, and a worker still importing torch would die of it with a
    traceback; the server stops its workers itself. An ignored signal stays ignored
    across exec, and Python then installs no handler of its own."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        # None: a handler installed outside Python, which cannot be put back; the default.
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    values = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"]


def check_main_guard() -> None:
    """Refuse a start from a script's top level outside ``if __name__ == "__main__":``.

    The workers are spawned: each imports the main script again (as ``__mp_main__``), and
    an unguarded start there would fail in every worker with Python's bootstrap error."""
    main = sys.modules.get("__main__")
    if not str(getattr(main, "__file__", "") or "").endswith(".py"):
        return  # python -c, an interactive session, a frozen entry point: nothing re-imported
    frame, top = sys._getframe(1), None
    while frame is not None and top is None:  # the innermost module-level frame of __main__
        if frame.f_globals.get("__name__") == "__main__" and frame.f_code.co_name == "<module>":
            top = frame
        frame = frame.f_back
    if top is None:
        return  # not called from the main script's top level (a function run by a guard, a thread)
    # Its own file: under a launcher (pdb, coverage, runpy) __main__.__file__ may be another.
    path = top.f_code.co_filename
    if not path.endswith(".py"):
        return
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return
    line = top.f_lineno
    if any(
        isinstance(node, ast.If) and _is_main_test(node.test) and node.lineno <= line <= (node.end_lineno or line)
        for node in ast.walk(tree)
    ):
        return
    raise RuntimeError(
        f"DisaggregatedServer: started at the top level of {path} (line {line}) without an "
        '`if __name__ == "__main__":` guard. The workers are spawned processes that import that script '
        "again, and each would start a server of its own. Put the code that starts the server under "
        '`if __name__ == "__main__":`.'
    )
