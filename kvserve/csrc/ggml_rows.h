// One row of a GGUF tensor, dequantized from its blocks as the file stores them (ggml's
// dequantize_row_* for the types kvserve reads in place: the token embedding and the LM head's
// rows for rescoring, read a few rows at a time).
//
// The values are those kvserve.block_formats unpacks (and the kernels compute with): a group's
// scale that the format stores as a product of two numbers (Q4_K and Q5_K's d * sc, dmin * m;
// Q6_K's d * sc) is that product in fp32, exact; a weight is scale * code (exact) plus the
// offset (one rounding). Each product is exact, so any order of the multiplications gives the
// same bits.
#pragma once

#include <cstdint>
#include <cstring>

#include <c10/util/Exception.h>

#include "fp16.h"

// GGML's type ids (ggml.h's enum ggml_type; gguf's GGMLQuantizationType).
enum GgmlType : int64_t {
  kGgmlF32 = 0, kGgmlF16 = 1, kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ5_0 = 6, kGgmlQ5_1 = 7, kGgmlQ8_0 = 8,
  kGgmlQ4_K = 12, kGgmlQ5_K = 13, kGgmlQ6_K = 14, kGgmlBF16 = 30,
};

// (weights per block, bytes per block) of `type`; {0, 0} for a type not read here.
inline std::pair<int64_t, int64_t> ggml_block_size(int64_t type) {
  switch (type) {
    case kGgmlF32: return {1, 4};
    case kGgmlF16: case kGgmlBF16: return {1, 2};
    case kGgmlQ4_0: return {32, 18};
    case kGgmlQ4_1: return {32, 20};
    case kGgmlQ5_0: return {32, 22};
    case kGgmlQ5_1: return {32, 24};
    case kGgmlQ8_0: return {32, 34};
    case kGgmlQ4_K: return {256, 144};
    case kGgmlQ5_K: return {256, 176};
    case kGgmlQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

// The bytes of a K-weight row of `type`; -1 where the type is not read here or K does not divide
// into its blocks.
inline int64_t ggml_row_bytes(int64_t type, int64_t K) {
  const auto [weights, bytes] = ggml_block_size(type);
  return weights == 0 || K % weights ? -1 : K / weights * bytes;
}

namespace ggml_rows_detail {

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_bits_to_float(h);
}

// ggml's get_scale_min_k4: the 6-bit scale and min of group j (0..7) of a Q4_K / Q5_K block.
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

}  // namespace ggml_rows_detail

// Row `src` (ggml_row_bytes(type, K) bytes) into `dst` (K floats).
inline void ggml_dequantize_row(int64_t type, const uint8_t* src, int64_t K, float* dst) {
  using namespace ggml_rows_detail;
  const int64_t blocks = K / ggml_block_size(type).first;
  switch (type) {
    case kGgmlF32:
      std::memcpy(dst, src, K * sizeof(float));
      return;
    case kGgmlF16:
      for (int64_t i = 0; i < K; ++i) dst[i] = half_at(src + 2 * i);
      return;
    case kGgmlBF16:
      for (int64_t i = 0; i < K; ++i) {
        const uint32_t bits = static_cast<uint32_t>(src[2 * i] | (src[2 * i + 1] << 8)) << 16;
        std::memcpy(dst + i, &bits, 4);
      }
      return;
    case kGgmlQ8_0:
      for (int64_t b = 0; b < blocks; ++b, src += 34, dst += 32) {
        const float d = half_at(src);
        const int8_t* q = reinterpret_cast<const int8_t*>(src + 2);
        for (int j = 0; j < 32; ++j) dst[j] = d * static_cast<float>(q[j]);
      }
      return;
    case kGgmlQ4_0:
    case kGgmlQ4_1: {
      const bool offset = type == kGgmlQ4_1;
      const int64_t bytes = offset ? 20 : 18;
      for (int64_t b = 0; b < blocks; ++b, src += bytes, dst += 32) {
        const float d = half_at(src), m = offset ? half_at(src + 2) : 0.f;
        const uint8_t* qs = src + (offset ? 4 : 2);
        const int bias = offset ? 0 : 8;
        for (int j = 0; j < 16; ++j) {
          dst[j] = d * static_cast<float>((qs[j] & 0xF) - bias) + m;
          dst[j + 16] = d * static_cast<float>((qs[j] >> 4) - bias) + m;
        }
      }
      return;
    }
    case kGgmlQ5_0:
    case kGgmlQ5_1: {
      const bool offset = type == kGgmlQ5_1;
      const int64_t bytes = offset ? 24 : 22;
      for (int64_t b = 0; b < blocks; ++b, src += bytes, dst += 32) {
        const float d = half_at(src), m = offset ? half_at(src + 2) : 0.f;
        uint32_t qh;
        std::memcpy(&qh, src + (offset ? 4 : 2), 4);
        const uint8_t* qs = src + (offset ? 8 : 6);
        const int bias = offset ? 0 : 16;
        for (int j = 0; j < 16; ++j) {
          const int high0 = ((qh >> j) << 4) & 0x10, high1 = (qh >> (j + 12)) & 0x10;
          dst[j] = d * static_cast<float>(((qs[j] & 0xF) | high0) - bias) + m;
          dst[j + 16] = d * static_cast<float>(((qs[j] >> 4) | high1) - bias) + m;
        }
      }
      return;
    }
    case kGgmlQ4_K:
    case kGgmlQ5_K: {
      const bool five = type == kGgmlQ5_K;
      const int64_t bytes = five ? 176 : 144;
      for (int64_t b = 0; b < blocks; ++b, src += bytes) {
        const float d = half_at(src), dmin = half_at(src + 2);
        const uint8_t* scales = src + 4;
        const uint8_t* qh = src + 16;  // Q5_K's fifth bits
        const uint8_t* ql = src + (five ? 48 : 16);
        for (int j = 0; j < 4; ++j, ql += 32) {  // 64 weights: group 2 j (low nibbles), 2 j + 1 (high)
          int sc, mn;
          scale_min_k4(2 * j, scales, sc, mn);
          const float d1 = d * static_cast<float>(sc), m1 = -(dmin * static_cast<float>(mn));
          scale_min_k4(2 * j + 1, scales, sc, mn);
          const float d2 = d * static_cast<float>(sc), m2 = -(dmin * static_cast<float>(mn));
          for (int l = 0; l < 32; ++l) {
            const int low = (ql[l] & 0xF) | (five && (qh[l] >> (2 * j)) & 1 ? 16 : 0);
            const int high = (ql[l] >> 4) | (five && (qh[l] >> (2 * j + 1)) & 1 ? 16 : 0);
            dst[l] = d1 * static_cast<float>(low) + m1;
            dst[l + 32] = d2 * static_cast<float>(high) + m2;
          }
          dst += 64;
        }
      }
      return;
    }
    case kGgmlQ6_K:
      for (int64_t b = 0; b < blocks; ++b, src += 210, dst += 256) {
        const uint8_t* ql = src;
        const uint8_t* qh = src + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
        const float d = half_at(src + 208);
        for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8) {
          float* y = dst + 128 * n;
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = (d * static_cast<float>(sc[is])) * static_cast<float>(q1);
            y[l + 32] = (d * static_cast<float>(sc[is + 2])) * static_cast<float>(q2);
            y[l + 64] = (d * static_cast<float>(sc[is + 4])) * static_cast<float>(q3);
            y[l + 96] = (d * static_cast<float>(sc[is + 6])) * static_cast<float>(q4);
          }
        }
      }
      return;
    default:
      TORCH_CHECK(false, "GGML type ", type, " is not read as rows here");
  }
}
