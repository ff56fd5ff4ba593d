// The qaic op library: schemas, the layer-resolving ops, and the Python module.
//
// Every op is declared in the TORCH_LIBRARY(qaic) block below and has a CPU kernel here
// or in a sibling file. Fake (meta) kernels live in qaic_dynamo/ops/fake.py so that Dynamo can
// trace the ops without running them.
//
// The unified_* ops take a layer name instead of cache tensors. That is the point of
// them: a traced graph only carries the name, so with the magic name
// "from_forward_context" every layer's graph is the same and one compiled artifact
// serves all of them. The caches and metadata come from the thread's forward context.
#include <torch/extension.h>
#include <torch/library.h>

#include "forward_context.h"
#include "ops.h"

namespace qaic {

namespace {

at::Tensor dependency_token(const at::Tensor& like) {
  // An empty tensor: it exists only so the graph orders attention after the update.
  return at::empty({0}, like.options());
}

const LayerCaches& expect_two(const ResolvedLayer& r, const char* op, const char* what) {
  TORCH_CHECK(
      r.caches->size() == 2, op, ": layer '", *r.name, "' holds ", r.caches->size(),
      " cache tensors; this op expects two (", what, ")");
  return *r.caches;
}

// Shared by both update ops: resolve the layer (advancing the index for the magic name)
// and scatter the two per-token tensors into its two caches.
at::Tensor update_layer(
    const at::Tensor& first, const at::Tensor& second, c10::string_view layer_name,
    const char* op, const char* what) {
  ForwardContext& ctx = current_forward_context(op);
  const int64_t index = ctx.kv_cache_layer_index();
  try {
    const LayerCaches& c =
        expect_two(ctx.resolve_for_update(std::string(layer_name), op), op, what);
    at::Tensor first_cache = c[0];
    at::Tensor second_cache = c[1];
    reshape_and_cache(first, second, first_cache, second_cache, ctx.attn_metadata().slot_mapping);
  } catch (...) {
    // reshape_and_cache checks everything before it writes, so nothing was written: a
    // caller that catches the error and retries must get the same layer, not the next.
    ctx.rewind_kv_cache_layer_index(index);
    throw;
  }
  return dependency_token(first);
}

at::Tensor unified_kv_cache_update(
    const at::Tensor& key, const at::Tensor& value, c10::string_view layer_name) {
  return update_layer(key, value, layer_name, "unified_kv_cache_update", "key_cache, value_cache");
}

at::Tensor as_single_head(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(
      t.dim() == 2 || (t.dim() == 3 && t.size(1) == 1), op, ": ", name,
      " must be [num_tokens, dim] or [num_tokens, 1, dim], got shape ", t.sizes());
  return t.dim() == 2 ? t.unsqueeze(1) : t;
}

at::Tensor unified_mla_kv_cache_update(
    const at::Tensor& kv_c_normed, const at::Tensor& k_pe, c10::string_view layer_name) {
  constexpr const char* op = "unified_mla_kv_cache_update";
  const at::Tensor kv_c = as_single_head(kv_c_normed, op, "kv_c_normed");
  const at::Tensor pe = as_single_head(k_pe, op, "k_pe");
  return update_layer(kv_c, pe, layer_name, op, "compressed_kv cache, k_pe cache");
}

at::Tensor unified_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    c10::string_view layer_name, std::optional<double> scale,
    std::optional<int64_t> sliding_window,
    const std::optional<at::Tensor>& /*kv_cache_dependency*/, std::optional<double> softcap,
    const std::optional<at::Tensor>& sinks) {
  constexpr const char* op = "unified_attention";
  const ForwardContext& ctx = current_forward_context(op);
  const LayerCaches& c =
      expect_two(ctx.lookup_for_read(std::string(layer_name), op), op, "key_cache, value_cache");
  // key/value were written to the cache by unified_kv_cache_update; here they only
  // confirm that the caller and the cache agree on the layout.
  TORCH_CHECK(
      key.dim() == 3 && value.dim() == 3 && key.size(1) == c[0].size(1) &&
          key.size(2) == c[0].size(3) && value.size(2) == c[1].size(3),
      op, ": key ", key.sizes(), " / value ", value.sizes(),
      " do not match layer '", std::string(layer_name), "' caches ", c[0].sizes(), " / ",
      c[1].sizes());
  return paged_attention(query, c[0], c[1], std::nullopt, scale, sliding_window, op, softcap, sinks);
}

at::Tensor unified_mla_attention(
    const at::Tensor& q_latent, const at::Tensor& q_pe, c10::string_view layer_name,
    double scale, const std::optional<at::Tensor>& /*kv_cache_dependency*/) {
  constexpr const char* op = "unified_mla_attention";
  const ForwardContext& ctx = current_forward_context(op);
  const LayerCaches& c = expect_two(
      ctx.lookup_for_read(std::string(layer_name), op), op, "compressed_kv cache, k_pe cache");
  TORCH_CHECK(
      q_latent.dim() == 3 && q_pe.dim() == 3 && q_latent.size(0) == q_pe.size(0) &&
          q_latent.size(1) == q_pe.size(1),
      op, ": q_latent and q_pe must be [num_tokens, num_heads, dim] with the same tokens "
      "and heads, got ", q_latent.sizes(), " and ", q_pe.sizes());
  // Each part against its own cache: only their sum reaches paged_attention, and a split
  // at the wrong place would attend with misaligned halves.
  TORCH_CHECK(
      q_latent.size(2) == c[0].size(3) && q_pe.size(2) == c[1].size(3), op,
      ": q_latent width ", q_latent.size(2), " / q_pe width ", q_pe.size(2),
      " do not match layer '", std::string(layer_name), "' caches: compressed_kv width ",
      c[0].size(3), " / k_pe width ", c[1].size(3));
  // Absorbed MLA: scores = q_latent . c_kv + q_pe . k_pe, i.e. one attention with the
  // latent as both (part of) the key and the value, shared by every head (MQA).
  return paged_attention(
      at::cat({q_latent, q_pe}, -1), c[0], c[0], c[1], scale, std::nullopt, op);
}

// The functional form of reshape_and_cache: updated copies of both caches, inputs left
// alone. Lowering puts it in place of each cache-update op so that an exported graph is
// pure (ONNX has no in-place ops); its ONNX translation is KVCacheScatter. The runtime
// never calls it: retained state makes the ONNX update in place.
std::tuple<at::Tensor, at::Tensor> kv_cache_scatter(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  at::Tensor k = key_cache.clone(at::MemoryFormat::Contiguous);
  at::Tensor v = value_cache.clone(at::MemoryFormat::Contiguous);
  reshape_and_cache(key, value, k, v, slot_mapping);
  return {k, v};
}

std::vector<at::Tensor> caches_of(const ResolvedLayer& r) {
  return *r.caches;
}

}  // namespace

