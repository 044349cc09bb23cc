// Linear layers on GGUF-style block-quantized weights (quant_linear.cpp).
#pragma once

#include <torch/extension.h>

#include <string>

// y = x @ W^T + bias for Q4_1 weights: qs uint8 [N, Kp / 2] (Kp = K rounded up to 64; per
// group of 32, GGUF's 16 bytes: weight j in the low nibble of byte j, j + 16 in its high
// nibble), dm [N, Kp / 64, 4] = (d, d', m, m') of the chunk's two groups as fp16 bits (int16),
// or fp32 (Q4_K's d * sc and -dmin * mn).
void q4_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor dm,
                   c10::optional<torch::Tensor> bias);
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm, c10::optional<torch::Tensor> bias);

// y = x @ W^T + bias for Q5_0 weights: qs as Q4_1's, qh int32 [N, ceil(Kp / 128) * 4] (the fifth
// bits as the portable loop's plane masks: kvserve.block_formats.q5_plane_masks), d int16
// [N, Kp / 32] holding fp16 scales; w = d * (q - 16).
void q5_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor qh, torch::Tensor d,
                   c10::optional<torch::Tensor> bias);
torch::Tensor q5_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor qh, torch::Tensor d,
                        c10::optional<torch::Tensor> bias);

// y = x @ W^T + bias for nibble-format weights (Q4_1, Q4_K with fp32 scales, Q5_0) in the tiled
// layout that the AVX512 and AVX2 kernels read (see quant_linear.cpp, kvserve.quant.tile_nibbles):
// packed uint8 [ceil(N / 16), Kp / 32, 320 (Q4, fp16 scales) | 384 (fp32) | 352 (Q5_0)].
void tiled_nibble_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                             c10::optional<torch::Tensor> bias);
torch::Tensor tiled_nibble_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);
// The same tiles on the int8 prompt path (activations rounded to one byte per row and group of
// 32; AVX512-VNNI only: int8_prompt_kernels()).
void tiled_nibble_int8_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                                  c10::optional<torch::Tensor> bias);
torch::Tensor tiled_nibble_int8_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);
bool int8_prompt_kernels();

// y = x @ W^T + bias for 8-bit weights: qs int8 [N, K]; d int16 [N, K / 32] holding fp16 scales
// (Q8_0) or fp32 [N, K / 16] (Q6_K's d * sc, with q - 32 in qs).
void q8_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor d,
                   c10::optional<torch::Tensor> bias);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> bias);
// Q8Linear.from_float's (qs int8 [N, K], d fp16 bits int16 [N, K / 32]) for fp32 W [N, K].
std::vector<torch::Tensor> q8_0_quantize(torch::Tensor weight);
bool q8_0_reproduces(torch::Tensor weight, torch::Tensor qs, torch::Tensor d);

// Tests: force the portable loops on a machine that has the AVX512 ones.
void set_portable_quant_kernels(bool portable);

// The route these kernels were built with for this CPU: "avx512", "avx2" or "portable".
std::string quant_kernel_isa();
// How the nibble-format kernels round their activations here: "int16" (the AVX2 kernel, per
// group of 32) or "bf16" (AVX512-BF16 and the portable loops).
std::string nibble_activation_format();
