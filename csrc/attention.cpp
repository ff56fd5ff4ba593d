// Paged causal attention over the forward context's batch of sequences.
//
// For each sequence b the new tokens are query rows query_start_loc[b]..[b+1]; they sit at
// the last positions of a context of seq_lens[b] tokens whose K/V are read from the cache
// through block_tables[b]. Each sequence is handed to ATen's scaled_dot_product_attention
// (GQA through enable_gqa), so numerics and the fast CPU kernel are PyTorch's own; this
// file only does the paging and the masking.
#include "forward_context.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <omp.h>

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace qaic {

namespace {

// Work below this many multiply-adds stays on the calling thread. Why it matters: in a
// compiled model attention is the only PyTorch work between ONNX Runtime pieces, and an
// OpenMP region leaves PyTorch's workers spinning for a while afterwards, taking cores
// from ONNX Runtime's threads (and once the runtime has released them, the next region
// starts them again). A decode step's attention is small, so it runs serially, and so does
// a small prefill's (SDPA under SerialScope); below this size one thread is also faster on
// its own.
constexpr int64_t kSerialDecodeWork = int64_t(1) << 22;

// PyTorch's parallel_for (SDPA's CPU kernel uses it) asks OpenMP for the calling
// thread's team size; while this guard lives that is 1, so the work stays on this thread.
// OpenMP keeps the setting per thread: other threads' forwards are untouched.
class SerialScope {
 public:
  explicit SerialScope(bool on) {
    if (on) {
      // at::get_num_threads initialises the thread's setting once; after that ours holds.
      prev_ = at::get_num_threads();
      if (prev_ > 1) {
        omp_set_num_threads(1);
      } else {
        prev_ = 0;
      }
    }
  }
  ~SerialScope() {
    if (prev_ > 0) {
      omp_set_num_threads(prev_);
    }
  }
  SerialScope(const SerialScope&) = delete;
  SerialScope& operator=(const SerialScope&) = delete;

 private:
  int prev_ = 0;
};

struct DecodeRow {
  int64_t row;    // query row
  int64_t len;    // tokens in the cache (context + this one)
  int64_t start;  // first visible position (sliding window)
  const int64_t* blocks;
};

// One query token per sequence (decode): scores over its cached keys, softmax, weighted
// sum of its cached values, accumulated in float. The key is the concatenation of
// key_cache and (for MLA) extra_key_cache along the head dim.
template <typename scalar_t>
void decode_attention(
    const std::vector<DecodeRow>& rows, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor* extra_key_cache, float scale, float softcap,
    const float* sinks, at::Tensor& out) {
  const int64_t hq = query.size(1), dq = query.size(2);
  const int64_t hkv = key_cache.size(1), bs = key_cache.size(2), dk = key_cache.size(3);
  const int64_t dv = value_cache.size(3), de = extra_key_cache ? extra_key_cache->size(3) : 0;
  const int64_t group = hq / hkv;
  const scalar_t* q = query.const_data_ptr<scalar_t>();
  const scalar_t* kc = key_cache.const_data_ptr<scalar_t>();
  const scalar_t* vc = value_cache.const_data_ptr<scalar_t>();
  const scalar_t* ec = extra_key_cache ? extra_key_cache->const_data_ptr<scalar_t>() : nullptr;
  scalar_t* o = out.data_ptr<scalar_t>();

  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(dv);
    for (int64_t item = begin; item < end; ++item) {
      const DecodeRow& r = rows[item / hq];
      const int64_t h = item % hq, kh = h / group;
      const scalar_t* qh = q + (r.row * hq + h) * dq;
      const int64_t n = r.len - r.start;
      scores.resize(n);
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = r.start + i;
        const int64_t slot = (r.blocks[p / bs] * hkv + kh) * bs + p % bs;
        const scalar_t* k = kc + slot * dk;
        float dot = 0.f;
        for (int64_t d = 0; d < dk; ++d) dot += float(qh[d]) * float(k[d]);
        if (ec != nullptr) {
          const scalar_t* e = ec + slot * de;
          for (int64_t d = 0; d < de; ++d) dot += float(qh[dk + d]) * float(e[d]);
        }
        float s = dot * scale;
        if (softcap > 0.f) s = std::tanh(s / softcap) * softcap;
        scores[i] = s;
        mx = std::max(mx, s);
      }
      // A sink is one more logit in the softmax denominator, with no value.
      if (sinks != nullptr) mx = std::max(mx, sinks[h]);
      float sum = sinks != nullptr ? std::exp(sinks[h] - mx) : 0.f;
      for (int64_t i = 0; i < n; ++i) {
        scores[i] = std::exp(scores[i] - mx);
        sum += scores[i];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = r.start + i;
        const scalar_t* v = vc + ((r.blocks[p / bs] * hkv + kh) * bs + p % bs) * dv;
        const float w = scores[i];
        for (int64_t d = 0; d < dv; ++d) acc[d] += w * float(v[d]);
      }
      scalar_t* oh = o + (r.row * hq + h) * dv;
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < dv; ++d) oh[d] = scalar_t(acc[d] * inv);
    }
  };
  const int64_t items = static_cast<int64_t>(rows.size()) * hq;
  int64_t work = 0;
  for (const DecodeRow& r : rows) work += (r.len - r.start) * (dq + dv) * hq;
  if (work < kSerialDecodeWork) {
    run(0, items);
  } else {
    at::parallel_for(0, items, 1, run);
  }
}

