// The row-wise kernels of a decoder layer: RMSNorm, rotary embedding (+ Gemma's QK-norm) and the
// gated activation.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_ops.h"
#include "cpu_kernels.h"
#include "step_team.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float inv_rms(const float* x, int64_t n, double eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
}

}  // namespace

// out[t] = x[t] / rms(x[t]) * (offset + w): offset 0 is LLaMA's RMSNorm, 1 is Gemma's. x and out
// [T, n] with contiguous rows; out may be x itself (each row's rms is taken before it is written).
void rms_norm_out(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& weight, double eps, double offset) {
  check_fp32_cpu(x, "x");
  check_fp32_cpu(out, "out");
  check_fp32_cpu(weight, "weight");
  const int64_t n = x.size(-1);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == n && weight.is_contiguous() && weight.numel() == n,
              "rms_norm_out: x and out [T, n] with contiguous rows, weight [n]");
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), o_stride = out.stride(0);
  const float off = static_cast<float>(offset);
  kvserve::parallel_for(0, x.size(0), std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * x_stride;
      const float r = inv_rms(row, n, eps);
      float* o = op + t * o_stride;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = (row[i] * r) * (off + wp[i]);
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset) {
  const int64_t n = x.size(-1);
  auto x2 = x.reshape({-1, n}).contiguous();
  auto out = torch::empty_like(x2);
  rms_norm_out(out, x2, weight.contiguous(), eps, offset);
  return out.view(x.sizes());
}

// In place on qkv [T, (H + 2 KVH) * D]: optional per-head RMSNorm of the q and k heads
// (Gemma's QK-norm), then rotary embedding of q and k (HF rotate_half convention:
// out = x * cos + rotate_half(x) * sin). cos, sin: [T, D]. The v heads are left alone.
void rope_qk_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
              double eps, double norm_offset) {
  check_fp32_cpu(qkv, "qkv");
  check_fp32_cpu(cos, "cos");
  check_fp32_cpu(sin, "sin");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, (H + 2 KVH) * D] with contiguous rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == head_dim, "cos/sin must be [T, D]");
  const int64_t T = qkv.size(0), D = head_dim, half = D / 2, row_stride = qkv.stride(0);
  const int64_t rotated_heads = num_heads + num_kv_heads;
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float* qn = q_norm ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm ? k_norm->data_ptr<float>() : nullptr;
  const float off = static_cast<float>(norm_offset);
  kvserve::parallel_for(0, T * rotated_heads, std::max<int64_t>(1, 4096 / D), [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / rotated_heads, h = item % rotated_heads;
      float* x = base + t * row_stride + h * D;
      const float* norm_w = h < num_heads ? qn : kn;
      if (norm_w != nullptr) {
        const float r = inv_rms(x, D, eps);
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) x[i] = (x[i] * r) * (off + norm_w[i]);
      }
      const float* c = cp + t * D;
      const float* s = sp + t * D;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        tmp[i] = x[i] * c[i] + (-x[i + half]) * s[i];
        tmp[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
      }
      std::memcpy(x, tmp.data(), D * sizeof(float));
    }
  });
}

// act(gate) * up for x = [gate | up] of shape [T, 2 I] into out [T, I] (both with contiguous
// rows); act 0 = SiLU, 1 = tanh-approximated GELU.
void act_and_mul_out(torch::Tensor out, const torch::Tensor& x, int64_t act) {
  check_fp32_cpu(x, "x");
  check_fp32_cpu(out, "out");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [T, 2 I] with contiguous rows");
  const int64_t T = x.size(0), I = x.size(1) / 2, stride = x.stride(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == I && out.stride(1) == 1,
              "out must be [T, I] with contiguous rows");
  const int64_t o_stride = out.stride(0);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  kvserve::parallel_for(0, T, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = xp + t * stride;
      const float* up = gate + I;
      float* o = op + t * o_stride;
      // Both activations through exp of a non-positive argument, which vectorises.
      if (act == 0) {
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) {
          const float g = gate[i];
          const float e = exp_nonpositive(-std::fabs(g));  // sigmoid(|g|) = 1 / (1 + e)
          const float sigmoid = g >= 0.f ? 1.0f / (1.0f + e) : e / (1.0f + e);
          o[i] = g * sigmoid * up[i];
        }
      } else {
        const float k0 = 0.7978845608028654f, k1 = 0.044715f;
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) {
          const float g = gate[i];
          const float y = k0 * (g + k1 * g * g * g);
          const float e = exp_nonpositive(-2.0f * std::fabs(y));  // tanh(|y|) = (1 - e) / (1 + e)
          const float tanh_abs = (1.0f - e) / (1.0f + e);
          o[i] = 0.5f * g * (1.0f + (y >= 0.f ? tanh_abs : -tanh_abs)) * up[i];
        }
      }
    }
  });
}

torch::Tensor act_and_mul(torch::Tensor x, int64_t act) {
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  act_and_mul_out(out, x, act);
  return out;
}

