"""Every private torch, Dynamo and torch.onnx API qaic_dynamo uses, behind one adapter per
torch release.

The rest of the package imports these names from here and never from ``torch._dynamo``,
``torch._subclasses``, ``torch.fx.experimental``, ``torch.onnx._internal`` and the like
(ruff's banned-API rule enforces it, see ``pyproject.toml``). A new torch release gets a
module of its own beside ``torch_2_13`` and a line below; until then the 2.13 adapter
serves it, and its optional parts (:func:`dynamo_internals`,
:func:`torch_onnx_internals`) turn themselves off with a warning, so the backend takes
its public paths instead.
"""

from qaic_dynamo._compat import torch_2_13 as _adapter
from qaic_dynamo._compat.torch_2_13 import *  # noqa: F403  (the adapter's names are this package's)

__all__ = list(_adapter.__all__)
