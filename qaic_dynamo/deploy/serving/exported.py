"""Exported artifacts as the two sessions of a disaggregated server, on ONNX Runtime.

A card serves a prefill QPC and a decode QPC, with the KV handed over by
``setDataWithSlices``. Here ONNX Runtime stands in for ``QAICInferenceSession``: an
:class:`OrtSession` runs the prefill-only or decode-only artifact of an export over KV
buffers bound with ``set_data_with_slices``, like the engine-based ``Session``, so the same
workers, transports and fault handling serve either.

Every KV input and its ``*_RetainedState`` output are bound (ONNX Runtime IOBinding) to
the same memory: the retained state stays where it is, as on the card, and nothing is
copied in or out. ONNX Runtime's ScatterND writes in place when its data input and output
are one buffer, so a run writes only the positions it scatters:

* prefill, continuous batching: the whole buffers and ``batch_index = [[slot]]``; without
  it, the slot's row (a ``[1, heads, ctx_len, dim]`` view at its offset);
* decode, continuous batching: the whole buffers and the running slots' ``batch_index``
  in one call; without it, one call per run of consecutive running slots, each on its
  rows' view.

Decode feeds only the running slots. A free slot may be being prefilled by the other
process at that moment, and a slot fed as padding writes its own position 0 back
(CtxScatter's padding rule), which could undo the prefill's write. A card's Decode
specialization always runs ``full_batch_size`` rows; ONNX Runtime takes the graph's
symbolic batch as it comes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx
import torch

from qaic_dynamo.deploy.exported import ExportedArtifact, find_exports
from qaic_dynamo.deploy.naming import RETAINED_STATE_SUFFIX
from qaic_dynamo.deploy.ort_model import OrtModel
from qaic_dynamo.deploy.serving.kv_slices import KVSliceSpec
from qaic_dynamo.deploy.serving.session import ExecutionSlot, Session, SlicedSession
from qaic_dynamo.engine import Request
from qaic_dynamo.errors import ExportError, KVSliceError

__all__ = ["ExportedModel", "OrtSession", "make_session"]

_SPECIAL_INPUTS = frozenset({"input_ids", "position_ids", "batch_index", "comp_ctx_lengths"})
_TORCH_DTYPES = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.FLOAT16: torch.float16}
#: The op each retained-state output must come from for an in-place run: a scatter of
#: its own KV input (so ONNX Runtime's ScatterND writes into the bound buffer).
_IN_PLACE_WRITERS = frozenset({"CtxScatter", "CtxScatterCB"})


def _graph_kv(onnx_path: os.PathLike) -> tuple[dict[str, tuple[int, int]], torch.dtype, int]:
    """The KV inputs of an exported graph (name -> (heads, dim), in graph order), their
    dtype and the vocabulary size; checks every retained-state output is written in place."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    producers = {o: n for n in graph.node for o in n.output}
    kv: dict[str, tuple[int, int]] = {}
    dtypes = set()
    for i in graph.input:
        if i.name in _SPECIAL_INPUTS:
            continue
        dims = i.type.tensor_type.shape.dim
        if len(dims) != 4 or not dims[1].dim_value or not dims[3].dim_value:
            raise ExportError(f"{onnx_path}: input {i.name} is not a [batch, heads, ctx_len, dim] KV cache")
        node = producers.get(i.name + RETAINED_STATE_SUFFIX)
        if node is None or node.op_type not in _IN_PLACE_WRITERS or node.input[0] != i.name:
            raise ExportError(
                f"{onnx_path}: {i.name}{RETAINED_STATE_SUFFIX} is not a scatter into {i.name}, so its buffer "
                "cannot be shared in place by the prefill and decode sessions"
            )
        kv[i.name] = (dims[1].dim_value, dims[3].dim_value)
        dtypes.add(i.type.tensor_type.elem_type)
    if not kv:
        raise ExportError(f"{onnx_path} takes no KV cache: it is not a retained-state export")
    if len(dtypes) != 1 or next(iter(dtypes)) not in _TORCH_DTYPES:
        names = sorted(onnx.TensorProto.DataType.Name(t) for t in dtypes)
        raise ExportError(
            f"{onnx_path}: KV caches of {names}; serving on ONNX Runtime's CPU kernels takes one of float32 or "
            "float16 (a bfloat16 checkpoint exported for hw_version='ai100' is float32)"
        )
    vocab = graph.output[0].type.tensor_type.shape.dim[-1].dim_value
    return kv, _TORCH_DTYPES[dtypes.pop()], vocab


