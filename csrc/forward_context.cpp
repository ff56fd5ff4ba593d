// Per-thread forward context; see forward_context.h for the why.
#include "forward_context.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace qaic {

namespace {

thread_local std::vector<std::shared_ptr<ForwardContext>> tls_stack;

std::vector<int64_t> to_host_vector(const at::Tensor& t, const char* name) {
  TORCH_CHECK(
      t.dim() == 1, "AttentionMetadata.", name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(
      t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
      "AttentionMetadata.", name, " must be int32 or int64, got ", t.scalar_type());
  at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

std::string join_names(const std::vector<std::string>& names) {
  std::ostringstream os;
  for (size_t i = 0; i < names.size(); ++i) {
    os << (i ? ", " : "") << '\'' << names[i] << '\'';
  }
  return os.str();
}

}  // namespace

AttentionMetadata::AttentionMetadata(
    at::Tensor slot_mapping_,
    std::optional<at::Tensor> block_tables_,
    std::optional<at::Tensor> seq_lens_,
    std::optional<at::Tensor> query_start_loc_)
    : slot_mapping(std::move(slot_mapping_)),
      block_tables(std::move(block_tables_)),
      seq_lens(std::move(seq_lens_)),
      query_start_loc(std::move(query_start_loc_)) {
  TORCH_CHECK(
      slot_mapping.dim() == 1,
      "AttentionMetadata.slot_mapping must be 1-D [num_tokens], got shape ",
      slot_mapping.sizes());
  TORCH_CHECK(
      slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
      "AttentionMetadata.slot_mapping must be int32 or int64, got ",
      slot_mapping.scalar_type());
  slot_mapping_i64 = slot_mapping.to(at::kLong).contiguous();
  // Checked once here for both update paths: the kernel refuses a slot below -1, but the
  // lowered KVCacheScatter reads every negative slot as padding and would skip the write.
  if (slot_mapping_i64.numel() > 0) {
    const int64_t lowest = slot_mapping_i64.min().item<int64_t>();
    TORCH_CHECK(
        lowest >= -1, "AttentionMetadata.slot_mapping entries must be >= -1 (-1 marks a padded "
        "token), got ", lowest);
    // Two tokens writing one slot: the kernel keeps the last write, the lowered scatter an
    // unspecified one, so the two update paths would disagree on the cache.
    const at::Tensor real = std::get<0>(slot_mapping_i64.masked_select(slot_mapping_i64 >= 0).sort());
    if (real.numel() > 1) {
      const at::Tensor same = real.slice(0, 1).eq(real.slice(0, 0, -1));
      TORCH_CHECK(
          !same.any().item<bool>(), "AttentionMetadata.slot_mapping writes slot ",
          real.slice(0, 1).masked_select(same)[0].item<int64_t>(),
          " more than once; every token needs a slot of its own (-1 for padding)");
    }
  }
  const int given = int(block_tables.has_value()) + int(seq_lens.has_value()) +
      int(query_start_loc.has_value());
  TORCH_CHECK(
      given == 0 || given == 3,
      "AttentionMetadata: block_tables, seq_lens and query_start_loc go together "
      "(attention needs all three); pass all of them or none");
  if (given == 0) {
    return;
  }
  has_attention = true;
  seq_lens_host = to_host_vector(*seq_lens, "seq_lens");
  query_start_loc_host = to_host_vector(*query_start_loc, "query_start_loc");
  const int64_t n = num_seqs();
  TORCH_CHECK(
      static_cast<int64_t>(query_start_loc_host.size()) == n + 1,
      "AttentionMetadata.query_start_loc must have num_seqs + 1 = ", n + 1,
      " entries, got ", query_start_loc_host.size());
  TORCH_CHECK(
      query_start_loc_host[0] == 0, "AttentionMetadata.query_start_loc must start at 0");
  for (int64_t b = 0; b < n; ++b) {
    const int64_t q = query_start_loc_host[b + 1] - query_start_loc_host[b];
    TORCH_CHECK(
        q >= 0, "AttentionMetadata.query_start_loc must be non-decreasing (sequence ", b,
        ")");
    TORCH_CHECK(
        seq_lens_host[b] >= q, "AttentionMetadata: sequence ", b, " has ", q,
        " new tokens but seq_len ", seq_lens_host[b],
        "; seq_lens counts cached plus new tokens");
  }
  TORCH_CHECK(
      query_start_loc_host[n] <= slot_mapping.size(0),
      "AttentionMetadata: query_start_loc ends at ", query_start_loc_host[n],
      " but slot_mapping has only ", slot_mapping.size(0), " tokens");
  const at::Tensor& bt = *block_tables;
  TORCH_CHECK(
      bt.dim() == 2 && bt.size(0) == n,
      "AttentionMetadata.block_tables must be [num_seqs=", n, ", max_blocks], got shape ",
      bt.sizes());
  TORCH_CHECK(
      bt.scalar_type() == at::kInt || bt.scalar_type() == at::kLong,
      "AttentionMetadata.block_tables must be int32 or int64, got ", bt.scalar_type());
  block_tables_i64 = bt.to(at::kCPU, at::kLong).contiguous();
}

void AttentionMetadata::require_attention(const char* op) const {
  TORCH_CHECK(
      has_attention, op,
      " needs attention metadata: pass block_tables, seq_lens and query_start_loc to "
      "AttentionMetadata (only slot_mapping was given)");
}

ForwardContext::ForwardContext(
    std::shared_ptr<AttentionMetadata> attn_metadata,
    std::unordered_map<std::string, LayerCaches> kv_caches,
    std::vector<std::string> all_kv_cache_layers)
    : attn_metadata_(std::move(attn_metadata)),
      all_kv_cache_layers_(std::move(all_kv_cache_layers)) {
  TORCH_CHECK(attn_metadata_ != nullptr, "ForwardContext needs attention metadata");
  kv_caches_.reserve(kv_caches.size());
  for (auto& kv : kv_caches) {
    TORCH_CHECK(
        kv.first != kFromForwardContext, "'", kFromForwardContext,
        "' is reserved and cannot be a layer name");
    kv_caches_.emplace(kv.first, LayerEntry{std::move(kv.second), -1});
  }
  for (size_t i = 0; i < all_kv_cache_layers_.size(); ++i) {
    const std::string& name = all_kv_cache_layers_[i];
    auto it = kv_caches_.find(name);
    if (it == kv_caches_.end()) {
      unknown_layer(name, "set_forward_context(all_kv_cache_layers=...)");
    }
    TORCH_CHECK(
        it->second.order < 0, "set_forward_context: layer '", name,
        "' appears twice in all_kv_cache_layers");
    it->second.order = static_cast<int64_t>(i);
  }
}

ResolvedLayer ForwardContext::resolve_for_update(const std::string& layer_name, const char* op) {
  if (layer_name == kFromForwardContext) {
    const int64_t registered = static_cast<int64_t>(all_kv_cache_layers_.size());
    TORCH_CHECK(
        kv_cache_layer_index_ < registered, op, " called ", kv_cache_layer_index_ + 1,
        " times but ", registered,
        " KV-cache layers are registered in the forward context; every layer must call "
        "it exactly once per forward pass, in model order (all_kv_cache_layers=[",
        join_names(all_kv_cache_layers_), "])");
    const std::string& name = all_kv_cache_layers_[kv_cache_layer_index_++];
    return ResolvedLayer{&name, &kv_caches_.find(name)->second.caches};
  }
  return lookup(layer_name, op);
}

ResolvedLayer ForwardContext::lookup(const std::string& layer_name, const char* op) const {
  auto it = kv_caches_.find(layer_name);
  if (it == kv_caches_.end()) {
    unknown_layer(layer_name, op);
  }
  return ResolvedLayer{&it->first, &it->second.caches};
}

ResolvedLayer ForwardContext::lookup_for_read(const std::string& layer_name, const char* op) const {
  if (layer_name == kFromForwardContext) {
    // Attention reads the layer whose update ran last: every layer updates its cache and
    // then attends over it, so with the magic name on both ops no per-layer constant is
    // left in a traced frame (a whole decoder block compiles once).
    TORCH_CHECK(
        kv_cache_layer_index_ > 0, op, " was called with '", kFromForwardContext,
        "' before any 'from_forward_context' KV-cache update ran in this forward pass; it "
        "reads the layer updated last, so call the cache update first (or pass the layer's "
        "real name)");
    const std::string& name = all_kv_cache_layers_[kv_cache_layer_index_ - 1];
    return ResolvedLayer{&name, &kv_caches_.find(name)->second.caches};
  }
  auto it = kv_caches_.find(layer_name);
  if (it == kv_caches_.end()) {
    unknown_layer(layer_name, op);
  }
  const int64_t order = it->second.order;
  TORCH_CHECK(
      kv_cache_layer_index_ == 0 || order < 0 || order < kv_cache_layer_index_, op,
      ": layer '", layer_name, "' is read before its KV-cache update ran: this pass has "
      "resolved ", kv_cache_layer_index_, " 'from_forward_context' update(s) but '",
      layer_name, "' is number ", order + 1,
      " in all_kv_cache_layers. all_kv_cache_layers must list the layers in the order the "
      "model calls them, or each update lands in another layer's cache");
  return ResolvedLayer{&it->first, &it->second.caches};
}

void ForwardContext::unknown_layer(const std::string& name, const char* op) const {
  std::vector<std::string> known;
  known.reserve(kv_caches_.size());
  for (const auto& kv : kv_caches_) {
    known.push_back(kv.first);
  }
  std::sort(known.begin(), known.end());
  TORCH_CHECK(
      false, op, ": unknown KV-cache layer '", name,
      "'; the forward context knows: [", join_names(known), "]",
      name == kFromForwardContext ? "" : " (or pass 'from_forward_context' to take the next layer in order)");
}

void ForwardContext::rewind_kv_cache_layer_index(int64_t to) {
  TORCH_CHECK(
      to >= 0 && to <= kv_cache_layer_index_, "rewind_kv_cache_layer_index: can only move back "
      "(index is ", kv_cache_layer_index_, ", asked for ", to, ")");
  kv_cache_layer_index_ = to;
}

void push_forward_context(std::shared_ptr<ForwardContext> ctx) {
  TORCH_CHECK(ctx != nullptr, "push_forward_context: null context");
  tls_stack.push_back(std::move(ctx));
}

void pop_forward_context(const std::shared_ptr<ForwardContext>& ctx) {
  TORCH_CHECK(!tls_stack.empty(), "pop_forward_context: no forward context is set");
  if (tls_stack.back() == ctx) {
    tls_stack.pop_back();
    return;
  }
  // Left out of order: another context entered later on this thread is still current,
  // as when two forwards interleave on one thread (generators, asyncio tasks) and one
  // holds its context across a yield or await. Remove the leaving context itself, so the
  // other keeps its own, and say so: while both were entered, the ops of the suspended
  // forward resolved their layers and caches through the other one.
  for (auto it = tls_stack.begin(); it != tls_stack.end(); ++it) {
    if (*it == ctx) {
      tls_stack.erase(it);
      TORCH_CHECK(
          false,
          "set_forward_context: forward contexts were left out of order on this thread (a "
          "context entered later is still set). Two forward passes interleaved on one "
          "thread, e.g. generators or asyncio tasks that hold a context across a yield or "
          "await; their KV-cache ops may have used each other's caches. Run each forward "
          "pass to completion inside its context, or run concurrent forwards on separate "
          "threads (contexts are per thread)");
    }
  }
  TORCH_CHECK(false, "pop_forward_context: this context is not set on this thread");
}

bool has_forward_context() {
  return !tls_stack.empty();
}

std::shared_ptr<ForwardContext> current_forward_context_ptr(const char* caller) {
  TORCH_CHECK(
      !tls_stack.empty(), caller,
      ": no forward context is set on this thread; run the model inside "
      "`with qaic_dynamo.set_forward_context(attn_metadata, kv_caches):`");
  return tls_stack.back();
}

ForwardContext& current_forward_context(const char* caller) {
  return *current_forward_context_ptr(caller);
}

}  // namespace qaic
