// Kernel entry points of the qaic op library. Schemas live in ops.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace qaic {

// cache_kernels.cpp
void reshape_and_cache(
    const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
    at::Tensor& value_cache, const at::Tensor& slot_mapping);

// retained_state.cpp: QEfficient's retained-state KV write and read (deployment export)
at::Tensor ctx_scatter(const at::Tensor& data, const at::Tensor& position_ids, const at::Tensor& updates);
at::Tensor ctx_gather(const at::Tensor& data, const at::Tensor& ctx_indices);
at::Tensor ctx_scatter_cb(
    const at::Tensor& data, const at::Tensor& batch_index, const at::Tensor& position_ids, const at::Tensor& updates);
at::Tensor ctx_gather_cb(const at::Tensor& data, const at::Tensor& batch_index, const at::Tensor& ctx_indices);

// attention.cpp
at::Tensor paged_attention(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const std::optional<at::Tensor>& extra_key_cache, std::optional<double> scale,
    std::optional<int64_t> sliding_window, const char* op,
    std::optional<double> softcap = std::nullopt,
    const std::optional<at::Tensor>& sinks = std::nullopt);

}  // namespace qaic
