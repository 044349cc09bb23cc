// Helpers shared by the fused CPU kernels' files (norm_rope.cpp, kv_write.cpp, attention.cpp,
// attention_int8.cpp, sampling.cpp), which were once one file. In an anonymous namespace, as they
// were there: each file compiles its own copy of them.
#pragma once

#include <torch/extension.h>

#if defined(__F16C__) || defined(__AVX512BW__) || defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// bf16 is the top half of an fp32: a shift, which vectorises (c10's conversion does not).
template <>
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// n <= 16 fp16 values to fp32: c10::Half's conversion is bit manipulation per element
// (~1 us for an int8 chunk's 32 scales); F16C converts 8 in one instruction.
inline void half_to_float(const c10::Half* src, int64_t n, float* dst) {
#if defined(__F16C__)
  if (n == 16) {
    const __m128i* p = reinterpret_cast<const __m128i*>(src);
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(p)));
    _mm256_storeu_ps(dst + 8, _mm256_cvtph_ps(_mm_loadu_si128(p + 1)));
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// exp(x) for x <= 0 with ~1 ulp error, written so that GCC vectorises a loop of it
// (std::exp only vectorises under -ffast-math). Cephes' expf: x = n ln2 + r, |r| <= ln2/2,
// e^r by a degree-6 polynomial, 2^n put into the exponent bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this e^x is denormal; softmax weights that small are 0
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes, in the order GCC gives the scalar form when it vectorises it
// (-fassociative-math: r = (x + n c2) - n c1, the polynomial's tail as r (p r + 1) + 1), so
// the weights keep the bits the softmax had before it was written with intrinsics.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f),
                                    _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), x));
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(r, _mm512_fmadd_ps(p, r, one), one);
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

void check_fp32_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a float32 CPU tensor");
}

// An int8 cache [2, KVH, NB, BS, D] and its fp16 scales [2, KVH, NB, D / group, BS].
void check_int8_cache(const torch::Tensor& kv_cache, const torch::Tensor& scales) {
  TORCH_CHECK(kv_cache.scalar_type() == torch::kChar, "a KV cache with scales must be int8");
  const int64_t BS = kv_cache.size(3), D = kv_cache.size(4);
  TORCH_CHECK(BS % 2 == 0 && D >= 16 && (D & (D - 1)) == 0,
              "int8 KV needs an even block size and a power-of-two head dim >= 16");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == 5 &&
                  scales.size(0) == 2 && scales.size(1) == kv_cache.size(1) && scales.size(2) == kv_cache.size(2) &&
                  scales.size(3) == D / std::min<int64_t>(32, D) && scales.size(4) == BS,  // int8_kv.h's int8_group_size
              "kv_scales must be a contiguous fp16 [2, KVH, NB, head_dim / group, BS]");
}

}  // namespace
