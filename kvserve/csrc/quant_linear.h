// Linear layers on GGUF-style block-quantized weights (quant_linear.cpp).
#pragma once

#include <torch/extension.h>

// y = x @ W^T + bias for Q4_1 weights: qs uint8 [N, Kp / 2] (Kp = K rounded up to 64; per
// group of 32, GGUF's 16 bytes: weight j in the low nibble of byte j, j + 16 in its high
// nibble), dm int16 [N, Kp / 64, 4] holding fp16 bits (d, d', m, m') of the chunk's two groups.
void q4_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor dm,
                   c10::optional<torch::Tensor> bias);
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm, c10::optional<torch::Tensor> bias);

// y = x @ W^T + bias for Q8_0 weights: qs int8 [N, K], d int16 [N, K / 32] holding fp16 scales.
void q8_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor d,
                   c10::optional<torch::Tensor> bias);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> bias);

// Tests: force the portable loops on a machine that has the AVX512 ones.
void set_portable_quant_kernels(bool portable);
