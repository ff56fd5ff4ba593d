// QEfficient's retained-state KV write and read, for the deployment export.
//
// An exported model keeps each layer's KV cache as retained state, [batch, heads, ctx_len,
// head_dim]: the write scatters a step's K/V at its positions (CtxScatter in ONNX), the
// read gathers the positions attention needs (CtxGather). With continuous batching the
// cache holds full_batch_size rows and a step names the rows it works on through
// batch_index (CtxScatterCB / CtxGatherCB): a prefill of one request touches one row, a
// decode step all of them. These kernels are the ops' eager meaning; the export traces
// them and translates each to its ONNX function. A position of -1 is padding and writes
// nothing.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "ops.h"

namespace qaic {

namespace {

void check_indices(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(
      t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, op, ": ", what,
      " must be int32 or int64, got ", t.scalar_type());
}

// The cache rows a continuous-batching call works on: batch_index [batch, 1], each in
// [0, full_batch_size) and no row twice (two writes to one row would land in an order
// ONNX leaves undefined).
std::vector<int64_t> batch_rows(const at::Tensor& batch_index, int64_t full_batch, const char* op) {
  TORCH_CHECK(
      batch_index.dim() == 2 && batch_index.size(1) == 1, op, ": batch_index must be [batch, 1], got ",
      batch_index.sizes());
  check_indices(batch_index, op, "batch_index");
  const at::Tensor idx = batch_index.to(at::kLong).contiguous();
  std::vector<int64_t> rows(idx.const_data_ptr<int64_t>(), idx.const_data_ptr<int64_t>() + idx.size(0));
  std::vector<bool> seen(full_batch, false);
  for (size_t b = 0; b < rows.size(); ++b) {
    const int64_t r = rows[b];
    TORCH_CHECK(
        r >= 0 && r < full_batch, op, ": batch_index[", b, "] = ", r, " is not a row of the cache's ", full_batch,
        " (full_batch_size)");
    TORCH_CHECK(!seen[r], op, ": batch_index names row ", r, " twice; give each request in a call its own row");
    seen[r] = true;
  }
  return rows;
}

// out[rows[b], :, position_ids[b, s]] = updates[b, :, s]; rows[b] == b without CB.
at::Tensor scatter_rows(
    const at::Tensor& data, const std::vector<int64_t>& rows, const at::Tensor& position_ids,
    const at::Tensor& updates, const char* op) {
  TORCH_CHECK(
      position_ids.dim() == 2 && position_ids.size(0) == static_cast<int64_t>(rows.size()), op,
      ": position_ids must be [batch, seq_len] with batch ", rows.size(), ", got ", position_ids.sizes());
  check_indices(position_ids, op, "position_ids");
  TORCH_CHECK(
      updates.dim() == 4 && updates.size(0) == position_ids.size(0) && updates.size(1) == data.size(1) &&
          updates.size(2) == position_ids.size(1) && updates.size(3) == data.size(3),
      op, ": updates must be [batch, heads, seq_len, head_dim] = [", position_ids.size(0), ", ", data.size(1), ", ",
      position_ids.size(1), ", ", data.size(3), "], got ", updates.sizes());
  TORCH_CHECK(
      updates.scalar_type() == data.scalar_type(), op, ": updates are ", updates.scalar_type(), " but data is ",
      data.scalar_type());
  at::Tensor out = data.clone(at::MemoryFormat::Contiguous);
  const at::Tensor pos = position_ids.to(at::kLong).contiguous();
  const int64_t ctx_len = data.size(2);
  const int64_t* p = pos.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < pos.size(0); ++b) {
    for (int64_t s = 0; s < pos.size(1); ++s) {
      const int64_t slot = p[b * pos.size(1) + s];
      if (slot < 0) continue;  // padding
      TORCH_CHECK(
          slot < ctx_len, op, ": position ", slot, " (batch ", b, ", token ", s, ") does not fit in ctx_len ",
          ctx_len, "; export with a larger ctx_len");
      out.select(0, rows[b]).select(1, slot).copy_(updates.select(0, b).select(1, s));
    }
  }
  return out;
}

void check_gather_indices(const at::Tensor& ctx_indices, int64_t ctx_len, const char* op) {
  check_indices(ctx_indices, op, "ctx_indices");
  if (ctx_indices.numel() > 0) {
    const at::Tensor idx = ctx_indices.to(at::kLong);
    const int64_t lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
    TORCH_CHECK(
        lo >= 0 && hi < ctx_len, op, ": ctx_indices must lie in [0, ", ctx_len, "), got [", lo, ", ", hi, "]");
  }
}

}  // namespace

