"""What the runtime can bind: the tensor dtypes IOBinding takes, and size carriers.

An artifact's inputs and outputs are torch memory bound by address, so only dtypes with
an ONNX element type of the same layout can be bound. A size that no tensor argument
carries as a dimension reaches a piece as a *size carrier*: a tensor whose length is the
size (its values are never read).
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
import torch

__all__ = [
    "BINDABLE",
    "CPU_DEVICE",
    "MAX_SIZE_CARRIER",
    "ONNX_ELEMENT_TYPES",
    "REAL_PAIRS",
    "SIZE_CARRIER_DTYPE",
    "dtype_name",
]

#: torch dtype -> ONNX TensorProto element type: the dtypes an artifact's inputs and
#: outputs may have (as IOBinding takes them; an integer type also covers bfloat16, which
#: numpy has no dtype for).
ONNX_ELEMENT_TYPES: dict[torch.dtype, int] = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.float64: onnx.TensorProto.DOUBLE,
    torch.int64: onnx.TensorProto.INT64,
    torch.int32: onnx.TensorProto.INT32,
    torch.int16: onnx.TensorProto.INT16,
    torch.int8: onnx.TensorProto.INT8,
    torch.uint8: onnx.TensorProto.UINT8,
    torch.bool: onnx.TensorProto.BOOL,
}

#: Complex dtypes, bound as their real pairs. torch.onnx lowers a complex value to a real
#: one with a trailing dimension of 2 (real, imaginary), which is ``torch.view_as_real``'s
#: layout of the same memory: a complex input or output is bound as that view, no copy.
#: (complex32 has no ONNX Runtime kernels to run.)
REAL_PAIRS = frozenset({torch.complex64, torch.complex128})

#: Every dtype an artifact's input or output may have.
BINDABLE = frozenset(ONNX_ELEMENT_TYPES) | REAL_PAIRS

#: The dtype of a size carrier: the ONNX input a ``["size", i]`` source binds, a tensor
#: whose length is the piece's int argument i (its values are never read).
SIZE_CARRIER_DTYPE = torch.bool
#: The longest size carrier bound (bytes of one buffer per runner, never written): a larger
#: int, such as a seed Dynamo made dynamic, runs that call eagerly.
MAX_SIZE_CARRIER = 1 << 30

#: The C-level device of host memory, built once: the wrapper's bind_* build one per call.
CPU_DEVICE = ort.OrtDevice.make("cpu", 0)._get_c_device()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
