// The decoder layers of a model with fp32 activations on the CPU, run as one native call per step
// (decoder.cpp, where the methods are described), declared for their binding (bindings.cpp).
#pragma once

#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

// Decode-sized steps (at most `rows` rows) run their routed experts side by side, one expert per
// thread at a time; larger steps (and 0) one after another, each on every thread (decoder.cpp's
// g_expert_parallel_rows). The same bits either way: benchmarks and tests compare the two.
void set_expert_parallel_rows(int64_t rows);
int64_t expert_parallel_rows();

class FusedDecoderLayers {
 public:
  FusedDecoderLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double norm_offset,
                     int64_t activation, const std::vector<pybind11::dict>& layers);
  ~FusedDecoderLayers();

  torch::Tensor forward_tokens(const torch::Tensor& input_ids, const torch::Tensor& positions,
                               const torch::Tensor& embed_weight, const c10::optional<torch::Tensor>& embed_scales,
                               double embed_scale, const torch::Tensor& cos_table,
                               const torch::Tensor& sin_table, const torch::Tensor& local_cos_table,
                               const torch::Tensor& local_sin_table, const std::vector<torch::Tensor>& kv_caches,
                               const std::vector<torch::Tensor>& kv_scales, const std::vector<int64_t>& kv_groups,
                               const std::vector<torch::Tensor>& slot_mappings,
                               const std::vector<torch::Tensor>& block_tables, torch::Tensor seq_lens,
                               const torch::Tensor& query_start_loc, int64_t roles_kind,
                               c10::optional<torch::Tensor> prompt_rows,
                               c10::optional<torch::Tensor> generated_rows,
                               c10::optional<torch::Tensor> output_rows) const;
  torch::Tensor decode_round(int64_t num_steps, const torch::Tensor& input_ids,
                             const torch::Tensor& positions, int64_t block_size, const torch::Tensor& embed_weight,
                             const c10::optional<torch::Tensor>& embed_scales, double embed_scale,
                             const torch::Tensor& cos_table, const torch::Tensor& sin_table,
                             const torch::Tensor& local_cos_table, const torch::Tensor& local_sin_table,
                             const std::vector<torch::Tensor>& kv_caches, const std::vector<torch::Tensor>& kv_scales,
                             const std::vector<int64_t>& kv_groups, const std::vector<torch::Tensor>& slot_mappings,
                             const std::vector<torch::Tensor>& block_tables, const torch::Tensor& seq_lens,
                             const torch::Tensor& query_start_loc, const torch::Tensor& norm_weight, double norm_eps,
                             double norm_offset, const torch::Tensor& screen, const torch::Tensor& exact,
                             const c10::optional<torch::Tensor>& exact_scales, int64_t top_k,
                             const torch::Tensor& logits) const;
  size_t num_layers() const;
  // Whether a step's layers run as one parallel region (every linear on kvserve's kernels).
  bool team_safe() const;

 private:
  class Impl;  // decoder.cpp
  std::unique_ptr<Impl> impl_;
};
