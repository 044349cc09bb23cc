// The decoder layers of a model whose linear layers are all block-quantized (kvserve int4),
// run as one native call per step.
//
// A single-stream decode step of a 135 M model reads ~70 MB of 4-bit weights: ~3 ms at this
// machine's memory bandwidth. Driving its 30 layers from Python costs ~12 calls per layer at
// a few microseconds each, more than the arithmetic of the norms, rope and attention of one
// token. Here the same kernels run from one C++ loop over the layers; the Python model
// (kvserve/models) stays the reference, and the tests hold the two to the same outputs.
#include "cpu_ops.h"
#include "quant_linear.h"

#include <pybind11/stl.h>

#include <string>
#include <vector>

namespace {

// One linear layer: Q4_1 (qs uint8, scales int16 [.., 4]) or Q8_0 (qs int8, scales int16).
struct QuantLinear {
  torch::Tensor qs, scales;
  c10::optional<torch::Tensor> bias;
  int64_t out_features = 0;

  torch::Tensor operator()(const torch::Tensor& x) const {
    auto out = torch::empty({x.size(0), out_features}, x.options());
    if (qs.scalar_type() == torch::kUInt8) q4_linear_out(out, x, qs, scales, bias);
    else q8_linear_out(out, x, qs, scales, bias);
    return out;
  }
};

QuantLinear make_linear(const pybind11::tuple& spec) {
  QuantLinear linear;
  linear.qs = spec[0].cast<torch::Tensor>();
  linear.scales = spec[1].cast<torch::Tensor>();
  if (!spec[2].is_none()) linear.bias = spec[2].cast<torch::Tensor>();
  linear.out_features = linear.qs.size(0);
  TORCH_CHECK(linear.qs.scalar_type() == torch::kUInt8 || linear.qs.scalar_type() == torch::kInt8,
              "linear weights must be Q4_1 (uint8) or Q8_0 (int8) blocks");
  return linear;
}

c10::optional<torch::Tensor> optional_tensor(const pybind11::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return c10::nullopt;
  return d[key].cast<torch::Tensor>();
}

struct Layer {
  torch::Tensor input_norm, pre_ffn_norm;
  c10::optional<torch::Tensor> post_attn_norm, post_ffn_norm, q_norm, k_norm;  // Gemma's extra norms
  QuantLinear qkv, o, gate_up, down;
  double scale = 1.0, softcap = 0.0;
  int64_t window = 0;
  bool local_rope = false;  // Gemma 3: sliding layers have their own rope base
};

}  // namespace

class FusedDecoderLayers {
 public:
  FusedDecoderLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double norm_offset,
                     int64_t activation, const std::vector<pybind11::dict>& layers)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        norm_offset_(norm_offset), activation_(activation) {
    for (const auto& spec : layers) {
      Layer layer;
      layer.input_norm = spec["input_norm"].cast<torch::Tensor>();
      layer.pre_ffn_norm = spec["pre_ffn_norm"].cast<torch::Tensor>();
      layer.post_attn_norm = optional_tensor(spec, "post_attn_norm");
      layer.post_ffn_norm = optional_tensor(spec, "post_ffn_norm");
      layer.q_norm = optional_tensor(spec, "q_norm");
      layer.k_norm = optional_tensor(spec, "k_norm");
      layer.qkv = make_linear(spec["qkv"].cast<pybind11::tuple>());
      layer.o = make_linear(spec["o"].cast<pybind11::tuple>());
      layer.gate_up = make_linear(spec["gate_up"].cast<pybind11::tuple>());
      layer.down = make_linear(spec["down"].cast<pybind11::tuple>());
      layer.scale = spec["scale"].cast<double>();
      layer.window = spec["window"].cast<int64_t>();
      layer.softcap = spec["softcap"].cast<double>();
      layer.local_rope = spec["local_rope"].cast<bool>();
      layers_.push_back(std::move(layer));
    }
  }

  // hidden [T, hidden] (this step's embeddings) -> the last layer's output (pre final norm).
  // rope tables [T, D] for global and local layers; attention metadata as paged_attention's.
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin, torch::Tensor local_cos,
                        torch::Tensor local_sin, const std::vector<torch::Tensor>& kv_caches,
                        torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                        torch::Tensor seq_ids, torch::Tensor query_starts, torch::Tensor query_lens) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    const int64_t T = hidden.size(0), H = num_heads_, KVH = num_kv_heads_, D = head_dim_;
    hidden = hidden.contiguous().clone();  // updated in place: the residual stream
    pybind11::gil_scoped_release no_gil;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      auto qkv = layer.qkv(rms_norm(hidden, layer.input_norm, eps_, norm_offset_));
      rope_qk_(qkv, layer.local_rope ? local_cos : cos, layer.local_rope ? local_sin : sin, H, KVH, D,
               layer.q_norm, layer.k_norm, eps_, norm_offset_);
      auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
      auto k = qkv.narrow(1, H * D, KVH * D).view({T, KVH, D});
      auto v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
      write_kv_cache(k, v, kv_caches[i], slot_mapping);
      auto attn = torch::empty({T, H, D}, hidden.options());
      paged_attention(attn, q, kv_caches[i], block_tables, seq_lens, seq_ids, query_starts, query_lens, layer.scale,
                      layer.window, layer.softcap);
      auto out = layer.o(attn.view({T, H * D}));
      if (layer.post_attn_norm) out = rms_norm(out, *layer.post_attn_norm, eps_, norm_offset_);
      hidden.add_(out);
      auto mlp = layer.down(act_and_mul(layer.gate_up(rms_norm(hidden, layer.pre_ffn_norm, eps_, norm_offset_)),
                                        activation_));
      if (layer.post_ffn_norm) mlp = rms_norm(mlp, *layer.post_ffn_norm, eps_, norm_offset_);
      hidden.add_(mlp);
    }
    return hidden;
  }

  size_t num_layers() const { return layers_.size(); }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, norm_offset_;
  int64_t activation_;
  std::vector<Layer> layers_;
};

void register_fused_decoder(pybind11::module& m) {
  pybind11::class_<FusedDecoderLayers>(m, "FusedDecoderLayers")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, int64_t, const std::vector<pybind11::dict>&>())
      .def("forward", &FusedDecoderLayers::forward)
      .def("__len__", &FusedDecoderLayers::num_layers);
}
