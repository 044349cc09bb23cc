// Softmax top-k routing of a mixture of experts (Qwen3-MoE): which experts each token takes,
// with which weights, from the router's logits.
//
// One function serves both paths, so that they agree bit for bit: the Python model's router
// (kvserve/models/routing.py's softmax_top_k, through the binding below) and the fused decoder's
// routed experts (decoder.cpp). Torch's softmax and sort would do the same in ~5 dispatched ops
// per layer, a few microseconds each, in a decode step whose whole MoE layer is ~50 us; here a
// token's 128 logits take about a microsecond. Models/routing.py keeps the plain-torch rule as
// the reference the tests hold this one to.
#include "moe_routing.h"
#include "step_team.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// One row: probs <- softmax(logits); weights/experts <- its top_k, descending, equal
// probabilities in ascending expert order (a stable descending sort's first k, as the torch
// rule); renormalised to sum to 1 when `normalize`.
void route_row(const float* logits, int64_t num_experts, int64_t top_k, bool normalize, float* probs,
               float* weights, int64_t* experts) {
  float largest = -std::numeric_limits<float>::infinity();
  for (int64_t e = 0; e < num_experts; ++e) largest = std::max(largest, logits[e]);
  double total = 0.0;  // (double: the 128 terms' sum without fp32's rounding at each add)
  for (int64_t e = 0; e < num_experts; ++e) {
    probs[e] = std::exp(logits[e] - largest);
    total += probs[e];
  }
  for (int64_t e = 0; e < num_experts; ++e) probs[e] = static_cast<float>(probs[e] / total);
  // Insertion into the k best so far: a later expert passes an earlier one only when strictly
  // larger, so ties keep the lower index first.
  int64_t n = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const float p = probs[e];
    if (n == top_k && !(p > weights[n - 1])) continue;
    int64_t i = n < top_k ? n++ : top_k - 1;
    for (; i > 0 && weights[i - 1] < p; --i) {
      weights[i] = weights[i - 1];
      experts[i] = experts[i - 1];
    }
    weights[i] = p;
    experts[i] = e;
  }
  if (normalize) {
    float sum = 0.f;
    for (int64_t j = 0; j < top_k; ++j) sum += weights[j];
    for (int64_t j = 0; j < top_k; ++j) weights[j] = weights[j] / sum;
  }
}

}  // namespace

namespace {

void check_top_k(int64_t num_experts, int64_t top_k) {
  TORCH_CHECK(num_experts >= 1 && top_k >= 1 && top_k <= num_experts, "routing takes 1 <= k <= ", num_experts,
              " experts per token, not ", top_k);
}

}  // namespace

void softmax_top_k_rows(const float* logits, int64_t rows, int64_t num_experts, int64_t top_k, bool normalize,
                        float* weights, int64_t* experts) {
  check_top_k(num_experts, top_k);
  kvserve::parallel_for(0, rows, std::max<int64_t>(1, 16384 / num_experts), [&](int64_t begin, int64_t end) {
    std::vector<float> probs(num_experts);
    for (int64_t t = begin; t < end; ++t)
      route_row(logits + t * num_experts, num_experts, top_k, normalize, probs.data(), weights + t * top_k,
                experts + t * top_k);
  });
}

std::tuple<torch::Tensor, torch::Tensor> softmax_top_k(torch::Tensor logits, int64_t top_k, bool normalize) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 2,
              "logits must be a float32 CPU [T, experts] tensor");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), num_experts = logits.size(1);
  check_top_k(num_experts, top_k);
  auto weights = torch::empty({rows, top_k}, logits.options());
  auto experts = torch::empty({rows, top_k}, logits.options().dtype(torch::kInt64));
  softmax_top_k_rows(logits.data_ptr<float>(), rows, num_experts, top_k, normalize, weights.data_ptr<float>(),
                     experts.data_ptr<int64_t>());
  return {weights, experts};
}