class ExportedModel:
    """The prefill and decode artifacts a ``DisaggregatedServer`` serves (picklable: each
    worker opens its own ONNX Runtime session from it).

    ``prefill_dir`` / ``decode_dir`` as :func:`~qaic_dynamo.deploy.exported.find_exports`
    takes them: the pair directory of ``export_prefill_decode``, two export directories,
    or one full export (both roles). The two must be halves of one model: the same
    weights, ``ctx_len``, ``kv_cache_prefix`` and KV buffers."""

    def __init__(self, prefill_dir: str | os.PathLike, decode_dir: str | os.PathLike | None = None) -> None:
        p, d = find_exports(prefill_dir, decode_dir)
        self.prefill, self.decode = ExportedArtifact.read(p), ExportedArtifact.read(d)
        if not self.prefill.serves_prefill:
            raise ExportError(f"{p} is a decode-only export (prefill_only=False): pass the prefill-only one first")
        if not self.decode.serves_decode:
            raise ExportError(f"{d} is a prefill-only export (prefill_only=True): pass the decode-only one second")
        for what in ("model", "ctx_len", "kv_cache_prefix", "dtype"):
            a, b = getattr(self.prefill, what), getattr(self.decode, what)
            if a != b:
                raise ExportError(
                    f"the prefill export ({p}) and the decode export ({d}) differ in {what} ({a!r} vs {b!r}); "
                    "serve the two halves of one export_prefill_decode"
                )
        self.kv, self._dtype, self.vocab = _graph_kv(self.prefill.onnx_path)
        if self.decode.onnx_path != self.prefill.onnx_path:
            kv, _, _ = _graph_kv(self.decode.onnx_path)
            if kv != self.kv:
                raise ExportError(f"the prefill and decode models take different KV buffers: {self.kv} vs {kv}")

    @property
    def decode_slots(self) -> int:
        """Decode slots: the decode export's KV rows (full_batch_size, or batch_size)."""
        return self.decode.kv_rows

    @property
    def ctx_len(self) -> int:
        return self.decode.ctx_len

    @property
    def chunk_size(self) -> int:
        """The prefill chunk: the prefill export's prefill_seq_len."""
        return self.prefill.prefill_seq_len

    @property
    def kv_cache_prefix(self) -> str | None:
        return self.prefill.kv_cache_prefix

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt the Prefill specializations hold (the longest prefill CCL)."""
        return self.prefill.max_prompt_len

    def buffer_shapes(self, slots: int) -> dict[str, tuple[int, ...]]:
        """Every KV buffer's name and shape for ``slots`` rows: [slots, heads, ctx_len, dim]."""
        return {name: (slots, heads, self.ctx_len, dim) for name, (heads, dim) in self.kv.items()}

    def describe(self) -> str:
        cb = f"continuous batching, {self.decode_slots} slots" if self.decode.full_batch_size else "static batches"
        return (
            f"prefill {self.prefill.export_dir}, decode {self.decode.export_dir}: ctx_len {self.ctx_len}, "
            f"prefill chunks of {self.chunk_size}, {cb}"
        )


