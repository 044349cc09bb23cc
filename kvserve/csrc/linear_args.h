// The argument checks every linear kernel makes (dense_linear.cpp, quant_linear.cpp,
// screen_linear.cpp, w8a8_linear.cpp), and their load-time packers: the same conditions, the
// same messages.
#pragma once

#include <torch/extension.h>

// x: the activations, fp32 [M, K] on the CPU with contiguous rows.
inline void check_activation_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a float32 CPU [M, K] tensor with contiguous rows");
}

// x as above, and out fp32 [M, N] with contiguous rows (a column range of a wider tensor is fine).
inline void check_linear_rows(const torch::Tensor& x, const torch::Tensor& out, int64_t N) {
  check_activation_rows(x);
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == N && out.stride(1) == 1,
              "out must be float32 [M, N] with contiguous rows");
}

// The bias's data (a contiguous fp32 [N]), or null without one.
inline const float* optional_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
              "bias must be a contiguous float32 [N]");
  return bias->data_ptr<float>();
}

// A packer's input: the weights as fp32 [N, K], contiguous, on the CPU.
inline void check_fp32_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.device().is_cpu(),
              "weight must be a contiguous float32 [N, K] CPU tensor");
}