at::Tensor ctx_scatter(const at::Tensor& data, const at::Tensor& position_ids, const at::Tensor& updates) {
  TORCH_CHECK(data.dim() == 4, "ctx_scatter: data must be [batch, heads, ctx_len, head_dim], got ", data.sizes());
  TORCH_CHECK(
      position_ids.dim() == 2 && position_ids.size(0) == data.size(0),
      "ctx_scatter: position_ids must be [batch, seq_len] with batch ", data.size(0), ", got ", position_ids.sizes());
  std::vector<int64_t> rows(data.size(0));
  for (int64_t b = 0; b < data.size(0); ++b) rows[b] = b;
  return scatter_rows(data, rows, position_ids, updates, "ctx_scatter");
}

at::Tensor ctx_gather(const at::Tensor& data, const at::Tensor& ctx_indices) {
  TORCH_CHECK(data.dim() == 4, "ctx_gather: data must be [batch, heads, ctx_len, head_dim], got ", data.sizes());
  TORCH_CHECK(
      ctx_indices.dim() == 3 && ctx_indices.size(0) == data.size(0) && ctx_indices.size(1) == data.size(1),
      "ctx_gather: ctx_indices must be [batch, heads, n] with batch ", data.size(0), " and heads ", data.size(1),
      ", got ", ctx_indices.sizes());
  check_gather_indices(ctx_indices, data.size(2), "ctx_gather");
  const at::Tensor idx = ctx_indices.to(at::kLong);
  return at::gather(data, 2, idx.unsqueeze(-1).expand({idx.size(0), idx.size(1), idx.size(2), data.size(3)}));
}

at::Tensor ctx_scatter_cb(
    const at::Tensor& data, const at::Tensor& batch_index, const at::Tensor& position_ids, const at::Tensor& updates) {
  TORCH_CHECK(
      data.dim() == 4, "ctx_scatter_cb: data must be [full_batch_size, heads, ctx_len, head_dim], got ", data.sizes());
  const std::vector<int64_t> rows = batch_rows(batch_index, data.size(0), "ctx_scatter_cb");
  return scatter_rows(data, rows, position_ids, updates, "ctx_scatter_cb");
}

// out[b, h, n] = data[batch_index[b], h, ctx_indices[b, h, n]].
at::Tensor ctx_gather_cb(const at::Tensor& data, const at::Tensor& batch_index, const at::Tensor& ctx_indices) {
  TORCH_CHECK(
      data.dim() == 4, "ctx_gather_cb: data must be [full_batch_size, heads, ctx_len, head_dim], got ", data.sizes());
  const std::vector<int64_t> rows = batch_rows(batch_index, data.size(0), "ctx_gather_cb");
  TORCH_CHECK(
      ctx_indices.dim() == 3 && ctx_indices.size(0) == static_cast<int64_t>(rows.size()) &&
          ctx_indices.size(1) == data.size(1),
      "ctx_gather_cb: ctx_indices must be [batch, heads, n] with batch ", rows.size(), " and heads ", data.size(1),
      ", got ", ctx_indices.sizes());
  check_gather_indices(ctx_indices, data.size(2), "ctx_gather_cb");
  const at::Tensor selected = data.index_select(0, batch_index.to(at::kLong).reshape({-1}));
  const at::Tensor idx = ctx_indices.to(at::kLong);
  return at::gather(selected, 2, idx.unsqueeze(-1).expand({idx.size(0), idx.size(1), idx.size(2), data.size(3)}));
}

}  // namespace qaic