// K or V of one sequence as [heads, L, head_size]. A sequence held in a single block (the
// QAIC retained-state layout, block_size == ctx_len) is a view: no copy, so the cost of a
// decode step does not grow with cache capacity. Otherwise only this sequence's blocks
// are gathered.
// The blocks a sequence of `len` tokens uses, checked against the table and the cache.
int64_t check_blocks(
    const at::Tensor& cache, const int64_t* blocks, int64_t max_blocks, int64_t len, const char* op) {
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
  return needed;
}

at::Tensor gather_sequence(
    const at::Tensor& cache, const int64_t* blocks, int64_t max_blocks, int64_t len,
    const char* op) {
  const int64_t block_size = cache.size(2);
  const int64_t needed = check_blocks(cache, blocks, max_blocks, len, op);
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
    std::optional<int64_t> sliding_window, const char* op, std::optional<double> softcap,
    const std::optional<at::Tensor>& sinks) {
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
  // Block indices are checked against the key cache only, and the decode kernel reads
  // the value (and extra key) cache with the key cache's blocks, heads and block size:
  // they must agree, or it would read past the end of a smaller cache.
  for (const at::Tensor* other : {&value_cache, extra_key_cache ? &*extra_key_cache : nullptr}) {
    if (other == nullptr) {
      continue;
    }
    TORCH_CHECK(
        other->dim() == 4 && key_cache.dim() == 4 && other->size(0) == key_cache.size(0) &&
            other->size(1) == kv_heads && other->size(2) == key_cache.size(2),
        op, ": the layer's caches disagree: ", key_cache.sizes(), " and ", other->sizes(),
        "; every cache of a layer must be [num_blocks, num_kv_heads, block_size, head_size] "
        "with the same num_blocks, num_kv_heads and block_size");
    TORCH_CHECK(
        other->scalar_type() == key_cache.scalar_type() && other->device() == key_cache.device(),
        op, ": the layer's caches disagree: ", key_cache.scalar_type(), " on ",
        key_cache.device(), " and ", other->scalar_type(), " on ", other->device());
  }
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
  TORCH_CHECK(
      !softcap || *softcap > 0, op, ": softcap must be positive, got ", softcap.value_or(0));
  at::Tensor sinks_f;  // [num_heads] float32, contiguous
  if (sinks) {
    TORCH_CHECK(
        sinks->dim() == 1 && sinks->size(0) == query.size(1), op,
        ": sinks must be [num_heads] = [", query.size(1), "], got ", sinks->sizes());
    TORCH_CHECK(
        sinks->is_floating_point(), op, ": sinks must be floating point, got ", sinks->scalar_type());
    TORCH_CHECK(
        sinks->device() == query.device(), op, ": sinks are on ", sinks->device(),
        " but query is on ", query.device());
    sinks_f = sinks->to(at::kFloat).contiguous();
  }
  const bool plain = !softcap && !sinks;  // SDPA serves the rest

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
  // Single-token (decode) rows take the direct kernel when the caches are plain
  // contiguous tensors; everything else goes through SDPA per sequence.
  const bool direct = key_cache.is_contiguous() && value_cache.is_contiguous() &&
      (!extra_key_cache || extra_key_cache->is_contiguous());
  std::vector<DecodeRow> decode_rows;
  // The prefill work (multiply-adds of scores and weighted sums): small batches run serially
  // for the same reason as small decode steps (kSerialDecodeWork).
  int64_t prefill_work = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = md.query_start_loc_host[b + 1] - md.query_start_loc_host[b];
    if (n > 1 || !direct) {
      prefill_work += n * md.seq_lens_host[b] * (query.size(2) + value_cache.size(3)) * query.size(1);
    }
  }
  std::optional<SerialScope> serial;
  serial.emplace(prefill_work < kSerialDecodeWork);
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
    if (n == 1 && direct) {
      check_blocks(key_cache, row, max_blocks, len, op);
      decode_rows.push_back(DecodeRow{q0, len, start, row});
      continue;
    }
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
    if (plain) {
      at::Tensor o = at::scaled_dot_product_attention(
          q, k.unsqueeze(0), v.unsqueeze(0), mask, 0.0, causal, scale, gqa);
      out.narrow(0, q0, n).copy_(o.squeeze(0).transpose(0, 1));
      continue;
    }
    // Soft-capping and sinks change the logits SDPA computes internally: spelled out, in
    // float32, with the same mask.
    at::Tensor qf = q.squeeze(0).to(at::kFloat);  // [Hq, n, D]
    at::Tensor kf = k.to(at::kFloat), vf = v.to(at::kFloat);  // [Hkv, L, D]
    if (gqa) {
      kf = kf.repeat_interleave(query.size(1) / kv_heads, 0);
      vf = vf.repeat_interleave(query.size(1) / kv_heads, 0);
    }
    const double sm = scale.value_or(1.0 / std::sqrt(double(query.size(2))));
    at::Tensor scores = at::matmul(qf, kf.transpose(1, 2)) * sm;  // [Hq, n, L]
    if (softcap) {
      scores = at::tanh(scores / *softcap) * *softcap;
    }
    if (!mask && causal) {
      mask = at::ones({n, kv_len}, at::kBool).tril();
    }
    if (mask) {
      scores = scores.masked_fill(mask->logical_not(), -std::numeric_limits<float>::infinity());
    }
    if (sinks) {
      at::Tensor sink = sinks_f.view({-1, 1, 1}).expand({scores.size(0), n, 1});
      scores = at::cat({scores, sink}, -1);
    }
    at::Tensor probs = at::softmax(scores, -1);
    if (sinks) {
      probs = probs.narrow(-1, 0, kv_len);
    }
    at::Tensor o = at::matmul(probs, vf);  // [Hq, n, Dv]
    out.narrow(0, q0, n).copy_(o.transpose(0, 1));
  }
  serial.reset();  // the decode kernel below decides for itself
  if (!decode_rows.empty()) {
    const at::Tensor q = query.contiguous();
    const float sm_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(double(query.size(2)))));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "decode_attention", [&] {
      decode_attention<scalar_t>(
          decode_rows, q, key_cache, value_cache,
          extra_key_cache ? &extra_key_cache.value() : nullptr, sm_scale,
          static_cast<float>(softcap.value_or(0.0)), sinks ? sinks_f.const_data_ptr<float>() : nullptr, out);
    });
  }
  return out;
}

}  // namespace qaic
