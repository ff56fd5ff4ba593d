"""Disaggregated serving: prefill and decode in separate processes, with a zero-copy KV
hand-off through slicing.

Prefill and decode are separate sessions, as on Cloud AI 100 cards. Without slicing the
decode session takes every batch slot's KV as input on each step, so freeing one slot of
32 re-sends all 32 slots' KV. Here, as in QEfficient's disaggregated flow:

* The decode KV buffers live in host shared memory, one per retained-state name
  (``past_key.{i}``, ...; with ``kv_cache_prefix`` P, ``past_key.{i}_P``), in the retained
  layout ``[decode_slots, kv_heads, ctx_len, head_dim]``.
* A :class:`KVSliceSpec` names the buffers by pattern and the dims that are indexed per
  request: ``batch_index`` (dim 0, the decode slot) and ``ctx_start`` (dim 2, where the
  request's tokens start).
* :meth:`Session.set_data_with_slices` binds views of those buffers into a session: a
  prefill run then writes the request's KV straight into decode slot ``b``, so nothing is
  copied when the request moves to decode, and a freed decode slot is refilled without
  touching any other slot's KV.

A :class:`Session` wraps an :class:`~qaic_dynamo.engine.LLM` (``backend="qaic"`` by
default) whose paged cache is laid out as the retained state (one block per slot,
``block_size == ctx_len``), with a pool of execution slots: ``role="prefill"`` has
``stages + 1`` (chunks of several requests in flight), ``role="decode"`` exactly one.

:class:`DisaggregatedServer` runs one prefill and one decode worker process and moves
KV between them through a :class:`KVTransport`:

* ``"shm"``: slicing over shared memory, zero bytes copied (one host);
* ``"copy"``: the baseline without slicing - prefill writes its own buffers and the
  slot's retained state is copied into the decode buffers (bytes counted);
* ``"gloo"``: ``torch.distributed`` point-to-point over gloo, for prefill and decode in
  different processes or hosts: the prefilled slot is sent and received straight into the
  decode buffer's slot (bytes sent counted).

:meth:`DisaggregatedServer.from_export` serves what ``export_prefill_decode`` wrote: the
prefill-only and decode-only artifacts on ONNX Runtime (standing in for the card's
``QAICInferenceSession``), each KV input and its retained-state output bound in place on the
same buffers (:class:`OrtSession`, in :mod:`.exported`).

Modules: :mod:`.kv_slices` (names and the slicing spec), :mod:`.shm` (shared-memory
buffers), :mod:`.session`, :mod:`.exported`, :mod:`.transports`, :mod:`.workers`, :mod:`.launch`, :mod:`.results` and :mod:`.server`.
"""

from qaic_dynamo.deploy.serving.exported import ExportedModel, OrtSession
from qaic_dynamo.deploy.serving.kv_slices import KVSliceSpec, kv_buffer_names
from qaic_dynamo.deploy.serving.results import RequestResult, percentile, summarize
from qaic_dynamo.deploy.serving.server import DisaggregatedServer
from qaic_dynamo.deploy.serving.session import ExecutionSlot, Session, SlicedSession
from qaic_dynamo.deploy.serving.shm import SharedKVBuffers
from qaic_dynamo.deploy.serving.transports import KVTransport
from qaic_dynamo.errors import KVSliceError

__all__ = [
    "DisaggregatedServer",
    "ExecutionSlot",
    "ExportedModel",
    "KVSliceError",
    "KVSliceSpec",
    "KVTransport",
    "OrtSession",
    "RequestResult",
    "Session",
    "SharedKVBuffers",
    "SlicedSession",
    "kv_buffer_names",
    "percentile",
    "summarize",
]
