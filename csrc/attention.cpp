// Paged causal attention over the forward context's batch of sequences.
//
// For each sequence b the new tokens are query rows query_start_loc[b]..[b+1]; they sit at
// the last positions of a context of seq_lens[b] tokens whose K/V are read from the cache
// through block_tables[b]. Each sequence is handed to ATen's scaled_dot_product_attention
// (GQA through enable_gqa), so numerics and the fast CPU kernel are PyTorch's own; this
// file only does the paging and the masking.
#include "forward_context.h"
#include "ops.h"

#include <c10/util/Exception.h>

namespace qaic {

namespace {

// K or V of one sequence as [heads, L, head_size]. A sequence held in a single block (the
// QAIC retained-state layout, block_size == ctx_len) is a view: no copy, so the cost of a
// decode step does not grow with cache capacity. Otherwise only this sequence's blocks
// are gathered.
at::Tensor gather_sequence(
    const at::Tensor& cache, const int64_t* blocks, int64_t max_blocks, int64_t len,
    const char* op) {
  const int64_t num_blocks = cache.size(0);
  const int64_t block_size = cache.size(2);
  const int64_t needed = (len + block_size - 1) / block_size;
  TORCH_CHECK(
      needed <= max_blocks, op, ": a sequence of ", len, " tokens needs ", needed,
      " blocks of ", block_size, " but block_tables has only ", max_blocks, " columns");
  for (int64_t i = 0; i < needed; ++i) {
    TORCH_CHECK(
        blocks[i] >= 0 && blocks[i] < num_blocks, op, ": block_tables entry ", blocks[i],
        " is out of range for a cache of ", num_blocks, " blocks");
  }
  if (needed == 1) {
    return cache.select(0, blocks[0]).narrow(1, 0, len);
  }
  at::Tensor idx = at::from_blob(
      const_cast<int64_t*>(blocks), {needed}, at::TensorOptions().dtype(at::kLong));
  return cache.index_select(0, idx)
      .permute({1, 0, 2, 3})
      .reshape({cache.size(1), needed * block_size, cache.size(3)})
      .narrow(1, 0, len);
}

}  // namespace

at::Tensor paged_attention(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const std::optional<at::Tensor>& extra_key_cache, std::optional<double> scale,
    std::optional<int64_t> sliding_window, const char* op) {
  const ForwardContext& ctx = current_forward_context(op);
  const AttentionMetadata& md = ctx.attn_metadata();
  md.require_attention(op);

  TORCH_CHECK(
      query.dim() == 3, op, ": query must be [num_tokens, num_heads, head_size], got ",
      query.sizes());
  TORCH_CHECK(
      query.scalar_type() == key_cache.scalar_type(), op, ": query is ",
      query.scalar_type(), " but the KV cache is ", key_cache.scalar_type());
  TORCH_CHECK(
      query.device() == key_cache.device(), op, ": query is on ", query.device(),
      " but the KV cache is on ", key_cache.device());
  const int64_t kv_heads = key_cache.size(1);
  TORCH_CHECK(
      query.size(1) % kv_heads == 0, op, ": ", query.size(1),
      " query heads are not a multiple of ", kv_heads, " kv heads");
  const int64_t key_dim = key_cache.size(3) + (extra_key_cache ? extra_key_cache->size(3) : 0);
  TORCH_CHECK(
      query.size(2) == key_dim, op, ": query head_size ", query.size(2),
      " does not match the cached key head_size ", key_dim);
  TORCH_CHECK(
      !sliding_window || *sliding_window > 0, op, ": sliding_window must be positive, got ",
      sliding_window.value_or(0));

  const int64_t num_seqs = md.num_seqs();
  const int64_t total = md.query_start_loc_host[num_seqs];
  TORCH_CHECK(
      query.size(0) >= total, op, ": query has ", query.size(0),
      " rows but the batch has ", total, " tokens");
  const bool same_kv = value_cache.is_same(key_cache);
  const bool gqa = query.size(1) != kv_heads;
  const int64_t max_blocks = md.block_tables_i64.size(1);
  const int64_t* bt = md.block_tables_i64.const_data_ptr<int64_t>();

  // Padding rows (past the last sequence) stay zero.
  at::Tensor out = at::zeros(
      {query.size(0), query.size(1), value_cache.size(3)}, query.options());
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q0 = md.query_start_loc_host[b];
    const int64_t n = md.query_start_loc_host[b + 1] - q0;
    if (n == 0) {
      continue;
    }
    int64_t start = 0;  // first cached position any query row may see
    const int64_t len = md.seq_lens_host[b];
    if (sliding_window && len - n + 1 > *sliding_window) {
      start = len - n + 1 - *sliding_window;
    }
    const int64_t* row = bt + b * max_blocks;
    at::Tensor k = gather_sequence(key_cache, row, max_blocks, len, op);
    at::Tensor v = same_kv ? k : gather_sequence(value_cache, row, max_blocks, len, op);
    if (extra_key_cache) {
      k = at::cat({k, gather_sequence(*extra_key_cache, row, max_blocks, len, op)}, -1);
    }
    if (start > 0) {
      k = k.narrow(1, start, len - start);
      v = v.narrow(1, start, len - start);
    }
    const int64_t kv_len = len - start;
    // Query row j sits at absolute position len - n + j and sees positions
    // (pos - window, pos]. A lone decode token sees everything left after `start`, and a
    // full prefill is plain causal; only chunks and windows need an explicit mask.
    std::optional<at::Tensor> mask;
    bool causal = false;
    if (n == kv_len && start == 0 && !sliding_window) {
      causal = n > 1;
    } else if (n > 1 || sliding_window) {
      at::Tensor pos = at::arange(len - n, len, at::kLong).unsqueeze(1);  // [n, 1]
      at::Tensor key_pos = at::arange(start, len, at::kLong).unsqueeze(0);  // [1, kv_len]
      at::Tensor allowed = key_pos <= pos;
      if (sliding_window) {
        allowed = allowed & (key_pos > pos - *sliding_window);
      }
      mask = allowed;
    }
    at::Tensor q = query.narrow(0, q0, n).transpose(0, 1).unsqueeze(0);  // [1, Hq, n, D]
    at::Tensor o = at::scaled_dot_product_attention(
        q, k.unsqueeze(0), v.unsqueeze(0), mask, 0.0, causal, scale, gqa);
    out.narrow(0, q0, n).copy_(o.squeeze(0).transpose(0, 1));
  }
  return out;
}

}  // namespace qaic
