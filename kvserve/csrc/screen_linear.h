// The LM head's argmax screen: 4-bit weights, 8-bit activations (screen_linear.cpp).
#pragma once

#include <torch/extension.h>

// out [M, N] = approximate x @ W^T for ranking: W packed by kvserve.quant.Q4Screen as uint8
// [ceil(N / 16), K / 64, 576] (per tile of 16 rows and group of 64 inputs: two 256-byte blocks
// of nibbles, then d and m as fp16).
void q4_screen_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor packed);
torch::Tensor q4_screen_linear(torch::Tensor x, torch::Tensor packed, int64_t N);

// Q4Screen.from_float's packing of fp32 weights [N, K] (K a multiple of 64), the same bytes.
torch::Tensor q4_screen_pack(torch::Tensor weight);

// Tests: force the portable loop on a machine that has the AVX512-VNNI kernel.
void set_portable_screen_kernel(bool portable);
