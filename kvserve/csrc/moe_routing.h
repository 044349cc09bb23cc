// A mixture of experts' softmax top-k routing (moe_routing.cpp), for decoder.cpp and bindings.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <tuple>

// Each of `rows` tokens' softmax over its `num_experts` router logits (fp32, [rows, num_experts]),
// its top_k probabilities (descending, equal ones in ascending expert order) into weights /
// experts [rows, top_k], renormalised to sum to 1 when `normalize`.
void softmax_top_k_rows(const float* logits, int64_t rows, int64_t num_experts, int64_t top_k, bool normalize,
                        float* weights, int64_t* experts);
std::tuple<torch::Tensor, torch::Tensor> softmax_top_k(torch::Tensor logits, int64_t top_k, bool normalize);