class OrtSession(SlicedSession):
    """One artifact of an :class:`ExportedModel` in prefill or decode role on ONNX Runtime
    (see the module docstring)."""

    def __init__(self, exported: ExportedModel, role: str, *, stages: int = 1, threads: int | None = None) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"OrtSession: role must be 'prefill' or 'decode', got {role!r}")
        if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
            raise ValueError(f"OrtSession: stages must be a positive int, got {stages!r}")
        self.role = role
        self.exported = exported
        artifact = exported.prefill if role == "prefill" else exported.decode
        self.model = OrtModel(artifact.onnx_path, threads, export_dir=artifact.export_dir)
        self.continuous_batching = self.model.continuous_batching
        self.ctx_len = exported.ctx_len
        self.chunk_size = exported.chunk_size
        self.execution_slots = [ExecutionSlot(i) for i in range(stages + 1 if role == "prefill" else 1)]
        self.layer_buffers = [list(exported.kv)]
        self.spec = KVSliceSpec.for_names(list(exported.kv), exported.kv_cache_prefix)
        self._np_dtype = np.float16 if exported.dtype == torch.float16 else np.float32
        self._buffers: dict[str, torch.Tensor] | None = None

    @property
    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.exported.buffer_shapes(self.exported.decode_slots)

    @property
    def dtype(self) -> torch.dtype:
        return self.exported.dtype

    def _bind(self, buffers: dict[str, torch.Tensor], num_slots: int) -> None:
        self._buffers = {name: buffers[name] for name in self.exported.kv}

    def _run(
        self,
        ids: list[list[int]],
        positions: list[list[int]],
        kv: dict[str, torch.Tensor],
        batch_index: list[int] | None,
        ccl: int | None,
    ) -> np.ndarray:
        """One call with every KV buffer bound in place; its logits [batch, vocab]."""
        session = self.model.session
        io = session.io_binding()
        feeds = {
            "input_ids": np.asarray(ids, dtype=np.int64),
            "position_ids": np.asarray(positions, dtype=np.int64),
        }
        if self.continuous_batching:
            feeds["batch_index"] = np.asarray(batch_index, dtype=np.int64).reshape(-1, 1)
        if ccl is not None:
            feeds["comp_ctx_lengths"] = np.zeros(ccl, dtype=np.int64)  # only its length counts
        for name, array in feeds.items():
            io.bind_cpu_input(name, array)
        io.bind_output(self.model.outputs[0], "cpu")  # first: the outputs come back in bind order
        for name, t in kv.items():
            shape, ptr = list(t.shape), t.data_ptr()
            io.bind_input(name, "cpu", 0, self._np_dtype, shape, ptr)
            io.bind_output(name + RETAINED_STATE_SUFFIX, "cpu", 0, self._np_dtype, shape, ptr)
        session.run_with_iobinding(io)
        return io.get_outputs()[0].numpy()[:, -1]

    def _bound(self) -> dict[str, torch.Tensor]:
        if self._buffers is None:
            raise KVSliceError(f"this {self.role} session has no KV buffers: call set_data_with_slices first")
        return self._buffers

    def run_prefill_chunks(self, chunk_size: int) -> list[tuple[ExecutionSlot, int]]:
        if chunk_size != self.chunk_size:
            raise KVSliceError(
                f"this export prefills in chunks of its prefill_seq_len {self.chunk_size}, not {chunk_size}"
            )
        busy = [s for s in self.execution_slots if s.request is not None]
        if not busy:
            return []
        buffers = self._bound()
        done = []
        for s in busy:
            b, start = s.binding
            prompt = s.request.prompt
            chunk = list(prompt[start : start + chunk_size])
            end, pad = start + len(chunk), chunk_size - len(chunk)
            # The Prefill specialization's shape: padding at position -1, which writes nothing.
            ids = [chunk + [0] * pad]
            positions = [list(range(start, end)) + [-1] * pad]
            kv = buffers if self.continuous_batching else {n: t[b : b + 1] for n, t in buffers.items()}
            ccl = self.model.ccl(self.model.prefill_ccls, end, self.ctx_len, "prefill")
            logits = self._run(ids, positions, kv, [b], ccl)
            if end >= len(prompt):
                done.append((s, int(logits[0].argmax())))
            else:
                s.binding = (b, end)
        return done

    def decode(self, requests: list[Request]) -> torch.Tensor:
        buffers = self._bound()
        rows = []
        for r in requests:
            if r.num_tokens - r.num_computed_tokens != 1 or len(r.block_ids) != 1:
                raise KVSliceError(
                    f"request {r.request_id} is not at a decode step (one new token in one slot): "
                    f"{r.num_tokens} tokens, {r.num_computed_tokens} in the cache, slots {r.block_ids}"
                )
            rows.append((r.block_ids[0], r.all_token_ids[-1], r.num_computed_tokens))
        slots = [slot for slot, _, _ in rows]
        if len(set(slots)) != len(slots):
            raise KVSliceError(f"two requests in one decode slot: {slots}")
        out = np.empty((len(rows), self.exported.vocab), dtype=np.float32)
        if self.continuous_batching:
            groups = [list(range(len(rows)))]
        else:  # one call per run of consecutive slots, each on its rows' view
            order = sorted(range(len(rows)), key=lambda i: slots[i])
            groups = []
            for i in order:
                if groups and slots[groups[-1][-1]] + 1 == slots[i]:
                    groups[-1].append(i)
                else:
                    groups.append([i])
        for group in groups:
            ids = [[rows[i][1]] for i in group]
            positions = [[rows[i][2]] for i in group]
            ccl = self.model.ccl(self.model.decode_ccls, max(p for (p,) in positions) + 1, self.ctx_len, "decode")
            if self.continuous_batching:
                kv = buffers
            else:
                first = slots[group[0]]
                kv = {n: t[first : first + len(group)] for n, t in buffers.items()}
            logits = self._run(ids, positions, kv, [slots[i] for i in group], ccl)
            out[group] = logits
        return torch.from_numpy(out)


def make_session(model: Any, role: str, cfg: dict) -> SlicedSession:
    """The session a worker runs: on ONNX Runtime for an :class:`ExportedModel`, else a
    compiled ``LLM``."""
    if isinstance(model, ExportedModel):
        return OrtSession(model, role, stages=cfg["stages"], threads=cfg["threads"])
    return Session(
        model,
        role,
        num_slots=cfg["slots"],
        ctx_len=cfg["ctx_len"],
        stages=cfg["stages"],
        backend=cfg["backend"],
        kv_cache_prefix=cfg["kv_cache_prefix"],
    )
