// GGUF tensors' blocks, as the file stores them, into the layouts kvserve's kernels read, in one
// pass per tensor (a matrix comes as its row-stacked parts, each uint8 [rows, row bytes]: a fused
// projection's q, k and v tensors are read where the file holds them) (the numpy unpacking of a Llama-3.2-1B-sized file took ~30 s and 4 GB of
// temporaries for its 128k-row Q6_K embedding alone).
#pragma once

#include <torch/extension.h>

#include <vector>

// Q4_K, Q5_K, Q4_1 or Q4_0 rows (uint8 [N, row bytes], GGML type `type`, K weights a row) as the
// nibble kernels' tiles: Q4_K and Q5_K in their own bits ([ceil(N / 16), K / 256, 2368 | 2880],
// quant_linear.cpp's KQuantTiles), Q4_1 and Q4_0 in kvserve.quant.nibbles.tile_nibbles' layout ([ceil(N / 16), Kp / 32,
// 320] with fp16 d and m, Q4_0's m = -8 d; Kp = K rounded up to 64, the groups past K zeros).
torch::Tensor gguf_nibble_tiles(std::vector<torch::Tensor> parts, int64_t type, int64_t K);

// Q8_0 or Q6_K rows as the 8-bit kernels' codes and scales (kvserve.quant.q8.Q8Linear): qs
// int8 [N, K]; d the fp16 bits (int16) [N, K / 32] of Q8_0's scales, or Q6_K's d * sc in fp32
// [N, K / 16] with the codes q - 32.
std::vector<torch::Tensor> gguf_byte_blocks(std::vector<torch::Tensor> parts, int64_t type, int64_t K);

// Q6_K rows as its own tiles ([ceil(N / 16), K / 256, 3360], quant_linear.cpp's Q6KTiles).
torch::Tensor gguf_q6_k_tiles(std::vector<torch::Tensor> parts, int64_t K);
