// The forward context: per-thread state that the qaic ops read at run time.
//
// Why it lives in C++: the KV-cache update and attention kernels resolve their layer on
// every call. Keeping the context next to the kernels makes that resolution a hash
// lookup with no trip through Python, and `thread_local` storage gives every Python
// thread its own context (Python threads are OS threads) without any locking.
//
// Lifecycle: Python's `set_forward_context(...)` builds a ForwardContext and pushes it
// on this thread's stack for exactly one forward pass; leaving the `with` block pops it.
// A fresh context starts with kv_cache_layer_index == 0, which is how the index is
// reset at every forward pass.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace qaic {

// The magic layer name: "take the next layer in model order from the context".
constexpr const char* kFromForwardContext = "from_forward_context";

// Attention metadata for one forward pass over a batch of sequences.
//
// slot_mapping     [num_tokens]       cache slot of each token (-1 = padding row)
// block_tables     [num_seqs, max_b]  block ids of each sequence, in position order
// seq_lens         [num_seqs]         tokens in the cache after this step (context + new)
// query_start_loc  [num_seqs + 1]     offsets of each sequence's new tokens in the batch
//
// Only slot_mapping is needed to update caches; attention needs the other three.
struct AttentionMetadata {
  at::Tensor slot_mapping;
  std::optional<at::Tensor> block_tables;
  std::optional<at::Tensor> seq_lens;
  std::optional<at::Tensor> query_start_loc;

  // Host copies, made once per forward pass so that the per-layer attention kernel
  // never re-reads (or re-validates) metadata tensors.
  std::vector<int64_t> seq_lens_host;
  std::vector<int64_t> query_start_loc_host;
  at::Tensor block_tables_i64;  // contiguous int64 copy of block_tables
  at::Tensor slot_mapping_i64;  // contiguous int64 slot_mapping (what ONNX pieces bind)
  bool has_attention = false;

  AttentionMetadata(
      at::Tensor slot_mapping,
      std::optional<at::Tensor> block_tables,
      std::optional<at::Tensor> seq_lens,
      std::optional<at::Tensor> query_start_loc);

  int64_t num_seqs() const {
    return static_cast<int64_t>(seq_lens_host.size());
  }
  // Throws a message naming `op` when the attention fields were not provided.
  void require_attention(const char* op) const;
};

using LayerCaches = std::vector<at::Tensor>;

struct LayerEntry {
  LayerCaches caches;
  // Position in all_kv_cache_layers, or -1 for a layer that is only addressed by name.
  int64_t order = -1;
};

struct ResolvedLayer {
  const std::string* name;
  const LayerCaches* caches;
};

class ForwardContext {
 public:
  ForwardContext(
      std::shared_ptr<AttentionMetadata> attn_metadata,
      std::unordered_map<std::string, LayerCaches> kv_caches,
      std::vector<std::string> all_kv_cache_layers);

  // Resolves `layer_name` for a KV-cache update op named `op`. The magic name takes
  // all_kv_cache_layers[kv_cache_layer_index] and advances the index; any other name is
  // looked up directly and leaves the index alone.
  ResolvedLayer resolve_for_update(const std::string& layer_name, const char* op);
  // Direct lookup: never advances the index.
  ResolvedLayer lookup(const std::string& layer_name, const char* op) const;
  // Lookup for ops that read a layer's cache (attention). When this pass updates caches
  // through "from_forward_context", it also proves that the layer's update already ran:
  // a layer read before its turn means all_kv_cache_layers is not in model order, and
  // the update just written went into another layer's cache.
  ResolvedLayer lookup_for_read(const std::string& layer_name, const char* op) const;

  const AttentionMetadata& attn_metadata() const {
    return *attn_metadata_;
  }
  std::shared_ptr<AttentionMetadata> attn_metadata_ptr() const {
    return attn_metadata_;
  }
  const std::unordered_map<std::string, LayerEntry>& kv_caches() const {
    return kv_caches_;
  }
  const std::vector<std::string>& all_kv_cache_layers() const {
    return all_kv_cache_layers_;
  }
  int64_t kv_cache_layer_index() const {
    return kv_cache_layer_index_;
  }
  void reset_kv_cache_layer_index() {
    kv_cache_layer_index_ = 0;
  }
  // Undo resolutions of a piece that failed before it wrote anything, so the eager
  // fallback resolves the same layers again. Only moves backwards.
  void rewind_kv_cache_layer_index(int64_t to);

 private:
  [[noreturn]] void unknown_layer(const std::string& name, const char* op) const;

  std::shared_ptr<AttentionMetadata> attn_metadata_;
  std::unordered_map<std::string, LayerEntry> kv_caches_;
  std::vector<std::string> all_kv_cache_layers_;
  int64_t kv_cache_layer_index_ = 0;
};

// This thread's stack of contexts. Nested `set_forward_context` blocks push and pop.
void push_forward_context(std::shared_ptr<ForwardContext> ctx);
void pop_forward_context(const std::shared_ptr<ForwardContext>& ctx);
bool has_forward_context();
// The innermost context of this thread; throws a clear error when none is set.
ForwardContext& current_forward_context(const char* caller);
std::shared_ptr<ForwardContext> current_forward_context_ptr(const char* caller);

}  // namespace qaic
