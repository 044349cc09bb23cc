// The int8 KV cache's rotation (a Walsh-Hadamard transform of each head vector) and block
// layout, shared by its writer (kv_write.cpp) and its attention (attention_int8.cpp, which
// rotates the queries into the cache's basis and the outputs back). In an anonymous namespace,
// as in the one file these came from: each file compiles its own copy.
#pragma once

#include <c10/util/Half.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// The butterflies of stride h below a vector's width inside one vector: lane j and lane j ^ h
// pair up, the lower one takes a + b and the upper one a - b (fma(x, -1, y) = y - x, rounded
// once), as the scalar loop computes them. Lanes: the vector type and its operations.
#if defined(__AVX512F__)
struct HadamardLanes {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
  template <int h>
  static V stride(V x) {
    V swapped;
    if constexpr (h == 1) swapped = _mm512_permute_ps(x, 0xB1);
    else if constexpr (h == 2) swapped = _mm512_permute_ps(x, 0x4E);
    else if constexpr (h == 4) swapped = _mm512_shuffle_f32x4(x, x, 0xB1);
    else swapped = _mm512_shuffle_f32x4(x, x, 0x4E);
    constexpr __mmask16 upper = h == 1 ? 0xAAAA : h == 2 ? 0xCCCC : h == 4 ? 0xF0F0 : 0xFF00;
    return _mm512_fmadd_ps(x, _mm512_mask_blend_ps(upper, _mm512_set1_ps(1.f), _mm512_set1_ps(-1.f)), swapped);
  }
  static V in_lanes(V v) { return stride<8>(stride<4>(stride<2>(stride<1>(v)))); }
};
#define KVSERVE_HADAMARD_LANES 1
#elif defined(__AVX2__) && defined(__FMA__)
struct HadamardLanes {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); }
  template <int h>
  static V stride(V x) {
    V swapped;
    if constexpr (h == 1) swapped = _mm256_permute_ps(x, 0xB1);
    else if constexpr (h == 2) swapped = _mm256_permute_ps(x, 0x4E);
    else swapped = _mm256_permute2f128_ps(x, x, 0x01);
    constexpr int upper = h == 1 ? 0xAA : h == 2 ? 0xCC : 0xF0;
    return _mm256_fmadd_ps(x, _mm256_blend_ps(_mm256_set1_ps(1.f), _mm256_set1_ps(-1.f), upper), swapped);
  }
  static V in_lanes(V v) { return stride<4>(stride<2>(stride<1>(v))); }
};
#define KVSERVE_HADAMARD_LANES 1
#endif

// x <- H x in place, H the normalised Walsh-Hadamard matrix of order D (a power of two): the
// butterflies in kvserve.kv_cache.hadamard_transform's order, so the two agree bit for bit.
// An int8 cache holds rotated heads (see kvserve/kv_cache.py); H is its own inverse.
inline void hadamard_(float* x, int64_t D) {
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
#ifdef KVSERVE_HADAMARD_LANES
  // Whole vectors: the strides below the width in registers, then the wider ones between
  // vectors; every element takes the same operations in the same stage order as below (an int8
  // cache's every query and output row is rotated: the scalar strides 1-4 were a third of its
  // prefill attention).
  using L = HadamardLanes;
  if (D % L::kWidth == 0) {
    for (int64_t i = 0; i < D; i += L::kWidth) L::store(x + i, L::in_lanes(L::load(x + i)));
    for (int64_t h = L::kWidth; h < D; h *= 2) {
      for (int64_t i = 0; i < D; i += 2 * h) {
        for (int64_t j = i; j < i + h; j += L::kWidth) {
          const auto a = L::load(x + j), b = L::load(x + j + h);
          L::store(x + j, L::add(a, b));
          L::store(x + j + h, L::sub(a, b));
        }
      }
    }
    for (int64_t i = 0; i < D; i += L::kWidth) L::store(x + i, L::mul(L::load(x + i), norm));
    return;
  }
#endif
  for (int64_t h = 1; h < D; h *= 2) {
    for (int64_t i = 0; i < D; i += 2 * h) {
#pragma omp simd
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) x[d] *= norm;
}

// Dims per scale: kvserve.kv_cache.INT8_GROUP (why 32: see there).
inline int64_t int8_group_size(int64_t D) { return std::min<int64_t>(32, D); }

// int8 blocks pair their elements for vpdpwssd (two int16 products summed per 32-bit lane):
// keys [D/2][BS][2] (dims 2i, 2i+1 of a token side by side), values [BS/2][D][2] (tokens 2j,
// 2j+1 of a dim side by side); see kvserve/kv_cache.py.
inline int64_t int8_key_index(int64_t d, int64_t t, int64_t BS) { return ((d / 2) * BS + t) * 2 + d % 2; }
inline int64_t int8_value_index(int64_t t, int64_t d, int64_t D) { return ((t / 2) * D + d) * 2 + t % 2; }

}  // namespace
