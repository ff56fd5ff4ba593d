// reshape_and_cache: scatter this step's key/value rows into a (paged) KV cache.
//
// Cache layout [num_blocks, num_kv_heads, block_size, head_size]. With num_blocks = batch
// and block_size = ctx_len this is the QAIC retained-state layout
// [batch, kv_heads, ctx_len, head_dim]; with small blocks it is a paged cache. One layout
// serves both, so the engine, the ONNX lowering and the exporter share one addressing rule:
//   slot = block * block_size + offset,  slot == -1  => padding, writes nothing.
//
// The kernel copies bytes, so it is dtype-agnostic; the dtype list below is what we test.
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace qaic {

namespace {

bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_pair(
    const at::Tensor& src, const at::Tensor& cache, const char* src_name,
    const char* cache_name) {
  TORCH_CHECK(
      src.dim() == 3, "reshape_and_cache: ", src_name,
      " must be [num_tokens, num_kv_heads, head_size], got shape ", src.sizes());
  TORCH_CHECK(
      cache.dim() == 4, "reshape_and_cache: ", cache_name,
      " must be [num_blocks, num_kv_heads, block_size, head_size], got shape ",
      cache.sizes());
  TORCH_CHECK(
      src.device() == cache.device(), "reshape_and_cache: ", src_name, " is on ",
      src.device(), " but ", cache_name, " is on ", cache.device(),
      "; move them to the same device");
  TORCH_CHECK(
      src.size(1) == cache.size(1), "reshape_and_cache: ", src_name, " has ", src.size(1),
      " kv heads but ", cache_name, " has ", cache.size(1));
  TORCH_CHECK(
      src.size(2) == cache.size(3), "reshape_and_cache: ", src_name, " has head_size ",
      src.size(2), " but ", cache_name, " has head_size ", cache.size(3));
  TORCH_CHECK(
      src.scalar_type() == cache.scalar_type(), "reshape_and_cache: ", src_name, " is ",
      src.scalar_type(), " but ", cache_name, " is ", cache.scalar_type(),
      "; cast the new tokens to the cache dtype");
  TORCH_CHECK(
      supported_dtype(cache.scalar_type()), "reshape_and_cache: unsupported dtype ",
      cache.scalar_type(), " (supported: float32, float16, bfloat16)");
  TORCH_CHECK(
      cache.is_contiguous(), "reshape_and_cache: ", cache_name,
      " must be contiguous (the kernel addresses slots by offset); allocate it with "
      "torch.empty/zeros, not as a view");
}

template <typename index_t>
void validate_slots(const index_t* slots, int64_t n, int64_t num_slots) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = static_cast<int64_t>(slots[t]);
    TORCH_CHECK(
        s >= -1 && s < num_slots, "reshape_and_cache: slot_mapping[", t, "] = ", s,
        " is out of range; valid slots are 0..", num_slots - 1,
        " (num_blocks * block_size) and -1 marks a padding token");
  }
}

// Row geometry of one (source, cache) pair, in bytes.
struct RowCopy {
  const char* src;
  char* cache;
  int64_t s_tok, s_head, row_bytes, heads, block_size;

  RowCopy(const at::Tensor& s, at::Tensor& c)
      : src(static_cast<const char*>(s.const_data_ptr())),
        cache(static_cast<char*>(c.data_ptr())),
        s_tok(s.stride(0) * s.element_size()),
        s_head(s.stride(1) * s.element_size()),
        row_bytes(c.size(3) * c.element_size()),
        heads(c.size(1)),
        block_size(c.size(2)) {}

  void copy_token(int64_t t, int64_t block, int64_t offset) const {
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(
          cache + ((block * heads + h) * block_size + offset) * row_bytes,
          src + t * s_tok + h * s_head, row_bytes);
    }
  }
};

template <typename index_t>
void scatter_rows(const RowCopy& k, const RowCopy& v, const index_t* slots, int64_t num_tokens) {
  const int64_t token_bytes = k.heads * k.row_bytes + v.heads * v.row_bytes;
  // K and V in one parallel region: entering a region costs microseconds, which is the
  // whole budget of a decode-sized write. Small writes stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (128 * 1024) / std::max<int64_t>(1, token_bytes));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = static_cast<int64_t>(slots[t]);
      if (slot < 0) {
        continue;  // padding: never touch the cache, above all not slot -1 == "last"
      }
      const int64_t block = slot / k.block_size;
      const int64_t offset = slot % k.block_size;
      k.copy_token(t, block, offset);
      v.copy_token(t, block, offset);
    }
  });
}

}  // namespace

void reshape_and_cache(
    const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
    at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_pair(key, key_cache, "key", "key_cache");
  check_pair(value, value_cache, "value", "value_cache");
  TORCH_CHECK(
      key_cache.size(0) == value_cache.size(0) && key_cache.size(2) == value_cache.size(2),
      "reshape_and_cache: key_cache and value_cache must share num_blocks and block_size, "
      "got ", key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(
      slot_mapping.dim() == 1, "reshape_and_cache: slot_mapping must be 1-D, got shape ",
      slot_mapping.sizes());
  TORCH_CHECK(
      slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
      "reshape_and_cache: slot_mapping must be int32 or int64, got ",
      slot_mapping.scalar_type());
  TORCH_CHECK(
      slot_mapping.device() == key_cache.device(), "reshape_and_cache: slot_mapping is on ",
      slot_mapping.device(), " but the caches are on ", key_cache.device());
  // key may carry padding rows past the real tokens; slot_mapping decides how many count.
  const int64_t num_tokens = slot_mapping.size(0);
  TORCH_CHECK(
      key.size(0) >= num_tokens && value.size(0) >= num_tokens,
      "reshape_and_cache: slot_mapping has ", num_tokens, " tokens but key has ",
      key.size(0), " rows and value has ", value.size(0));
  TORCH_CHECK(
      key_cache.device().is_cpu(),
      "reshape_and_cache: only CPU tensors are supported by this build, got ",
      key_cache.device());

  // Rows must be contiguous for memcpy; other strides (a split of a fused qkv) are fine.
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(2);

  AT_DISPATCH_INDEX_TYPES(slots.scalar_type(), "reshape_and_cache", [&] {
    const index_t* s = slots.const_data_ptr<index_t>();
    // Validate every slot before writing any, so a bad call leaves the cache untouched.
    validate_slots(s, num_tokens, num_slots);
    scatter_rows(RowCopy(k, key_cache), RowCopy(v, value_cache), s, num_tokens);
  });
}

}  // namespace qaic
