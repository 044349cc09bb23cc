#pragma once

#include <torch/extension.h>

#include <string>

// y = x @ W^T + bias with bf16 weights packed by kvserve.quant.pack_bf16_weight: wp int16
// [Np / 32, Kp / 2, 32, 2] (Np = N rounded up to 32, Kp = K rounded up to 2, zero padding),
// x fp32 [M, K] rounded to bf16, fp32 sums. Every output is reduced over K in one fixed order
// whatever M, N-tiling or thread count (batch invariant).
void bf16_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor wp, int64_t n, c10::optional<torch::Tensor> bias);
// kvserve.quant.pack_bf16_weight's bytes for fp32 W [N, K], in one pass.
torch::Tensor pack_bf16_weight(torch::Tensor weight);

// y = x @ W^T + bias for fp32 W [N, K] (row-major, as nn.Linear stores it): each output a
// 16-lane dot product over K in a fixed order, then a fixed horizontal sum (batch invariant).
void fp32_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor fp32_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

// out[s, j] = x[s] . w[idx[s, j]] (fp32), the LM head's rescoring of its top candidates, each
// dot product in the order fp32_linear uses; w an fp32 table, or its Q8_0 blocks with w_scales
// (row_table.h: the same rows, so the same sums).
// Rows ids of the table (w, w_scales) (row_table.h) as fp32 [n, K]: the embedding lookup.
torch::Tensor table_rows(torch::Tensor w, c10::optional<torch::Tensor> w_scales, torch::Tensor ids);
torch::Tensor gathered_rows_dot(torch::Tensor x, torch::Tensor w, torch::Tensor idx,
                                c10::optional<torch::Tensor> w_scales = c10::nullopt);

// Tests: force the portable loops on a machine that has the AVX512 ones.
void set_portable_dense_kernels(bool portable);

// The bf16 kernel's route here: "amx" (Intel's tile unit, amx_linear.cpp), "dot" (vdpbf16ps),
// "widened512" (the weights widened to fp32 for 16-lane FMAs: Intel's cores without AMX, where
// vdpbf16ps is slow), "widened256" (AVX2) or "portable"; "amx-emulated" where a test set it.
std::string bf16_kernel_route();
// The bf16 kernel's route from now until the next call: "auto" (this CPU's default: the tiles
// where they run, else the vector route bf16_dot_default picks), "dot" or "widened" (the vector
// routes; "widened" is widened512 or widened256, whichever the build has; a route the build lacks
// raises), "amx" (raises where the tiles cannot run: see amx_bf16_status), "amx-emulated" (tests:
// the tile program on a C++ model of the tiles, on any CPU), or a name bf16_kernel_route gave.
// The engine sets it once, at start-up; tests switch it and back.
void set_bf16_kernel_route(const std::string& route);
