"""The lowering stage: one graph piece to accelerator ONNX, written as an artifact.

:func:`lower_piece` is the stage's entry. Its steps, one module each:

* :mod:`.prepare` - the FX rewrite of the piece (sizes from tensors, KV-cache updates to
  retained state, outputs and leaves, export inputs) and the ``PieceLayout`` it implies;
  :mod:`.writes` refuses in-place writes into inputs;
* the **direct path**: :mod:`.aten_trace` traces the piece once on fake tensors into a
  functional aten graph, with the decompositions of :mod:`.registry` applied during the
  trace and eager's own semantics (:mod:`.semantics`, one module per op family) first;
  :mod:`.aten_passes` fixes what the translation would get wrong; :mod:`.translate` turns
  each node into ONNX through torch.onnx's registry (its signatures inferred lazily,
  :mod:`.signatures`; onnxscript's conversions deferred, :mod:`.deferred`);
  :mod:`.size_guards` checks any branch the trace took on a dynamic size against
  Dynamo's guards;
* the **exporter fallback** (:mod:`.exporter`): torch.onnx's exporter, for a piece the
  direct path cannot translate, counted and reported with the op that forced it;
* :mod:`.finish` makes the model self-contained and passes ``onnx.checker``.

The private torch.onnx pieces the direct path needs come from ``qaic_dynamo._compat``; on
a torch without them every piece takes the exporter. Anything that cannot be lowered
raises ``LoweringError`` with the reason; the backend decides whether that means an
eager fallback or an error. The deployment export reuses the trace, translation and
finishing steps on a whole model.
"""

from qaic_dynamo._compat import quiet_exporter_registration
from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.aten_trace import aten_graph, fake_inputs
from qaic_dynamo.lowering.finish import finish_model
from qaic_dynamo.lowering.piece import grad_mode_refusal, lower_piece
from qaic_dynamo.lowering.prepare import size_expression
from qaic_dynamo.lowering.semantics import TORCH_SEMANTICS
from qaic_dynamo.lowering.size_guards import holds_over_range, unmet_size_assumptions
from qaic_dynamo.lowering.translate import translate_aten

__all__ = [
    "TORCH_SEMANTICS",
    "LoweringError",
    "aten_graph",
    "fake_inputs",
    "finish_model",
    "grad_mode_refusal",
    "holds_over_range",
    "lower_piece",
    "size_expression",
    "translate_aten",
    "unmet_size_assumptions",
]

quiet_exporter_registration()
