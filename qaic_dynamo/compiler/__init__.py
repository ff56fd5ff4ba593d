"""The compiler stage: the ``qaic`` torch.compile backend and regional compilation.

The entry of the pipeline. :mod:`.backend` takes a Dynamo graph, peels its view outputs
(:mod:`.views`), splits it at the splitting ops (:mod:`.partition`), keys every piece
(:mod:`.fingerprint`), asks the cache stage for its artifact and puts a runtime runner in
its place; :mod:`.report` records what happened to every piece, :mod:`.dynamic_floats`
compiles a graph per value of a float Dynamo left dynamic, and :mod:`.collector` pauses
the garbage collector while it all runs. :mod:`.regions` compiles a model region by
region (``qaic_dynamo.compile``), each repeated block traced once.
"""

from qaic_dynamo.compiler.backend import QaicBackend, qaic_backend
from qaic_dynamo.compiler.regions import compile, specialized_floats, wait_for_saves
from qaic_dynamo.compiler.report import GraphReport, PieceReport, compile_reports, last_compile_report

__all__ = [
    "GraphReport",
    "PieceReport",
    "QaicBackend",
    "compile",
    "compile_reports",
    "last_compile_report",
    "qaic_backend",
    "specialized_floats",
    "wait_for_saves",
]
