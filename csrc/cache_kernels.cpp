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

template <typename index_t>
void scatter_rows(
    const at::Tensor& src, at::Tensor& cache, const index_t* slots, int64_t num_tokens) {
  const int64_t heads = cache.size(1);
  const int64_t block_size = cache.size(2);
  const int64_t head_size = cache.size(3);
  const int64_t esize = cache.element_size();
  const int64_t row_bytes = head_size * esize;
  const int64_t s_tok = src.stride(0) * esize;
  const int64_t s_head = src.stride(1) * esize;
  const char* src_base = static_cast<const char*>(src.const_data_ptr());
  char* cache_base = static_cast<char*>(cache.data_ptr());
  // Small writes (decode) stay on the calling thread; threading only pays off once a
  // chunk moves tens of kilobytes.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, heads * row_bytes));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = static_cast<int64_t>(slots[t]);
      if (slot < 0) {
        continue;  // padding: never touch the cache, above all not slot -1 == "last"
      }
      const int64_t block = slot / block_size;
      const int64_t offset = slot % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(
            cache_base + ((block * heads + h) * block_size + offset) * row_bytes,
            src_base + t * s_tok + h * s_head, row_bytes);
      }
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
    scatter_rows(k, key_cache, s, num_tokens);
    scatter_rows(v, value_cache, s, num_tokens);
  });
}

}  // namespace qaic
