#pragma once

#include <torch/extension.h>

#include <string>

// y = x @ W^T + bias with the weights as byte codes (int4 mode's prompt rows, see
// w8a8_linear.cpp): wp uint8 [Np / 16, Kp / 4, 16, 4] holding codes u, each group of 32 inputs
// of an output column `w = a * u + b` with a and b in `affine` fp32 [Np / 16, Kp / 32, 2, 16]
// (Np = N rounded up to 16, Kp = K rounded up to 32; padding: code 0, a = b = 0), x fp32 [M, K]:
// each row's 4 largest magnitudes kept exact, the rest rounded per group of 32 inputs to int8.
// Integer sums per group, then fp32 in one fixed order: a row's result does not depend on the
// other rows of the call, and every route gives the same bits. largest_codes (uint8 [Np / 16],
// each panel's largest code; kvserve.quant.W8A8Linear keeps it) tells the AVX2 route how deep its
// int16 sums may go; without it the call reads every code once more to find out.
void w8a8_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor wp, torch::Tensor affine,
                     c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> largest_codes = c10::nullopt);
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor affine, int64_t n,
                          c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> largest_codes = c10::nullopt);

// The activations as the kernel rounds them: (int8 values [M, Kp] with the outliers zeroed, fp32
// scales [M, Kp / 32], the outliers' int32 indices [M, R] ascending, their fp32 values [M, R],
// the groups' scale * sum of values [M, Kp / 32]), R = min(4, K).
std::vector<torch::Tensor> w8a8_activations(torch::Tensor x, int64_t padded_k);

// "avx512vnni" (vpdpbusd), "avx2" (vpmaddubsw) or "portable" (the same integers and fp32
// operations, scalar).
std::string w8a8_kernel_route();
// Tests: force the portable loop on a machine that has a vector one.
void set_portable_w8a8_kernel(bool portable);