TORCH_LIBRARY(qaic, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def(
      "kv_cache_scatter(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, "
      "Tensor slot_mapping) -> (Tensor, Tensor)");
  m.def("unified_kv_cache_update(Tensor key, Tensor value, str layer_name) -> Tensor");
  m.def("ctx_scatter(Tensor data, Tensor position_ids, Tensor updates) -> Tensor");
  m.def("ctx_gather(Tensor data, Tensor ctx_indices) -> Tensor");
  m.def("ctx_scatter_cb(Tensor data, Tensor batch_index, Tensor position_ids, Tensor updates) -> Tensor");
  m.def("ctx_gather_cb(Tensor data, Tensor batch_index, Tensor ctx_indices) -> Tensor");
  m.def(
      "unified_mla_kv_cache_update(Tensor kv_c_normed, Tensor k_pe, str layer_name) "
      "-> Tensor");
  m.def(
      "unified_attention(Tensor query, Tensor key, Tensor value, str layer_name, "
      "float? scale=None, int? sliding_window=None, Tensor? kv_cache_dependency=None, "
      "float? softcap=None, Tensor? sinks=None) -> Tensor");
  m.def(
      "unified_mla_attention(Tensor q_latent, Tensor q_pe, str layer_name, float scale, "
      "Tensor? kv_cache_dependency=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(qaic, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("kv_cache_scatter", &kv_cache_scatter);
  m.impl("ctx_scatter", &ctx_scatter);
  m.impl("ctx_gather", &ctx_gather);
  m.impl("ctx_scatter_cb", &ctx_scatter_cb);
  m.impl("ctx_gather_cb", &ctx_gather_cb);
  m.impl("unified_kv_cache_update", &unified_kv_cache_update);
  m.impl("unified_mla_kv_cache_update", &unified_mla_kv_cache_update);
  m.impl("unified_attention", &unified_attention);
  m.impl("unified_mla_attention", &unified_mla_attention);
}

}  // namespace qaic

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace qaic;
  m.doc() = "qaic_dynamo native library: KV-cache ops and the per-thread forward context";

  // TORCH_CHECK failures surface as RuntimeError carrying only the message (the C++
  // backtrace is noise to a Python user).
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  py::class_<AttentionMetadata, std::shared_ptr<AttentionMetadata>>(m, "AttentionMetadata")
      .def(
          py::init<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
                   std::optional<at::Tensor>>(),
          py::arg("slot_mapping"), py::arg("block_tables") = py::none(),
          py::arg("seq_lens") = py::none(), py::arg("query_start_loc") = py::none())
      .def_readonly("slot_mapping", &AttentionMetadata::slot_mapping)
      .def_readonly("block_tables", &AttentionMetadata::block_tables)
      .def_readonly("seq_lens", &AttentionMetadata::seq_lens)
      .def_readonly("query_start_loc", &AttentionMetadata::query_start_loc)
      .def_readonly("slot_mapping_i64", &AttentionMetadata::slot_mapping_i64)
      .def_property_readonly("num_seqs", &AttentionMetadata::num_seqs)
      .def_property_readonly(
          "num_tokens", [](const AttentionMetadata& md) { return md.slot_mapping.size(0); });

  py::class_<ForwardContext, std::shared_ptr<ForwardContext>>(m, "ForwardContext")
      .def(
          py::init<std::shared_ptr<AttentionMetadata>,
                   std::unordered_map<std::string, LayerCaches>, std::vector<std::string>>(),
          py::arg("attn_metadata"), py::arg("kv_caches"), py::arg("all_kv_cache_layers"))
      .def_property_readonly("attn_metadata", &ForwardContext::attn_metadata_ptr)
      .def_property_readonly(
          "kv_caches",
          [](const ForwardContext& c) {
            py::dict d;
            for (const auto& kv : c.kv_caches()) {
              d[py::str(kv.first)] = py::tuple(py::cast(kv.second.caches));
            }
            return d;
          })
      .def_property_readonly("all_kv_cache_layers", &ForwardContext::all_kv_cache_layers)
      .def_property_readonly("kv_cache_layer_index", &ForwardContext::kv_cache_layer_index)
      .def(
          "resolve_for_update",
          [](ForwardContext& c, const std::string& name, const std::string& op) {
            ResolvedLayer r = c.resolve_for_update(name, op.c_str());
            return py::make_tuple(*r.name, py::tuple(py::cast(caches_of(r))));
          },
          py::arg("layer_name"), py::arg("op") = "unified_kv_cache_update",
          "Resolve a cache-update op's layer exactly as the op does (advancing the index "
          "for 'from_forward_context'); returns (real_name, caches).")
      .def("reset_kv_cache_layer_index", &ForwardContext::reset_kv_cache_layer_index)
      .def("rewind_kv_cache_layer_index", &ForwardContext::rewind_kv_cache_layer_index, py::arg("to"));

  m.def("push_forward_context", &push_forward_context, py::arg("ctx"));
  m.def("pop_forward_context", &pop_forward_context, py::arg("ctx"));
  m.def("has_forward_context", &has_forward_context);
  m.def(
      "current_forward_context",
      [](const std::string& caller) { return current_forward_context_ptr(caller.c_str()); },
      py::arg("caller") = "get_forward_context");
  m.attr("FROM_FORWARD_CONTEXT") = kFromForwardContext;
}
