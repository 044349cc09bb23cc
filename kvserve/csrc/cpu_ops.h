// The fused CPU kernels of cpu_ops.cpp, for the other translation units (decoder.cpp).
#pragma once

#include <torch/extension.h>

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset);
void rms_norm_out(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& weight, double eps, double offset);
void rope_qk_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
              double eps, double norm_offset);
void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache, c10::optional<torch::Tensor> kv_scales,
                    torch::Tensor slot_mapping);
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, c10::optional<torch::Tensor> kv_scales,
                     torch::Tensor block_tables,
                     torch::Tensor seq_lens, torch::Tensor seq_ids, torch::Tensor query_starts,
                     torch::Tensor query_lens, double scale, int64_t window, double softcap);
torch::Tensor act_and_mul(torch::Tensor x, int64_t act);
void act_and_mul_out(torch::Tensor out, const torch::Tensor& x, int64_t act);
std::tuple<torch::Tensor, torch::Tensor> top_k_rows(torch::Tensor x, int64_t k);
void screened_logits_out(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor exact,
                         c10::optional<torch::Tensor> exact_scales, int64_t k);
void screened_argmax_out(torch::Tensor tokens, torch::Tensor scratch, torch::Tensor x, torch::Tensor packed,
                         torch::Tensor exact, c10::optional<torch::Tensor> exact_scales, int64_t k);
