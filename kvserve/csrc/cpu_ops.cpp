// CPU kernels for the parts of a step where plain torch spends more time dispatching small
// ops than computing: RMSNorm, rotary embedding (+ Gemma's QK-norm), the paged KV-cache
// write, single-query paged attention, and the gated activation.
//
// Each kernel has a plain-torch twin in kvserve/ops.py that the tests compare it with; the
// Python side only calls these for fp32 activations on the CPU. Activations are fp32; the KV
// cache may be fp32, bf16 or fp16 and is read in place (no gathered copy of the blocks).
// Reductions run in fp32 with vectorised (reordered) sums (attention over a bf16 cache on AMD's
// Zen 4: products of bf16 pairs, see attention_tile_dot); every row is computed the same way
// whatever the batch, so results do not depend on batch composition.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_ops.h"
#include "step_team.h"
#include "bf16.h"
#include "amx_linear.h"
#include "amx_tiles.h"
#include "dense_linear.h"
#include "quant_linear.h"
#include "screen_linear.h"
#include "w8a8_linear.h"
#include "row_dispatch.h"
#include "avx2_reduce.h"

#include <sys/mman.h>
#if defined(__F16C__) || defined(__AVX512BW__) || defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

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

// 16 fp32 lanes as one value: one zmm register with AVX512, two named ymm registers with
// AVX2 + FMA, a GCC vector otherwise. The attention tiles keep their key/value chunks and
// accumulators in these rather than in float[16] arrays (which GCC kept on the stack, a widened
// bf16 chunk stored in two halves and reloaded whole), with every FMA written out (fma16), so
// that a block of any number of rows computes each row with the same instructions.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// A 64-byte GCC vector on AVX2 is two ymm registers for + and *, but every intrinsic needs its
// halves, and getting them (memcpy, unions) compiled to stack stores and GPR shuffles (vmovq,
// vpinsrq) in the score and value loops: 2x the prefill attention time. The halves are kept
// named instead, with the same per-lane arithmetic.
struct Vec16 {
  __m256 lo, hi;
};
inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec16 operator*(Vec16 a, float s) {
  const __m256 v = _mm256_set1_ps(s);
  return {_mm256_mul_ps(a.lo, v), _mm256_mul_ps(a.hi, v)};
}
inline Vec16 load_vec16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store_vec16(float* p, Vec16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
// c + a * b, one rounding per lane.
inline Vec16 fma16(float a, Vec16 b, Vec16 c) {
  const __m256 va = _mm256_set1_ps(a);
  return {_mm256_fmadd_ps(va, b.lo, c.lo), _mm256_fmadd_ps(va, b.hi, c.hi)};
}
#else
typedef float Vec16 __attribute__((vector_size(64)));

inline Vec16 load_vec16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_vec16(float* p, Vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// c + a * b, one rounding, spelt out with intrinsics where the CPU has FMA: GCC's contraction of a generic
// `c += a * b` depended on the surrounding code (a row computed in a block of 2 rows came out
// different from the same row in a block of 4), and each row must be computed the same way
// in every block for the results not to depend on how a prompt was chunked.
inline Vec16 fma16(float a, Vec16 b, Vec16 c) {
#if defined(__AVX512F__)
  return reinterpret_cast<Vec16>(_mm512_fmadd_ps(_mm512_set1_ps(a), reinterpret_cast<__m512>(b),
                                                 reinterpret_cast<__m512>(c)));
#else
  // No FMA instruction: a multiply and an add, kept apart from the neighbouring sums. Under
  // -fassociative-math GCC rebalanced a row's chain of them differently in blocks of different
  // sizes (a tile's rows came out 1 ulp apart from the same rows as decodes); the empty asm,
  // which takes each 16-byte part in a register, stops it without a trip through memory.
  Vec16 r = c + a * b;
#if defined(__SSE__)
  __m128 parts[4];
  std::memcpy(parts, &r, sizeof(r));
  asm("" : "+x"(parts[0]), "+x"(parts[1]), "+x"(parts[2]), "+x"(parts[3]));
  std::memcpy(&r, parts, sizeof(r));
#endif
  return r;
#endif
}
#endif

// 16 consecutive cache elements widened to fp32 (exact for every cache type but fp64).
template <typename T>
inline Vec16 widen16(const T* p) {
  float wide[16];
  for (int i = 0; i < 16; ++i) wide[i] = to_float(p[i]);
  return load_vec16(wide);
}

inline Vec16 widen16(const float* p) { return load_vec16(p); }

inline Vec16 widen16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  // One vpmovzxwd from memory and a shift (GCC's generic lowering widens in two halves).
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<Vec16>(_mm512_castsi512_ps(bits));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m128i* half = reinterpret_cast<const __m128i*>(p);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(half)), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(half + 1)), 16))};
#else
  typedef uint16_t Bits16x16 __attribute__((vector_size(32)));
  typedef uint32_t Bits32x16 __attribute__((vector_size(64)));
  Bits16x16 half;
  std::memcpy(&half, p, sizeof(half));
  const Bits32x16 bits = __builtin_convertvector(half, Bits32x16) << 16;
  Vec16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}

inline Vec16 widen16(const c10::Half* p) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
  const __m128i* half = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(half)), _mm256_cvtph_ps(_mm_loadu_si128(half + 1))};
#else
  float wide[16];
  half_to_float(p, 16, wide);
  return load_vec16(wide);
#endif
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

inline float inv_rms(const float* x, int64_t n, double eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
}

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
                  scales.size(3) == D / std::min<int64_t>(64, D) && scales.size(4) == BS,
              "kv_scales must be a contiguous fp16 [2, KVH, NB, head_dim / group, BS]");
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

inline int64_t int8_group_size(int64_t D) { return std::min<int64_t>(64, D); }

// One head vector x[0..D) of a token as int8: y = H x, then per group of int8_group_size(D)
// dims s = fp16(max|y| / 127), q[d] = round(y[d] / s) clamped to +-127; scale g goes to
// scales[g * scale_stride]. The same fp32 operations as kvserve.kv_cache's quantize_int8
// (round half to even), so the two agree bit for bit.
inline void quantize_int8_head(const float* x, int64_t D, float* y, int8_t* q, c10::Half* scales,
                               int64_t scale_stride) {
  std::copy(x, x + D, y);
  hadamard_(y, D);
  const int64_t group = int8_group_size(D);
  for (int64_t g = 0; g * group < D; ++g) {
    const float* yg = y + g * group;
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t d = 0; d < group; ++d) amax = std::max(amax, std::fabs(yg[d]));
    const c10::Half s_half(amax / 127.f);
    scales[g * scale_stride] = s_half;
    const float s = static_cast<float>(s_half);
    for (int64_t d = 0; d < group; ++d)
      q[g * group + d] =
          static_cast<int8_t>(s > 0.f ? std::min(std::max(std::nearbyint(yg[d] / s), -127.f), 127.f) : 0.f);
  }
}

// int8 blocks pair their elements for vpdpwssd (two int16 products summed per 32-bit lane):
// keys [D/2][BS][2] (dims 2i, 2i+1 of a token side by side), values [BS/2][D][2] (tokens 2j,
// 2j+1 of a dim side by side); see kvserve/kv_cache.py.
inline int64_t int8_key_index(int64_t d, int64_t t, int64_t BS) { return ((d / 2) * BS + t) * 2 + d % 2; }
inline int64_t int8_value_index(int64_t t, int64_t d, int64_t D) { return ((t / 2) * D + d) * 2 + t % 2; }

// Scales [2, KVH, NB, groups, BS]: head h's scales of block b start at ((h * NB) + b) * groups * BS.
void write_kv_int8(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kv_cache, torch::Tensor& scales,
                   const torch::Tensor& slot_mapping) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t BS = kv_cache.size(3), NB = kv_cache.size(2), head_elems = NB * BS * D;
  const int64_t groups = scales.size(3);
  int8_t* keys = kv_cache.data_ptr<int8_t>();
  int8_t* values = keys + KVH * head_elems;
  c10::Half* key_scales = scales.data_ptr<c10::Half>();
  c10::Half* value_scales = key_scales + KVH * NB * groups * BS;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  std::vector<int8_t> q(D);
  std::vector<float> rotated(D);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = slots[t] / BS, offset = slots[t] % BS;
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t scale_at = (h * NB + block) * groups * BS + offset;
      int8_t* kdst = keys + h * head_elems + block * BS * D;
      quantize_int8_head(k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1), D, rotated.data(), q.data(),
                         key_scales + scale_at, BS);
      for (int64_t d = 0; d < D; ++d) kdst[int8_key_index(d, offset, BS)] = q[d];
      int8_t* vdst = values + h * head_elems + block * BS * D;
      quantize_int8_head(v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1), D, rotated.data(), q.data(),
                         value_scales + scale_at, BS);
      for (int64_t d = 0; d < D; ++d) vdst[int8_value_index(offset, d, D)] = q[d];
    }
  }
}

template <typename cache_t>
void write_kv_impl(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kv_cache,
                   const torch::Tensor& slot_mapping) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t BS = kv_cache.size(3), head_elems = kv_cache.size(2) * BS * D;
  cache_t* keys = kv_cache.data_ptr<cache_t>();
  cache_t* values = keys + KVH * head_elems;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = slots[t] / BS, offset = slots[t] % BS;
    for (int64_t h = 0; h < KVH; ++h) {
      const float* kx = k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1);
      const float* vx = v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1);
      // Keys: column `offset` of the block's [D, BS] matrix. Values: row `offset` of [BS, D].
      cache_t* kdst = keys + h * head_elems + block * D * BS + offset;
      for (int64_t d = 0; d < D; ++d) kdst[d * BS] = from_float<cache_t>(kx[d]);
      cache_t* vdst = values + h * head_elems + (block * BS + offset) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) vdst[d] = from_float<cache_t>(vx[d]);
    }
  }
}

}  // namespace

// Store k, v [T, KVH, D] (fp32, any row/head strides, contiguous head_dim) at their flat slots
// of kv_cache [2, KVH, num_blocks, block_size, D], converting to the cache's dtype, or, with
// kv_scales [2, KVH, num_blocks, block_size] (fp16), quantizing to the int8 cache. Keys are
// stored transposed per block, [D, block_size] (see kvserve/kv_cache.py).
void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache, c10::optional<torch::Tensor> kv_scales,
                    torch::Tensor slot_mapping) {
  check_fp32_cpu(k, "k");
  check_fp32_cpu(v, "v");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k/v head_dim must be contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be a contiguous [2, KVH, NB, BS, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  auto slots = slot_mapping.contiguous();
  if (kv_scales) {
    check_int8_cache(kv_cache, *kv_scales);
    write_kv_int8(k, v, kv_cache, *kv_scales, slots);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "write_kv_cache", [&] {
    write_kv_impl<scalar_t>(k, v, kv_cache, slots);
  });
}

namespace {

template <typename T>
struct TypeTag {
  using type = T;
};

constexpr int64_t kKeyChunk = 16;  // keys per inner tile: one 16-float vector of scores
constexpr int64_t kQueryTile = 16;  // queries per work item (times G heads = rows)
constexpr int64_t kRowBlock = 4;  // score rows computed together
constexpr int64_t kPrefetchChunks = 2;  // a decode's key chunks fetched ahead of the one in use
// Keys are split at multiples of this position into partitions with their own softmax, merged
// in order (see attention_impl): a lone decode's partitions can run on every thread.
constexpr int64_t kKeyPartition = 128;

// The first key a query at position `pos` sees: (pos - window, pos] with a window, else 0.
inline int64_t first_visible_key(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

// Row r (= query r / G, head r % G of KV head kvh) of a tile's output: acc / sum.
inline void store_normalized_row(float* out, int64_t o_s0, int64_t o_s1, int64_t first_row, int64_t kvh, int64_t G,
                                 int64_t r, const float* acc, float sum, int64_t D) {
  float* o = out + (first_row + r / G) * o_s0 + (kvh * G + r % G) * o_s1;
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
}

// A tile's end: its unnormalised accumulators [rows, D], row maxima and row sums (adjacent in
// `acc`) to `partial` for merge_partitions, or its rows normalised into `out`.
inline void finish_tile(const float* acc, int64_t rows, int64_t D, float* partial, float* out, int64_t o_s0,
                        int64_t o_s1, int64_t first_row, int64_t kvh, int64_t G) {
  if (partial != nullptr) {
    std::copy(acc, acc + rows * D + 2 * rows, partial);
    return;
  }
  const float* row_sum = acc + rows * D + rows;
  for (int64_t r = 0; r < rows; ++r)
    store_normalized_row(out, o_s0, o_s1, first_row, kvh, G, r, acc + r * D, row_sum[r], D);
}

// A chunk of keys [j0, j1) (see for_each_key_chunk). In a float or bf16 cache its keys start at
// key_offset (row d at + d * BS) and its values at value_offset (row t at + t * D) in the head's
// cache; key_ahead / value_ahead: the same for the chunk kPrefetchChunks ahead, or -1. (An int8
// cache's tile takes j0 and j1 alone: its layout is its own.)
struct KeyChunk {
  int64_t j0, j1, key_offset, value_offset, key_ahead, value_ahead;
};

// The keys [first, last] a tile of `num_queries` queries from `first_query_pos` visits within
// [key_begin, key_end): from the first key its queries see, rounded down to the grid of 16
// positions on which every tile's key chunks sit, to the last query's own position.
inline std::pair<int64_t, int64_t> visited_keys(int64_t first_query_pos, int64_t num_queries, int64_t window,
                                                int64_t key_begin, int64_t key_end) {
  return {std::max(key_begin, first_visible_key(first_query_pos, window)) & ~(kKeyChunk - 1),
          std::min(first_query_pos + num_queries, key_end) - 1};
}

// The chunks of keys a tile of `num_queries` queries from `first_query_pos` visits within
// [key_begin, key_end): at most kKeyChunk keys each, never crossing a paged block, from the
// first key its queries see to the last, on a grid of 16 positions for every cache and route
// (keys before the first visible one come along, hidden by the rows' windows). A key's chunk,
// and so its lane in the softmax's sums, then depends on its position alone, not on the tile's
// first query: with a sliding window, a decode and a prefill tile summed a row's weights in
// other lanes (1 ulp apart on the bf16-dot route). With `prefetch` (a decode's tile) each chunk
// names the one kPrefetchChunks ahead, fetched into L2 a line at a time inside the score loop:
// blocks sit anywhere in the pool, so the hardware prefetcher cannot follow; a prefill's tile
// computes long enough on each chunk not to need it.
template <typename Body>
inline void for_each_key_chunk(const int32_t* table, int64_t BS, int64_t D, int64_t first_query_pos,
                               int64_t num_queries, int64_t window, int64_t key_begin, int64_t key_end, bool prefetch,
                               Body&& body) {
  const auto [first_key, last_key] = visited_keys(first_query_pos, num_queries, window, key_begin, key_end);
  auto key_offset = [&](int64_t pos) { return table[pos / BS] * D * BS + pos % BS; };
  auto value_offset = [&](int64_t pos) { return (table[pos / BS] * BS + pos % BS) * D; };
  for (int64_t j0 = first_key; j0 <= last_key;) {
    const int64_t j1 = std::min({j0 + kKeyChunk, (j0 / BS + 1) * BS, last_key + 1});
    const int64_t ahead = j0 + kPrefetchChunks * kKeyChunk;
    const bool fetch = prefetch && ahead <= last_key;
    body(KeyChunk{j0, j1, key_offset(j0), value_offset(j0), fetch ? key_offset(ahead) : -1,
                  fetch ? value_offset(ahead) : -1});
    j0 = j1;
  }
}

// The lanes of a chunk of keys [j0, j0 + n_keys) that a row seeing the keys [lo, hi] sees: one
// run of the chunk, t in [first, last] (empty where first > last).
struct VisibleRun {
  int64_t first, last;
};
inline VisibleRun visible_run(int64_t j0, int64_t n_keys, int64_t lo, int64_t hi) {
  return {std::max<int64_t>(lo - j0, 0), std::min<int64_t>(hi - j0, n_keys - 1)};
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

// visible_run as a lane mask.
inline __mmask16 visible_lanes(int64_t j0, int64_t n_keys, int64_t lo, int64_t hi) {
  const auto [t_lo, t_hi] = visible_run(j0, n_keys, lo, hi);
  return t_lo > t_hi ? static_cast<__mmask16>(0)
                     : static_cast<__mmask16>(((1u << (t_hi + 1)) - 1) & ~((1u << t_lo) - 1));
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive16's steps on 8 lanes (the same order, so the same bits lane for lane).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f),
                                    _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), x));
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(r, _mm256_fmadd_ps(p, r, one), one);
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// visible_run as two 8-lane masks (all ones where visible).
inline void visible_lanes8(int64_t j0, int64_t n_keys, int64_t lo, int64_t hi, __m256 (&visible)[2]) {
  const VisibleRun run = visible_run(j0, n_keys, lo, hi);
  // (clamped into int32: a chunk wholly outside the run has first > 15 or last < 0)
  const int t_lo = static_cast<int>(std::min<int64_t>(run.first, kKeyChunk));
  const int t_hi = static_cast<int>(std::max<int64_t>(run.last, -1));
  for (int h = 0; h < 2; ++h) {
    const __m256i lane = _mm256_setr_epi32(8 * h, 8 * h + 1, 8 * h + 2, 8 * h + 3, 8 * h + 4, 8 * h + 5, 8 * h + 6, 8 * h + 7);
    const __m256i outside = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(t_lo), lane),
                                            _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(t_hi)));
    visible[h] = _mm256_castsi256_ps(_mm256_xor_si256(outside, _mm256_set1_epi32(-1)));
  }
}
#endif

// The online softmax of one score row over one chunk of keys [j0, j0 + 16): x holds the scaled
// scores (soft-capped here); keys in [lo, hi] and below n_keys are visible. Writes the weights
// p (relative to the row's new maximum; 0 where hidden), updates the row's max and sum, and
// returns the factor that rescales the row's earlier accumulators (the widened route; the
// bf16-dot route's softmax is partition_softmax_row).
inline float softmax_chunk(float* x, int64_t j0, int64_t n_keys, int64_t lo, int64_t hi, float softcap,
                           float& row_max, float& row_sum, float* p) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (softcap > 0.f) {
    for (int64_t t = 0; t < kKeyChunk; ++t) x[t] = std::tanh(x[t] / softcap) * softcap;
  }
#if defined(__AVX512F__)
  // The visible keys as a lane mask: a masked reduction for the max where it can move, one sum;
  // the weights of hidden keys are zeroed by the mask.
  const __m512 xv = _mm512_loadu_ps(x);
  const __mmask16 visible = visible_lanes(j0, n_keys, lo, hi);
  if (!_mm512_mask_cmp_ps_mask(visible, xv, _mm512_set1_ps(kNegInf), _CMP_NEQ_UQ)) {  // nothing visible to this row
    _mm512_storeu_ps(p, _mm512_setzero_ps());
    return 1.f;
  }
  // Past a row's first chunks its max rarely moves: when no visible score is above it, the max
  // stands without the horizontal reduction (a chain of ~20 cycles per row and chunk; prefill
  // attention 0.97-0.98x the time). The same max either way.
  const bool max_stands =
      row_max != kNegInf && !_mm512_mask_cmp_ps_mask(visible, xv, _mm512_set1_ps(row_max), _CMP_GT_OQ);
  const float new_max = max_stands ? row_max : std::max(row_max, _mm512_mask_reduce_max_ps(visible, xv));
  // (exp_nonpositive(0) is exactly 1: a row whose max stands needs no exp here)
  const float correction = row_max == new_max ? 1.f : exp_nonpositive(row_max - new_max);
  const __m512 weights = _mm512_maskz_mov_ps(
      visible, exp_nonpositive16(_mm512_min_ps(_mm512_sub_ps(xv, _mm512_set1_ps(new_max)), _mm512_setzero_ps())));
  _mm512_storeu_ps(p, weights);
  const float p_sum = _mm512_reduce_add_ps(weights);
#elif defined(__AVX2__) && defined(__FMA__)
  // The AVX512 steps above in two 8-lane halves. (Left to GCC, the loops below computed every
  // chunk's max, the correction's exp and two horizontal reductions: 4 % of an int8 prompt's
  // time on Zen 3.)
  const __m256 xv[2] = {_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)};
  __m256 visible[2];
  visible_lanes8(j0, n_keys, lo, hi, visible);
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  int any_score = 0, above_max = 0;
  for (int h = 0; h < 2; ++h) {
    any_score |= _mm256_movemask_ps(_mm256_and_ps(visible[h], _mm256_cmp_ps(xv[h], neg_inf, _CMP_NEQ_UQ)));
    above_max |= _mm256_movemask_ps(_mm256_and_ps(visible[h], _mm256_cmp_ps(xv[h], _mm256_set1_ps(row_max), _CMP_GT_OQ)));
  }
  if (!any_score) {  // nothing visible to this row
    _mm256_storeu_ps(p, _mm256_setzero_ps());
    _mm256_storeu_ps(p + 8, _mm256_setzero_ps());
    return 1.f;
  }
  float new_max = row_max;
  if (row_max == kNegInf || above_max)  // (hidden lanes read as -inf)
    new_max = std::max(row_max, horizontal_max(_mm256_max_ps(_mm256_blendv_ps(neg_inf, xv[0], visible[0]),
                                                             _mm256_blendv_ps(neg_inf, xv[1], visible[1]))));
  const float correction = row_max == new_max ? 1.f : exp_nonpositive(row_max - new_max);
  __m256 weights[2];
  for (int h = 0; h < 2; ++h) {
    weights[h] = _mm256_and_ps(visible[h], exp_nonpositive8(_mm256_min_ps(_mm256_sub_ps(xv[h], _mm256_set1_ps(new_max)),
                                                                          _mm256_setzero_ps())));
    _mm256_storeu_ps(p + 8 * h, weights[h]);
  }
  const float p_sum = horizontal_sum(_mm256_add_ps(weights[0], weights[1]));
#else
  // Masking by a 0/1 factor rather than branches keeps these loops vectorised.
  float visible[kKeyChunk];
#pragma omp simd
  for (int64_t t = 0; t < kKeyChunk; ++t) {
    const int64_t key = j0 + t;
    visible[t] = (t < n_keys) & (key <= hi) & (key >= lo) ? 1.f : 0.f;
  }
  float chunk_max = kNegInf;
#pragma omp simd reduction(max : chunk_max)
  for (int64_t t = 0; t < kKeyChunk; ++t) chunk_max = std::max(chunk_max, visible[t] > 0.f ? x[t] : kNegInf);
  if (chunk_max == kNegInf) {  // nothing visible to this row
#pragma omp simd
    for (int64_t t = 0; t < kKeyChunk; ++t) p[t] = 0.f;
    return 1.f;
  }
  const float new_max = std::max(row_max, chunk_max);
  const float correction = exp_nonpositive(row_max - new_max);  // ~0 on the row's first chunk
  float p_sum = 0.f;
#pragma omp simd reduction(+ : p_sum)
  for (int64_t t = 0; t < kKeyChunk; ++t) {
    // A masked key may score above the max: clamp before exp, then zero it.
    p[t] = visible[t] * exp_nonpositive(std::min(x[t] - new_max, 0.f));
    p_sum += p[t];
  }
#endif
  row_sum = row_sum * correction + p_sum;
  row_max = new_max;
  return correction;
}

// softmax_chunk for `rows` score rows x[r] (row_max/row_sum/lo/hi/p/correction indexed alike).
// Never inlined: one copy of the code serves every row, since GCC compiled the sum and the exp
// differently in the tiles' blocks of 1-4 rows (-fassociative-math), and a row must not depend
// on its block.
__attribute__((noinline)) void softmax_rows(float (*x)[kKeyChunk], int64_t rows, int64_t j0, int64_t n_keys,
                                            const int64_t* lo, const int64_t* hi, float softcap, float* row_max,
                                            float* row_sum, float (*p)[kKeyChunk], float* correction) {
  for (int64_t r = 0; r < rows; ++r)
    correction[r] = softmax_chunk(x[r], j0, n_keys, lo[r], hi[r], softcap, row_max[r], row_sum[r], p[r]);
}

// The first pass of the two-pass softmaxes (partition_softmax_row, partition_softmax_f32): one
// score row's max over the visible keys of a key partition's chunks, x + c * stride holding
// chunk c's 16 scaled scores (keys from j0s[c], nks[c] of them; those in [lo, hi] visible),
// soft-capped here, in place. A max, so the same in any order.
inline float partition_row_max(float* x, int64_t stride, int64_t num_chunks, const int64_t* j0s, const int64_t* nks,
                               int64_t lo, int64_t hi, float softcap) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; softcap > 0.f && c < num_chunks; ++c) {
    float* xc = x + c * stride;
    for (int64_t t = 0; t < kKeyChunk; ++t) xc[t] = std::tanh(xc[t] / softcap) * softcap;
  }
#if defined(__AVX512F__)
  __m512 max16 = _mm512_set1_ps(kNegInf);
  for (int64_t c = 0; c < num_chunks; ++c)
    max16 = _mm512_mask_max_ps(max16, visible_lanes(j0s[c], nks[c], lo, hi), max16, _mm512_loadu_ps(x + c * stride));
  return _mm512_reduce_max_ps(max16);
#else
  float max = kNegInf;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const float* xc = x + c * stride;
    for (int64_t t = std::max<int64_t>(lo - j0s[c], 0); t < nks[c] && j0s[c] + t <= hi; ++t) max = std::max(max, xc[t]);
  }
  return max;
#endif
}

// The int8 cache's softmax of one score row over the chunks of one key partition, in two passes
// as the bf16-dot route's (partition_softmax_row: its arguments), with fp32 weights: chunk c's
// at p + c * 16 (0 where hidden), summed lane-wise over the chunks in order, then across lanes.
// Against an online softmax per chunk, no row's value sums need rescaling, so they stay in
// integers across the partition (int8_partition_values). Never inlined: one copy of the code
// serves every row, whatever block of rows it was scored in.
__attribute__((noinline)) void partition_softmax_f32(float* x, int64_t stride, int64_t num_chunks,
                                                     const int64_t* j0s, const int64_t* nks, int64_t lo, int64_t hi,
                                                     float softcap, float* row_max, float* row_sum, float* p) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const float max = partition_row_max(x, stride, num_chunks, j0s, nks, lo, hi, softcap);
  *row_max = max;
  if (max == kNegInf) {  // nothing visible (or only -inf scores): no weight, as merge_partitions expects
    std::fill(p, p + num_chunks * kKeyChunk, 0.f);
    *row_sum = 0.f;
    return;
  }
#if defined(__AVX512F__)
  __m512 sum16 = _mm512_setzero_ps();
  const __m512 max_lanes = _mm512_set1_ps(max);
  for (int64_t c = 0; c < num_chunks; ++c) {
    // A hidden key may score above the max: clamped before the exp, then zeroed by the mask.
    const __m512 shifted = _mm512_min_ps(_mm512_sub_ps(_mm512_loadu_ps(x + c * stride), max_lanes), _mm512_setzero_ps());
    const __m512 weights = _mm512_maskz_mov_ps(visible_lanes(j0s[c], nks[c], lo, hi), exp_nonpositive16(shifted));
    _mm512_storeu_ps(p + c * kKeyChunk, weights);
    sum16 = _mm512_add_ps(sum16, weights);
  }
  *row_sum = _mm512_reduce_add_ps(sum16);
#else
  float sums[kKeyChunk] = {};
  for (int64_t c = 0; c < num_chunks; ++c) {
    const float* xc = x + c * stride;
    float* pc = p + c * kKeyChunk;
#pragma omp simd
    for (int64_t t = 0; t < kKeyChunk; ++t) {
      const int64_t key = j0s[c] + t;
      const float visible = (t < nks[c]) & (key <= hi) & (key >= lo) ? 1.f : 0.f;
      pc[t] = visible * exp_nonpositive(std::min(xc[t] - max, 0.f));
      sums[t] += pc[t];
    }
  }
  float sum = 0.f;
  for (int64_t t = 0; t < kKeyChunk; ++t) sum += sums[t];
  *row_sum = sum;
#endif
}

// Attention over a bf16 cache on Intel's matrix unit (attention_tile_amx): 0 off (the vector
// routes), 1 the hardware's tiles, 2 their emulation (tests, any CPU with AVX512-BF16). Opt-in
// (KVSERVE_ATTENTION_ROUTE=amx, or set_attention_kernel_route) until it has been measured on an
// AMX machine; like every route it is fixed for the process, so that a decode's row and a
// prompt's row take the same instructions. =amx where the tiles cannot run raises (at the
// extension's load: ops.load_extension asks for the route).
std::atomic<int> g_attention_amx{0};
std::once_flag g_attention_amx_resolved;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
const std::string& attention_tiles_refusal();  // "" where the hardware's tiles may run it (below)
#endif

int attention_amx_mode() {
  std::call_once(g_attention_amx_resolved, [] {
    const char* route = std::getenv("KVSERVE_ATTENTION_ROUTE");
    if (route == nullptr || std::strcmp(route, "amx") != 0) return;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
    TORCH_CHECK(attention_tiles_refusal().empty(), "KVSERVE_ATTENTION_ROUTE=amx, but the AMX tiles cannot run here: ",
                attention_tiles_refusal());
    g_attention_amx.store(1, std::memory_order_relaxed);
#else
    TORCH_CHECK(false, "KVSERVE_ATTENTION_ROUTE=amx, but the AMX tiles cannot run here: ",
                amx_bf16_available() ? std::string("this build has no AVX512-BF16") : amx_bf16_status());
#endif
  });
  return g_attention_amx.load(std::memory_order_relaxed);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define KVSERVE_ATTENTION_BF16_DOT 1
// Whether attention over a bf16 cache multiplies in bf16 pairs with vdpbf16ps (the queries and
// the softmax weights rounded to bf16, sums in fp32) rather than widening the cache to fp32 for
// FMAs: 32 products per instruction against 16 where vdpbf16ps runs at the FMA's rate (see
// bf16_dot_route; KVSERVE_ATTENTION_ROUTE=dot|widened overrides).
bool g_attention_bf16_dot = bf16_dot_route("KVSERVE_ATTENTION_ROUTE");

// vpermt2w's word indices for pair_rows: a's word i, then b's (index 32 + i). A constant table,
// not a function-local static with a run-time initialiser: that one's guard check (a possible
// call, across which no zmm register survives) sat inside the loops that pair rows, and GCC kept
// their score and value accumulators on the stack around it (decode attention from cache ran
// 1.25-1.3x the time it does now).
alignas(64) constexpr uint16_t kInterleaveWords[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};

// Lane i of the result holds the bf16 pair (a[i], b[i]) that vdpbf16ps multiplies in lane i:
// two rows of 16 bf16 values interleaved.
__attribute__((always_inline)) inline __m512i pair_rows(const uint16_t* a, const uint16_t* b) {
  const __m512i va = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  const __m512i vb = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  return _mm512_permutex2var_epi16(va, _mm512_load_si512(kInterleaveWords), vb);
}

// acc + the products of the bf16 pair `pair` (one 32-bit word, broadcast) with each lane's pair.
__attribute__((always_inline)) inline __m512 dot_pairs(__m512 acc, uint32_t pair, __m512i lanes) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(pair))),
                          reinterpret_cast<__m512bh>(lanes));
}

// 16 fp32 values rounded to bf16 (to nearest, ties to even), stored as 8 pairs: word j holds
// values 2j (low half) and 2j + 1.
inline void store_bf16x16(uint32_t* dst, __m512 values) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(values)));
}

// The bf16-dot route's two halves for NR score rows over one chunk of 16 keys, as functions of
// their own so that the accumulators stay in registers. Keys come paired (lane t of word i
// holds key t's dimensions 2i, 2i + 1) from the cache directly (kDirect: a full chunk, rows
// of the [D, BS] block paired on the fly) or from `paired` ([D / 2, 16] words); values from the
// [BS, D] block (kDirect) or `paired` ([8, D] words: keys 2j, 2j + 1 per word). The score
// loop fetches, a line per step, the keys at k_ahead ([D, BS] rows) and the 16 keys' values at
// v_ahead (each null: none).
template <int64_t NR, bool kDirect>
__attribute__((always_inline)) inline void chunk_scores_dot(const uint32_t* q_pairs, int64_t D, const uint16_t* kb,
                                                            int64_t BS, const uint32_t* paired, const char* k_ahead,
                                                            const char* v_ahead, float scale, float (*x)[kKeyChunk]) {
  __m512 sc[NR], sc_odd[NR];
  for (int64_t b = 0; b < NR; ++b) sc[b] = sc_odd[b] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D / 2; i += 2) {
    if (k_ahead != nullptr) {  // as attention_tile: a line of the chunk ahead per step
      const int64_t d = 2 * i;
      for (int64_t e = 0; e < 4; ++e) __builtin_prefetch(k_ahead + (d + e) * BS * 2, 0, 2);
    }
    if (v_ahead != nullptr) {
      constexpr int64_t kValueBytesPerStep = 4 * kKeyChunk * 2;
      for (int64_t off = 0; off < kValueBytesPerStep; off += 64)
        __builtin_prefetch(v_ahead + i / 2 * kValueBytesPerStep + off, 0, 2);
    }
    __m512i k0, k1;
    if constexpr (kDirect) {
      k0 = pair_rows(kb + 2 * i * BS, kb + (2 * i + 1) * BS);
      k1 = pair_rows(kb + (2 * i + 2) * BS, kb + (2 * i + 3) * BS);
    } else {
      k0 = _mm512_loadu_si512(paired + i * kKeyChunk);
      k1 = _mm512_loadu_si512(paired + (i + 1) * kKeyChunk);
    }
    for (int64_t b = 0; b < NR; ++b) {
      sc[b] = dot_pairs(sc[b], q_pairs[b * D / 2 + i], k0);
      sc_odd[b] = dot_pairs(sc_odd[b], q_pairs[b * D / 2 + i + 1], k1);
    }
  }
  for (int64_t b = 0; b < NR; ++b) _mm512_storeu_ps(x[b], _mm512_mul_ps(_mm512_add_ps(sc[b], sc_odd[b]), _mm512_set1_ps(scale)));
}

// A chunk's keys or values paired into a buffer (chunk_scores_dot's `paired`,
// partition_values_dot's `paired`): n_keys < 16 (a partial chunk) pads with zero keys.
inline void pair_key_chunk(const uint16_t* kb, int64_t BS, int64_t D, int64_t n_keys, uint32_t* k_pairs) {
  if (n_keys == kKeyChunk) {
    for (int64_t i = 0; i < D / 2; ++i)
      _mm512_storeu_si512(k_pairs + i * kKeyChunk, pair_rows(kb + 2 * i * BS, kb + (2 * i + 1) * BS));
    return;
  }
  for (int64_t i = 0; i < D / 2; ++i)
    for (int64_t t = 0; t < kKeyChunk; ++t)
      k_pairs[i * kKeyChunk + t] = t < n_keys ? kb[2 * i * BS + t] | (static_cast<uint32_t>(kb[(2 * i + 1) * BS + t]) << 16) : 0u;
}

inline void pair_value_chunk(const uint16_t* vb, int64_t D, int64_t n_keys, uint32_t* v_pairs) {
  if (n_keys == kKeyChunk) {
    for (int64_t j = 0; j < kKeyChunk / 2; ++j)
      for (int64_t d0 = 0; d0 < D; d0 += kKeyChunk)
        _mm512_storeu_si512(v_pairs + j * D + d0, pair_rows(vb + 2 * j * D + d0, vb + (2 * j + 1) * D + d0));
    return;
  }
  for (int64_t j = 0; j < kKeyChunk / 2; ++j)
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t lo = 2 * j < n_keys ? vb[2 * j * D + d] : 0u, hi = 2 * j + 1 < n_keys ? vb[(2 * j + 1) * D + d] : 0u;
      v_pairs[j * D + d] = lo | (hi << 16);
    }
}

// A tile's rows of queries (row r: query r / G, head r % G of KV head kvh) rounded to bf16 (to
// nearest even) as pairs, [rows, D / 2] words: the A operand of the dot and tile routes' scores.
inline void query_pairs(const float* q, int64_t q_s0, int64_t q_s1, int64_t first_row, int64_t kvh, int64_t G,
                        int64_t rows, int64_t D, uint32_t* pairs) {
  for (int64_t r = 0; r < rows; ++r) {  // 16 queries' values at a time
    const float* qr = q + (first_row + r / G) * q_s0 + (kvh * G + r % G) * q_s1;
    for (int64_t d = 0; d < D; d += kKeyChunk) store_bf16x16(pairs + r * D / 2 + d / 2, _mm512_loadu_ps(qr + d));
  }
}

// The bf16-dot route's softmax of one score row over the chunks of one key partition, in two
// passes: the row's max over every score it sees, then its weights relative to that max. x is
// chunk c's 16 scaled scores at x + c * stride (soft-capped here, in place); in chunk c (keys
// from j0s[c], nks[c] of them) the keys in [lo, hi] are visible. Writes the weights rounded to
// bf16 (to nearest even), as the pairs the values' vdpbf16ps multiplies (p_pairs[c * 8 + i]:
// keys 2i, 2i + 1 of chunk c; 0 where hidden), the row's max and the sum of the rounded
// weights (so the sum is of the weights it applies): lane-wise over the chunks in order, then
// across lanes. Against an online softmax (a max, a sum and a rescaling of the row's values per
// chunk) this takes one horizontal max and one sum per row and partition, and the values need
// no rescaling: their sums stay in registers across the partition (Zen 4, 30 layers of SmolLM2's
// attention over a 256-token prompt: 13.5 -> 10.4 ms; in the engine's prefill 1.15x). Never
// inlined: one copy of the code serves every row, whatever block of rows it was scored in.
// (The widened route keeps its online softmax: in this order it measured 1.1-1.25x slower on
// AVX2 and ~1.1x faster with AVX512; one order serves both builds there.)
__attribute__((noinline)) void partition_softmax_row(float* x, int64_t stride, int64_t num_chunks,
                                                     const int64_t* j0s, const int64_t* nks, int64_t lo, int64_t hi,
                                                     float softcap, float* row_max, float* row_sum,
                                                     uint32_t* p_pairs) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const float max = partition_row_max(x, stride, num_chunks, j0s, nks, lo, hi, softcap);
  if (max == kNegInf) {  // nothing visible (or only -inf scores): no weight, as merge_partitions expects
    for (int64_t c = 0; c < num_chunks; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_pairs + c * (kKeyChunk / 2)), _mm256_setzero_si256());
    *row_max = kNegInf;
    *row_sum = 0.f;
    return;
  }
  __m512 sum16 = _mm512_setzero_ps();
  const __m512 max_lanes = _mm512_set1_ps(max);
  for (int64_t c = 0; c < num_chunks; ++c) {
    // A hidden key may score above the max: clamped before the exp, then zeroed by the mask.
    const __m512 shifted = _mm512_min_ps(_mm512_sub_ps(_mm512_loadu_ps(x + c * stride), max_lanes), _mm512_setzero_ps());
    const __m256bh weights = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(visible_lanes(j0s[c], nks[c], lo, hi), exp_nonpositive16(shifted)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_pairs + c * (kKeyChunk / 2)), reinterpret_cast<__m256i>(weights));
    sum16 = _mm512_add_ps(sum16, _mm512_cvtpbh_ps(weights));
  }
  *row_max = max;
  *row_sum = _mm512_reduce_add_ps(sum16);
}

// acc[b] (rows of D) = the partition's values weighted by row b's weights (p_pairs[b * pair_stride
// + c * 8 + j]: chunk c's keys 2j, 2j + 1), 16 columns of d at a time over every chunk, two
// chains per row (even and odd pairs of keys) kept in registers. Chunk c's values come from the
// cache's [BS, D] block at direct[c] (rows paired on the fly) or, where that is null, paired
// ([8, D] words) at paired[c].
template <int64_t NR>
__attribute__((always_inline)) inline void partition_values_dot(float* acc, int64_t D, int64_t num_chunks,
                                                                const uint16_t* const* direct,
                                                                const uint32_t* const* paired,
                                                                const uint32_t* p_pairs, int64_t pair_stride) {
  for (int64_t d0 = 0; d0 < D; d0 += kKeyChunk) {
    __m512 even[NR], odd[NR];
    for (int64_t b = 0; b < NR; ++b) even[b] = odd[b] = _mm512_setzero_ps();
    for (int64_t c = 0; c < num_chunks; ++c) {
      // (the weights' broadcasts stay memory operands, not general registers: see attention_tile)
      asm("" : : "r"(p_pairs) : "memory");
      const uint32_t* pc = p_pairs + c * (kKeyChunk / 2);
      const uint16_t* vb = direct[c];
      const uint32_t* vp = paired[c];
      for (int64_t j = 0; j < kKeyChunk / 2; j += 2) {
        __m512i v0, v1;
        if (vb != nullptr) {
          v0 = pair_rows(vb + 2 * j * D + d0, vb + (2 * j + 1) * D + d0);
          v1 = pair_rows(vb + (2 * j + 2) * D + d0, vb + (2 * j + 3) * D + d0);
        } else {
          v0 = _mm512_loadu_si512(vp + j * D + d0);
          v1 = _mm512_loadu_si512(vp + (j + 1) * D + d0);
        }
        for (int64_t b = 0; b < NR; ++b) {
          even[b] = dot_pairs(even[b], pc[b * pair_stride + j], v0);
          odd[b] = dot_pairs(odd[b], pc[b * pair_stride + j + 1], v1);
        }
      }
    }
    for (int64_t b = 0; b < NR; ++b) _mm512_storeu_ps(acc + b * D + d0, _mm512_add_ps(even[b], odd[b]));
  }
}

// attention_tile for a bf16 cache on the bf16-dot route, over one key partition: the same
// chunks, partitions and masks, with each score a sum over pairs of dimensions
// (q[d], q[d + 1]) . (k[d], k[d + 1]) and each output a sum over pairs of keys
// (p[t], p[t + 1]) . (v[t], v[t + 1]), in fp32, two chains each. The queries are rounded to
// bf16 once per tile, the weights as the softmax makes them (partition_softmax_row). Rows are
// taken in blocks of up to kRowBlock: each block scores every chunk some row of it sees, then
// each row's softmax runs over the whole partition, then the block's values. A decode's few rows
// read full chunks straight from the cache (pairing rows as they read them); more rows
// (prefill) or a partial chunk pair a chunk once into a buffer (zero-padded). Every row takes
// the same operations, in the same order, on either path and in any block: a chunk that a block
// includes for another row's sake adds exact zeros to it.
template <int64_t kD>
void attention_tile_dot(const float* q, int64_t q_s0, int64_t q_s1, float* out, int64_t o_s0, int64_t o_s1,
                        const c10::BFloat16* khead_, const c10::BFloat16* vhead_, const int32_t* table, int64_t BS,
                        int64_t d_runtime, int64_t G, int64_t first_query_pos, int64_t num_queries, int64_t first_row,
                        int64_t kvh, float scale, int64_t window, float softcap, int64_t key_begin, int64_t key_end,
                        float* partial, std::vector<float>& work) {
  const int64_t D = kD > 0 ? kD : d_runtime;
  const int64_t rows = num_queries * G;
  const uint16_t* khead = reinterpret_cast<const uint16_t*>(khead_);
  const uint16_t* vhead = reinterpret_cast<const uint16_t*>(vhead_);
  const bool few_rows = rows <= kRowBlock;

  // The partition's chunks, each ending at a block's end, 16 keys after its start or at the last
  // key: at most kKeyPartition (blocks of one key).
  constexpr int64_t kMaxChunks = kKeyPartition;
  int64_t j0s[kMaxChunks], nks[kMaxChunks], key_offsets[kMaxChunks], value_offsets[kMaxChunks], key_aheads[kMaxChunks];
  const uint16_t* key_direct[kMaxChunks];
  const uint16_t* value_direct[kMaxChunks];
  const uint32_t* key_paired[kMaxChunks];
  const uint32_t* value_paired[kMaxChunks];
  int64_t num_chunks = 0, num_paired = 0;
  for_each_key_chunk(table, BS, D, first_query_pos, num_queries, window, key_begin, key_end, few_rows,
                     [&](const KeyChunk& chunk) {
    TORCH_CHECK(num_chunks < kMaxChunks, "attention: more key chunks than a partition holds");
    const int64_t n_keys = chunk.j1 - chunk.j0;
    const bool direct = few_rows && n_keys == kKeyChunk;
    j0s[num_chunks] = chunk.j0, nks[num_chunks] = n_keys, key_offsets[num_chunks] = chunk.key_offset;
    value_offsets[num_chunks] = chunk.value_offset, key_aheads[num_chunks] = chunk.key_ahead;
    key_direct[num_chunks] = direct ? khead + chunk.key_offset : nullptr;
    value_direct[num_chunks] = direct ? vhead + chunk.value_offset : nullptr;
    num_paired += direct ? 0 : 1;
    ++num_chunks;
  });

  // acc [rows, D], row_max, row_sum (adjacent, as finish_tile takes them), the queries' bf16
  // pairs [rows, D / 2], the paired chunks' keys [D / 2, 16] and values [8, D] (32-bit words: a
  // float's room each), a row block's scores [chunks, kRowBlock, 16] and weights [kRowBlock,
  // chunks, 8].
  const int64_t chunk_words = D / 2 * kKeyChunk;  // = 8 * D
  work.resize(rows * D + 2 * rows + rows * D / 2 + 2 * num_paired * chunk_words +
              num_chunks * kRowBlock * kKeyChunk + kRowBlock * num_chunks * kKeyChunk / 2);
  float* acc = work.data();
  float* row_max = acc + rows * D;
  float* row_sum = row_max + rows;
  uint32_t* q_pairs = reinterpret_cast<uint32_t*>(row_sum + rows);
  uint32_t* pair_buffer = q_pairs + rows * D / 2;
  float(*scores)[kKeyChunk] = reinterpret_cast<float(*)[kKeyChunk]>(pair_buffer + 2 * num_paired * chunk_words);
  uint32_t* p_pairs = reinterpret_cast<uint32_t*>(scores + num_chunks * kRowBlock);
  for (int64_t c = 0, slot = 0; c < num_chunks; ++c) {
    key_paired[c] = value_paired[c] = nullptr;
    if (key_direct[c] != nullptr) continue;
    uint32_t* k_pairs = pair_buffer + 2 * slot * chunk_words;
    uint32_t* v_pairs = k_pairs + chunk_words;
    pair_key_chunk(khead + key_offsets[c], BS, D, nks[c], k_pairs);
    pair_value_chunk(vhead + value_offsets[c], D, nks[c], v_pairs);
    key_paired[c] = k_pairs, value_paired[c] = v_pairs;
    ++slot;
  }
  query_pairs(q, q_s0, q_s1, first_row, kvh, G, rows, D, q_pairs);
  // The keys row r sees: [lo, hi]; whether any of rows r0..r0 + nr sees one of [j0, j1).
  const auto last_key_of = [&](int64_t r) { return first_query_pos + r / G; };
  const auto first_key_of = [&](int64_t r) { return first_visible_key(last_key_of(r), window); };
  const auto any_visible = [&](int64_t r0, int64_t nr, int64_t j0, int64_t j1) {
    for (int64_t r = r0; r < r0 + nr; ++r)
      if (j0 <= last_key_of(r) && j1 > first_key_of(r)) return true;
    return false;
  };

  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    dispatch_rows<kRowBlock>(rows - r0, [&](auto nr_constant) {
      constexpr int64_t NR = decltype(nr_constant)::value;
      // The chunks some row of the block sees, in order.
      int64_t block_j0s[kMaxChunks], block_nks[kMaxChunks];
      const uint16_t* block_values[kMaxChunks];
      const uint32_t* block_paired[kMaxChunks];
      int64_t n = 0;
      for (int64_t c = 0; c < num_chunks; ++c) {
        if (!any_visible(r0, NR, j0s[c], j0s[c] + nks[c])) continue;
        // A decode fetches, a line per step of the score loop, the keys kPrefetchChunks chunks
        // ahead and this chunk's values (read after every chunk's scores).
        const char* k_ahead =
            key_aheads[c] < 0 ? nullptr : reinterpret_cast<const char*>(khead + key_aheads[c]);
        const char* v_ahead = reinterpret_cast<const char*>(value_direct[c]);
        float(*x)[kKeyChunk] = scores + n * NR;
        if (key_direct[c] != nullptr)
          chunk_scores_dot<NR, true>(q_pairs + r0 * D / 2, D, key_direct[c], BS, nullptr, k_ahead, v_ahead, scale, x);
        else
          chunk_scores_dot<NR, false>(q_pairs + r0 * D / 2, D, nullptr, BS, key_paired[c], k_ahead, v_ahead, scale, x);
        block_j0s[n] = j0s[c], block_nks[n] = nks[c];
        block_values[n] = value_direct[c], block_paired[n] = value_paired[c];
        ++n;
      }
      for (int64_t b = 0; b < NR; ++b)
        partition_softmax_row(scores[b], NR * kKeyChunk, n, block_j0s, block_nks, first_key_of(r0 + b),
                              last_key_of(r0 + b), softcap, row_max + r0 + b, row_sum + r0 + b,
                              p_pairs + b * n * kKeyChunk / 2);
      partition_values_dot<NR>(acc + r0 * D, D, n, block_values, block_paired, p_pairs, n * kKeyChunk / 2);
    });
  }
  finish_tile(acc, rows, D, partial, out, o_s0, o_s1, first_row, kvh, G);
}

// ---- attention over a bf16 cache on Intel's matrix unit (AMX): see attention_amx_mode ----
// attention_tile_dot's arithmetic on tiles, over one key partition (D a multiple of 32):
//   scores: C (rows x 16 keys) = Q (rows x 32 dimensions, bf16 pairs) . K (16 dimension pairs x
//     16 keys), summed over D in tiles of 32 dimensions, two key cells (C0, C1) per pass;
//   the softmax: partition_softmax_row on the stored scores (times the scale), as on the dot route;
//   values: C (rows x 16 dimensions) = P (rows x 16 key pairs, the rounded weights) . V (16 key
//     pairs x 16 dimensions), over the partition's cells two at a time (32 keys per
//     instruction), four C tiles covering 64 dimensions per pass over the cells.
// Keys sit in cells of 16 positions on the grid of absolute positions, paired (2 cells, 32 keys)
// from a multiple of 32: which keys one instruction sums depends on their positions alone, so a
// row's bits do not depend on the tile's first query, its rows, or how a prompt was chunked.
// Each cell is gathered once per tile into paired buffers (a B tile's layout; zero where no key
// is, so every product is finite). A tile's rows go in blocks of 16 (a decode: its G rows, the
// tile configured to that many, up to 16; a partial last block computes zero rows and drops them).
// Cells, chunks and rows no row of a block sees add exact zeros, as on the dot route.
template <int64_t kD, class Tiles>
void attention_tile_amx(const float* q, int64_t q_s0, int64_t q_s1, float* out, int64_t o_s0, int64_t o_s1,
                        const c10::BFloat16* khead_, const c10::BFloat16* vhead_, const int32_t* table, int64_t BS,
                        int64_t d_runtime, int64_t G, int64_t first_query_pos, int64_t num_queries, int64_t first_row,
                        int64_t kvh, float scale, int64_t window, float softcap, int64_t key_begin, int64_t key_end,
                        float* partial, std::vector<float>& work) {
  // (A partition's keys lie in at most kKeyPartition / 16 cells, and pairs of cells from a
  // multiple of 32 add at most one more on each side.)
  constexpr int64_t kTileRows = kAmxRows, kCellPair = 2 * kKeyChunk, kMaxCells = kKeyPartition / kKeyChunk + 2;
  const int64_t D = kD > 0 ? kD : d_runtime;
  const int64_t Dh = D / 2;
  const int64_t rows = num_queries * G;
  const int64_t tile_rows = std::min(rows, kTileRows);
  const int64_t padded_rows = (rows + tile_rows - 1) / tile_rows * tile_rows;
  const uint16_t* khead = reinterpret_cast<const uint16_t*>(khead_);
  const uint16_t* vhead = reinterpret_cast<const uint16_t*>(vhead_);

  // The visited keys (as for_each_key_chunk's), in cells from pair_start.
  const auto [first_key, last_key] = visited_keys(first_query_pos, num_queries, window, key_begin, key_end);
  const int64_t pair_start = first_key & ~(kCellPair - 1);
  const int64_t num_cells = last_key < first_key ? 0 : ((last_key - pair_start) / kCellPair + 1) * 2;
  TORCH_CHECK(num_cells <= kMaxCells, "attention: more key cells than a partition holds");

  // acc [rows, D], row_max, row_sum (as finish_tile takes them), then 32-bit words: the queries'
  // bf16 pairs [padded_rows, D / 2], the cells' keys [cells, D / 2, 16] and values [cells, 8, D]
  // (a pair of cells is one B tile's 16 rows), a row block's scores [cells, 16 rows, 16] and
  // weights [16 rows, cells, 8], and one C tile's worth of a partial block's values [16, D].
  const int64_t cell_words = Dh * kKeyChunk;  // = 8 * D
  work.resize(rows * D + 2 * rows + padded_rows * Dh + 2 * num_cells * cell_words + num_cells * kTileRows * kKeyChunk +
              kTileRows * num_cells * kKeyChunk / 2 + kTileRows * D);
  float* acc = work.data();
  float* row_max = acc + rows * D;
  float* row_sum = row_max + rows;
  uint32_t* q_pairs = reinterpret_cast<uint32_t*>(row_sum + rows);
  uint32_t* key_cells = q_pairs + padded_rows * Dh;
  uint32_t* value_cells = key_cells + num_cells * cell_words;
  float* scores = reinterpret_cast<float*>(value_cells + num_cells * cell_words);
  uint32_t* p_pairs = reinterpret_cast<uint32_t*>(scores + num_cells * kTileRows * kKeyChunk);
  float* block_values = reinterpret_cast<float*>(p_pairs + kTileRows * num_cells * kKeyChunk / 2);

  // Cells: zero where a cell is not whole, then each chunk's keys paired into place (a whole
  // cell's chunk in one go, as the dot route pairs it; blocks smaller than a cell key by key).
  int64_t cell_keys[kMaxCells];
  for (int64_t c = 0; c < num_cells; ++c) {
    const int64_t start = pair_start + c * kKeyChunk;
    cell_keys[c] = start < first_key ? 0 : std::clamp<int64_t>(last_key + 1 - start, 0, kKeyChunk);
    if (cell_keys[c] < kKeyChunk) {
      std::fill(key_cells + c * cell_words, key_cells + (c + 1) * cell_words, 0u);
      std::fill(value_cells + c * cell_words, value_cells + (c + 1) * cell_words, 0u);
    }
  }
  for_each_key_chunk(table, BS, D, first_query_pos, num_queries, window, key_begin, key_end, false,
                     [&](const KeyChunk& chunk) {
    const int64_t n_keys = chunk.j1 - chunk.j0, c = (chunk.j0 - pair_start) / kKeyChunk;
    const uint16_t* kb = khead + chunk.key_offset;  // row d at kb + d * BS
    const uint16_t* vb = vhead + chunk.value_offset;  // row t at vb + t * D
    if (n_keys == kKeyChunk && chunk.j0 % kKeyChunk == 0) {
      pair_key_chunk(kb, BS, D, kKeyChunk, key_cells + c * cell_words);
      pair_value_chunk(vb, D, kKeyChunk, value_cells + c * cell_words);
      return;
    }
    uint16_t* key_halves = reinterpret_cast<uint16_t*>(key_cells);
    uint16_t* value_halves = reinterpret_cast<uint16_t*>(value_cells);
    for (int64_t t = 0; t < n_keys; ++t) {
      const int64_t cell = (chunk.j0 + t - pair_start) / kKeyChunk, lane = (chunk.j0 + t - pair_start) % kKeyChunk;
      for (int64_t d = 0; d < D; ++d) {
        key_halves[((cell * Dh + d / 2) * kKeyChunk + lane) * 2 + d % 2] = kb[d * BS + t];
        value_halves[((cell * 8 + lane / 2) * D + d) * 2 + lane % 2] = vb[t * D + d];
      }
    }
  });
  query_pairs(q, q_s0, q_s1, first_row, kvh, G, rows, D, q_pairs);
  std::fill(q_pairs + rows * Dh, q_pairs + padded_rows * Dh, 0u);  // padding rows: zero
  const auto last_key_of = [&](int64_t r) { return first_query_pos + r / G; };
  const auto first_key_of = [&](int64_t r) { return first_visible_key(last_key_of(r), window); };

  Tiles tiles;
  tiles.configure(kvserve_amx::tile_config(static_cast<int>(tile_rows)));
  for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
    const int64_t nr = std::min(tile_rows, rows - r0);
    // The pairs of cells some row of the block sees (its keys [first_key_of(r0), last_key_of(r0
    // + nr - 1)] at most): their cells in order, as the softmax takes them.
    const int64_t block_lo = std::max(first_key_of(r0), first_key), block_hi = last_key_of(r0 + nr - 1);
    int64_t cells[kMaxCells], j0s[kMaxCells], nks[kMaxCells];
    int64_t n = 0;
    for (int64_t c = 0; c < num_cells; c += 2) {
      const int64_t start = pair_start + c * kKeyChunk;
      if (start > block_hi || start + kCellPair <= block_lo) continue;
      for (int64_t i = 0; i < 2; ++i) cells[n + i] = c + i, j0s[n + i] = start + i * kKeyChunk, nks[n + i] = cell_keys[c + i];
      n += 2;
    }
    const int64_t row_words = n * kKeyChunk / 2;  // a row's weights: n cells of 8 pairs
    for (int64_t k = 0; k < n; k += 2) {
      tiles.template zero<0>();
      tiles.template zero<1>();
      for (int64_t s = 0; s < Dh; s += 16) {
        tiles.template load<4>(q_pairs + r0 * Dh + s, Dh * 4);
        tiles.template load<6>(key_cells + cells[k] * cell_words + s * kKeyChunk, kKeyChunk * 4);
        tiles.template load<7>(key_cells + cells[k + 1] * cell_words + s * kKeyChunk, kKeyChunk * 4);
        tiles.template dot<0, 4, 6>();
        tiles.template dot<1, 4, 7>();
      }
      tiles.template store<0>(scores + k * tile_rows * kKeyChunk, kKeyChunk * 4);
      tiles.template store<1>(scores + (k + 1) * tile_rows * kKeyChunk, kKeyChunk * 4);
    }
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int64_t b = 0; b < nr; ++b) {
      for (int64_t c = 0; c < n; ++c) {
        float* x = scores + (c * tile_rows + b) * kKeyChunk;
        _mm512_storeu_ps(x, _mm512_mul_ps(_mm512_loadu_ps(x), scale16));
      }
      partition_softmax_row(scores + b * kKeyChunk, tile_rows * kKeyChunk, n, j0s, nks, first_key_of(r0 + b),
                            last_key_of(r0 + b), softcap, row_max + r0 + b, row_sum + r0 + b, p_pairs + b * row_words);
    }
    std::fill(p_pairs + nr * row_words, p_pairs + tile_rows * row_words, 0u);  // padding rows: no weight

    // Values, 64 dimensions (four C tiles; two where D leaves 32) per pass over the cells.
    const bool whole = nr == tile_rows;
    float* dst = whole ? acc + r0 * D : block_values;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const bool four = d0 + 64 <= D;
      tiles.template zero<0>();
      tiles.template zero<1>();
      if (four) {
        tiles.template zero<2>();
        tiles.template zero<3>();
      }
      for (int64_t k = 0; k < n; k += 2) {
        const uint32_t* vp = value_cells + cells[k] * cell_words + d0;  // + 8 D: the next cell's rows
        tiles.template load<4>(p_pairs + k * kKeyChunk / 2, row_words * 4);
        tiles.template load<6>(vp, D * 4);
        tiles.template load<7>(vp + 16, D * 4);
        tiles.template dot<0, 4, 6>();
        tiles.template dot<1, 4, 7>();
        if (four) {
          tiles.template load<5>(p_pairs + k * kKeyChunk / 2, row_words * 4);
          tiles.template load<6>(vp + 32, D * 4);
          tiles.template load<7>(vp + 48, D * 4);
          tiles.template dot<2, 5, 6>();
          tiles.template dot<3, 5, 7>();
        }
      }
      tiles.template store<0>(dst + d0, D * 4);
      tiles.template store<1>(dst + d0 + 16, D * 4);
      if (four) {
        tiles.template store<2>(dst + d0 + 32, D * 4);
        tiles.template store<3>(dst + d0 + 48, D * 4);
      }
    }
    if (!whole) std::copy(block_values, block_values + nr * D, acc + r0 * D);
  }
  tiles.release();
  finish_tile(acc, rows, D, partial, out, o_s0, o_s1, first_row, kvh, G);
}

// The attention tile program's self-test, as the GEMM's (amx_linear.cpp: that one passing says
// the instructions work, this one that this program's shapes, strides and layouts do): a few
// tiles on the tiles (the hardware's, or for the tests of this machinery the emulation again) in
// a forked child, each output against the emulation's within 1e-2. Keys, values and queries are
// in [-1, 1], so an output is a weighted mean of values in [-1, 1]: a wrong operand, layout or
// stride is off by tenths, and the bound leaves room for the hardware's own order of a tile's
// sums (and a softmax weight rounded to the neighbouring bf16 for it). Cases: a prefill tile of
// 48 rows (three blocks of 16) ending in a partial cell; a decode's 3 rows; 40 rows of a 20-head
// group (a partial block) over blocks of 4 keys with a window; a head of 256 dimensions.
std::string attention_tiles_disagreement(bool hardware) {
  struct Case {
    int64_t D, G, num_queries, first_query_pos, BS, window;
  };
  const Case cases[] = {{64, 3, 16, 20, 16, 0}, {64, 3, 1, 100, 16, 0}, {32, 20, 2, 37, 4, 9}, {256, 1, 1, 50, 16, 0}};
  constexpr size_t kCases = sizeof(cases) / sizeof(cases[0]);
  struct Data {
    std::vector<uint16_t> keys, values;
    std::vector<int32_t> table;
    std::vector<float> q, want, got;
  };
  std::vector<Data> data(kCases);
  std::vector<float> work;  // grown by the emulation's runs: the child's stay within its capacity
  uint32_t seed = 777;
  const auto next = [&]() {
    seed = seed * 1664525u + 1013904223u;
    return static_cast<float>((seed >> 9) & 0x3FFF) / 8192.f - 1.f;
  };
  const auto run = [&](const Case& c, Data& d, float* out, auto tiles) {
    attention_tile_amx<0, decltype(tiles)>(
        d.q.data(), c.G * c.D, c.D, out, c.G * c.D, c.D, reinterpret_cast<const c10::BFloat16*>(d.keys.data()),
        reinterpret_cast<const c10::BFloat16*>(d.values.data()), d.table.data(), c.BS, c.D, c.G, c.first_query_pos,
        c.num_queries, 0, 0, 1.f / std::sqrt(static_cast<float>(c.D)), c.window, 0.f,
        first_visible_key(c.first_query_pos, c.window), c.first_query_pos + c.num_queries, nullptr, work);
  };
  for (size_t i = 0; i < kCases; ++i) {
    const Case& c = cases[i];
    Data& d = data[i];
    const int64_t blocks = (c.first_query_pos + c.num_queries + c.BS - 1) / c.BS;
    d.keys.resize((blocks + 1) * c.BS * c.D);
    d.values.resize((blocks + 1) * c.BS * c.D);
    for (auto& v : d.keys) v = static_cast<uint16_t>(bf16_bits_rne(next()));
    for (auto& v : d.values) v = static_cast<uint16_t>(bf16_bits_rne(next()));
    for (int64_t b = 0; b < blocks; ++b) d.table.push_back(static_cast<int32_t>(blocks - b));  // not in order
    d.q.resize(c.num_queries * c.G * c.D);
    for (auto& v : d.q) v = next();
    d.want.resize(d.q.size());
    d.got.assign(d.q.size(), std::nanf(""));
    run(c, d, d.want.data(), kvserve_amx::EmulatedTiles{});
  }
  return forked_check([&] {
    bool agree = true;
    for (size_t i = 0; i < kCases; ++i) {
#ifdef KVSERVE_AMX_HW
      if (hardware) run(cases[i], data[i], data[i].got.data(), kvserve_amx::HardwareTiles{});
      else
#endif
        run(cases[i], data[i], data[i].got.data(), kvserve_amx::EmulatedTiles{});
      for (size_t j = 0; j < data[i].want.size(); ++j)
        if (!(std::fabs(data[i].got[j] - data[i].want[j]) <= 1e-2f)) agree = false;
    }
    return agree;
  });
}

// "" where the attention route may run on this machine's tiles (the GEMM's tiles run here and
// the attention program's self-test agrees), else why not; decided once per process.
const std::string& attention_tiles_refusal() {
  static const std::string why = amx_bf16_available() ? attention_tiles_disagreement(true) : amx_bf16_status();
  return why;
}
#endif

// Attention of a tile of one sequence's queries (all G query heads of one KV head) over the
// paged cache, flash-style: keys are visited in chunks of <= 16 within a block, widened to
// fp32 once; with keys stored [D, block_size] per block, each score row is a sum over d of
// q[d] times a contiguous 16-key vector (vector FMAs, no horizontal sums); the softmax is
// online (running max and sum per row). Decode is the one-query case. Only keys in
// [key_begin, key_end) are visited; with `partial` the unnormalised accumulators, row maxima
// and row sums ([rows, D], [rows], [rows]) go there for merge_partitions instead of `out`.
template <int64_t kD, typename cache_t>
void attention_tile(const float* q, int64_t q_s0, int64_t q_s1, float* out, int64_t o_s0, int64_t o_s1,
                    const cache_t* khead, const cache_t* vhead, const int32_t* table, int64_t BS,
                    int64_t d_runtime, int64_t G, int64_t first_query_pos, int64_t num_queries, int64_t first_row,
                    int64_t kvh, float scale, int64_t window, float softcap, int64_t key_begin, int64_t key_end,
                    float* partial, std::vector<float>& work) {
  const int64_t D = kD > 0 ? kD : d_runtime;
#ifdef KVSERVE_ATTENTION_BF16_DOT
  if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
    if (const int amx = attention_amx_mode(); amx != 0 && D % kAmxDepth == 0) {
#ifdef KVSERVE_AMX_HW
      if (amx == 1)
        return attention_tile_amx<kD, kvserve_amx::HardwareTiles>(
            q, q_s0, q_s1, out, o_s0, o_s1, khead, vhead, table, BS, d_runtime, G, first_query_pos, num_queries,
            first_row, kvh, scale, window, softcap, key_begin, key_end, partial, work);
#endif
      return attention_tile_amx<kD, kvserve_amx::EmulatedTiles>(
          q, q_s0, q_s1, out, o_s0, o_s1, khead, vhead, table, BS, d_runtime, G, first_query_pos, num_queries,
          first_row, kvh, scale, window, softcap, key_begin, key_end, partial, work);
    }
    if (g_attention_bf16_dot && D % kKeyChunk == 0) {
      return attention_tile_dot<kD>(q, q_s0, q_s1, out, o_s0, o_s1, khead, vhead, table, BS, d_runtime, G,
                                    first_query_pos, num_queries, first_row, kvh, scale, window, softcap, key_begin,
                                    key_end, partial, work);
    }
  }
#endif
  const int64_t rows = num_queries * G;
  work.resize(rows * D + 2 * rows + D * kKeyChunk + kKeyChunk * D);
  float* acc = work.data();  // [rows, D]
  float* row_max = acc + rows * D;
  float* row_sum = row_max + rows;
  float* kt = row_sum + rows;  // [D, 16] key chunk
  float* vc = kt + D * kKeyChunk;  // [16, D] value chunk
  std::fill(acc, acc + rows * D, 0.f);
  std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + rows, 0.f);

  const bool few_rows = rows <= kRowBlock;  // a decode's tile: one row block, read from the cache
  for_each_key_chunk(table, BS, D, first_query_pos, num_queries, window, key_begin, key_end, few_rows,
                     [&](const KeyChunk& chunk) {
    const int64_t j0 = chunk.j0, j1 = chunk.j1, n_keys = j1 - j0;
    const char* k_ahead = chunk.key_ahead < 0 ? nullptr : reinterpret_cast<const char*>(khead + chunk.key_ahead);
    const char* v_ahead = chunk.value_ahead < 0 ? nullptr : reinterpret_cast<const char*>(vhead + chunk.value_ahead);
    const cache_t* kb = khead + chunk.key_offset;  // row d of the chunk: kb + d * BS
    const cache_t* vb = vhead + chunk.value_offset;  // row t of the chunk: vb + t * D
    // The score and value loops read keys/values through K (row d at K + d * k_stride) and V
    // (row t at V + t * D). A decode's few rows read a full chunk straight from the cache,
    // widening as they go; more rows (prefill), or a partial chunk, first copy it to fp32
    // (zero-padded), widened once for all row blocks.
    // NR (<= kRowBlock) score rows from r0 over the chunk: the key/value vectors loaded once
    // serve all of them, and their accumulators are independent FMA chains (one chain per row
    // would stall on latency). Each row's arithmetic is the same whatever NR (explicit FMAs, one
    // chain per row), so a decode's G rows need no padding row to make a block of 4 (SmolLM2:
    // G = 3, a quarter of the FMAs were padding).
    auto row_block = [&](const auto* K, int64_t k_stride, const auto* V, int64_t r0, auto nr_constant) {
      constexpr int64_t NR = decltype(nr_constant)::value;
      const float* qr[NR];
      int64_t lo[NR], hi[NR];
      bool any_visible = false;
      for (int64_t b = 0; b < NR; ++b) {
        const int64_t qi = (r0 + b) / G, g = (r0 + b) % G;
        qr[b] = q + (first_row + qi) * q_s0 + (kvh * G + g) * q_s1;
        hi[b] = first_query_pos + qi;  // the query's own position: its last visible key
        lo[b] = window > 0 ? hi[b] - window + 1 : 0;
        any_visible |= j0 <= hi[b] && j1 > lo[b];
      }
      if (!any_visible) return;

      Vec16 sc[NR], sc_odd[NR];  // a second partial sum over d: two chains per row
      for (int64_t b = 0; b < NR; ++b) sc[b] = sc_odd[b] = Vec16{};
#if !defined(__AVX512F__)
      // With 16 ymm registers (a Vec16 is two) the second chains spilled: one chain per row
      // over d, d + 1 (here, in every block shape alike). sc_odd stays zero.
      constexpr bool kOneChain = true;
#else
      constexpr bool kOneChain = false;
#endif
      for (int64_t d = 0; d < D; d += 2) {
        // One line of the chunk ahead's keys (rows d and d + 1) and one of its values per step
        // (D / 2 steps, D / 2 lines of values): spread this way the fetches overlap the FMAs;
        // a block's 64 prefetches issued at once measured no faster than none. ~20 % off a
        // decode's attention from memory, 1 or 2 threads.
        if (k_ahead != nullptr) {
          __builtin_prefetch(k_ahead + d * BS * static_cast<int64_t>(sizeof(cache_t)), 0, 2);
          __builtin_prefetch(k_ahead + (d + 1) * BS * static_cast<int64_t>(sizeof(cache_t)), 0, 2);
          constexpr int64_t kValueBytesPerStep = 2 * kKeyChunk * sizeof(cache_t);  // of D / 2 steps
          for (int64_t off = 0; off < kValueBytesPerStep; off += 64)
            __builtin_prefetch(v_ahead + d / 2 * kValueBytesPerStep + off, 0, 2);
        }
        const Vec16 k0 = widen16(K + d * k_stride), k1 = widen16(K + (d + 1) * k_stride);
        for (int64_t b = 0; b < NR; ++b) {
          sc[b] = fma16(qr[b][d], k0, sc[b]);
          if constexpr (kOneChain) sc[b] = fma16(qr[b][d + 1], k1, sc[b]);
          else sc_odd[b] = fma16(qr[b][d + 1], k1, sc_odd[b]);
        }
      }
      float p[NR][kKeyChunk];
      float correction[NR];
      float x[NR][kKeyChunk];
      for (int64_t b = 0; b < NR; ++b) store_vec16(x[b], (sc[b] + sc_odd[b]) * scale);
      softmax_rows(x, NR, j0, n_keys, lo, hi, softcap, row_max + r0, row_sum + r0, p, correction);

      // acc[r] = acc[r] * correction + sum_t p[r][t] v[t], 16 columns of d at a time, two
      // chains per row (even and odd keys). Masked keys have p = 0 and zeroed value rows.
      for (int64_t d0 = 0; d0 < D; d0 += kKeyChunk) {
        // The weights p are read from memory here, one broadcast operand per FMA: left to
        // itself GCC hoists all NR x 16 broadcasts out of this loop and spills them, two 64-byte
        // loads per FMA (measured: prefill attention 35 % slower).
        asm("" : "+m"(p));
        Vec16 even[NR], odd[NR];
        for (int64_t b = 0; b < NR; ++b) {
          even[b] = load_vec16(acc + (r0 + b) * D + d0) * correction[b];
          odd[b] = Vec16{};
        }
        for (int64_t t = 0; t < kKeyChunk; t += 2) {
          const Vec16 v0 = widen16(V + t * D + d0), v1 = widen16(V + (t + 1) * D + d0);
          for (int64_t b = 0; b < NR; ++b) {
            even[b] = fma16(p[b][t], v0, even[b]);
            if constexpr (kOneChain) even[b] = fma16(p[b][t + 1], v1, even[b]);  // (as the scores)
            else odd[b] = fma16(p[b][t + 1], v1, odd[b]);
          }
        }
        for (int64_t b = 0; b < NR; ++b) store_vec16(acc + (r0 + b) * D + d0, even[b] + odd[b]);
      }
    };
    auto rows_over_chunk = [&](const auto* K, int64_t k_stride, const auto* V) {
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        dispatch_rows<kRowBlock>(rows - r0, [&](auto nr) { row_block(K, k_stride, V, r0, nr); });
      }
    };
    if (n_keys == kKeyChunk && few_rows) {
      rows_over_chunk(kb, BS, vb);
    } else {
      if (n_keys == kKeyChunk) {  // (the masked loops below compile to scalar code)
        for (int64_t d = 0; d < D; ++d) store_vec16(kt + d * kKeyChunk, widen16(kb + d * BS));
        for (int64_t i = 0; i < kKeyChunk * D; i += kKeyChunk) store_vec16(vc + i, widen16(vb + i));
      } else {
        for (int64_t d = 0; d < D; ++d) {
#pragma omp simd
          for (int64_t t = 0; t < kKeyChunk; ++t) kt[d * kKeyChunk + t] = t < n_keys ? to_float(kb[d * BS + t]) : 0.f;
        }
        for (int64_t t = 0; t < kKeyChunk; ++t) {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) vc[t * D + d] = t < n_keys ? to_float(vb[t * D + d]) : 0.f;
        }
      }
      rows_over_chunk(static_cast<const float*>(kt), kKeyChunk, static_cast<const float*>(vc));
    }
  });
  finish_tile(acc, rows, D, partial, out, o_s0, o_s1, first_row, kvh, G);
}

// ---- int8 caches: integer products -------------------------------------------------------
// Attention over an int8 cache takes its query rows as int16 (one fp32 scale per row, made once
// per step) and, per row, key partition and group of dims, its softmax weights times the tokens'
// value scales as int16 (one scale); vpdpwssd then multiplies 32 int16 pairs with int8 values
// widened in one instruction, summing exactly in int32 (so in any order). The per-token key
// scale, the query scale and the weight scale are applied to the sums in fp32. Nothing is dequantized; int16 keeps the
// queries and weights to 1/65534 of their range, far inside int8's rounding of K and V.

// x[0..n) as int16 with one scale s = max|x| / 32767: out[i] = round(x[i] / s); returns s.
inline float quantize_int16(const float* x, int64_t n, int16_t* out) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax / 32767.f;
  const float inv = s > 0.f ? 1.f / s : 0.f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<int16_t>(std::nearbyint(std::min(std::max(x[i] * inv, -32767.f), 32767.f)));
  return s;
}

// Tests force the portable loops (machines without AVX512-VNNI or AVX2) to compare them with the
// vector paths: integer sums, so the two agree bit for bit.
std::atomic<bool> g_portable_int8_attention{false};

inline int32_t int16_pair(const int16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return pair;
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// acc + each lane's int16 pair times the pair at `pair` (two int16, broadcast), as one
// instruction with an embedded broadcast: from _mm512_set1_epi32, GCC broadcast every pair into
// a register of its own first, one more instruction per product.
// (The pair is read through a may_alias type: the int16 stores that wrote it must stay before.)
using aliased_int32 = int32_t __attribute__((may_alias));
__attribute__((always_inline)) inline __m512i dpwssd_pair(__m512i acc, __m512i lanes, const int16_t* pair) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(lanes), "m"(*reinterpret_cast<const aliased_int32*>(pair)));
  return acc;
}
#endif

#if !(defined(__AVX512BW__) && defined(__AVX512VNNI__)) && defined(__AVX2__)
// The AVX2 int8 products: 16 int32 sums per row of a row block, as two ymm halves. add() takes
// 32 int8 (16 pairs: the pairs of 16 keys, or 16 dims of a pair of tokens) times each row's
// int16 pair; vpmaddwd sums each pair exactly as vpdpwssd does (no pair reaches 2 * 32768 * 128).
struct PairSums16 {
  __m256i lo[kRowBlock], hi[kRowBlock];

  PairSums16() {
    for (int64_t b = 0; b < kRowBlock; ++b) lo[b] = hi[b] = _mm256_setzero_si256();
  }
  __attribute__((always_inline)) void add(const int8_t* src, const int32_t (&row_pairs)[kRowBlock]) {
    const __m256i v_lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m256i v_hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
    for (int64_t b = 0; b < kRowBlock; ++b) {
      const __m256i pair = _mm256_set1_epi32(row_pairs[b]);
      lo[b] = _mm256_add_epi32(lo[b], _mm256_madd_epi16(v_lo, pair));
      hi[b] = _mm256_add_epi32(hi[b], _mm256_madd_epi16(v_hi, pair));
    }
  }
  // Row b's 16 sums to out + b * stride.
  void store(int32_t* out, int64_t stride) const {
    for (int64_t b = 0; b < kRowBlock; ++b) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * stride), lo[b]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * stride + 8), hi[b]);
    }
  }
};
#endif

// isum[b][t] = sum_d q16[b][d] * key(d, offset + t) of one block's keys ([D/2][BS][2]), for
// t < n_keys; 0 beyond. With k_ahead (a decode), the same dims of a chunk ahead are fetched into
// L2 a line per step; with v_ahead, a line of the values at v_ahead every other step: the
// fetches ride along with the products, as in attention_tile.
inline void int8_chunk_scores(const int16_t* const* q16, const int8_t* kblock, int64_t BS, int64_t offset,
                              int64_t n_keys, int64_t D, int32_t (*isum)[kKeyChunk], const int8_t* k_ahead = nullptr,
                              const int8_t* v_ahead = nullptr) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (!g_portable_int8_attention.load(std::memory_order_relaxed)) {
    const __mmask32 mask = n_keys >= kKeyChunk ? 0xFFFFFFFFu : (1u << (2 * n_keys)) - 1u;
    // Two chains per row (even and odd pairs of dims): with one, the rows' 4 chains waited on
    // vpdpwssd's latency. Integer sums, so the same in any order. The eight chains are named:
    // as arrays GCC kept them in memory, a store after every product (2x the scores' time).
    static_assert(kRowBlock == 4, "int8_chunk_scores names four rows' chains");
    __m512i e0 = _mm512_setzero_si512(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
    const int16_t *q0 = q16[0], *q1 = q16[1], *q2 = q16[2], *q3 = q16[3];
    const int8_t* src = kblock + offset * 2;
    for (int64_t dp = 0; dp < D / 2; dp += 2, src += 4 * BS) {  // (D a multiple of 16)
      if (k_ahead != nullptr) {
        __builtin_prefetch(k_ahead + dp * 2 * BS, 0, 2);
        __builtin_prefetch(k_ahead + (dp + 1) * 2 * BS, 0, 2);
      }
      if (v_ahead != nullptr) __builtin_prefetch(v_ahead + dp / 2 * 64, 0, 2);
      const __m512i k0 = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, src));
      const __m512i k1 = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, src + 2 * BS));
      e0 = dpwssd_pair(e0, k0, q0 + 2 * dp);
      o0 = dpwssd_pair(o0, k1, q0 + 2 * dp + 2);
      e1 = dpwssd_pair(e1, k0, q1 + 2 * dp);
      o1 = dpwssd_pair(o1, k1, q1 + 2 * dp + 2);
      e2 = dpwssd_pair(e2, k0, q2 + 2 * dp);
      o2 = dpwssd_pair(o2, k1, q2 + 2 * dp + 2);
      e3 = dpwssd_pair(e3, k0, q3 + 2 * dp);
      o3 = dpwssd_pair(o3, k1, q3 + 2 * dp + 2);
    }
    _mm512_storeu_si512(isum[0], _mm512_add_epi32(e0, o0));
    _mm512_storeu_si512(isum[1], _mm512_add_epi32(e1, o1));
    _mm512_storeu_si512(isum[2], _mm512_add_epi32(e2, o2));
    _mm512_storeu_si512(isum[3], _mm512_add_epi32(e3, o3));
    return;
  }
#elif defined(__AVX2__)
  if (!g_portable_int8_attention.load(std::memory_order_relaxed)) {
    PairSums16 sums;
    const int8_t* src = kblock + offset * 2;
    alignas(32) int8_t tail[2 * kKeyChunk] = {};  // a short chunk's keys, zeros beyond: no read past the block
    for (int64_t dp = 0; dp < D / 2; ++dp, src += 2 * BS) {
      if (k_ahead != nullptr) __builtin_prefetch(k_ahead + dp * 2 * BS, 0, 2);
      if (v_ahead != nullptr && dp % 2 == 0) __builtin_prefetch(v_ahead + dp / 2 * 64, 0, 2);
      const int8_t* keys = src;
      if (n_keys < kKeyChunk) {
        std::memcpy(tail, src, 2 * n_keys);
        keys = tail;
      }
      int32_t pairs[kRowBlock];
      for (int64_t b = 0; b < kRowBlock; ++b) pairs[b] = int16_pair(q16[b] + 2 * dp);
      sums.add(keys, pairs);
    }
    sums.store(isum[0], kKeyChunk);
    return;
  }
#endif
  for (int64_t b = 0; b < kRowBlock; ++b) {
    for (int64_t t = 0; t < kKeyChunk; ++t) {
      int32_t sum = 0;
      for (int64_t d = 0; t < n_keys && d < D; ++d)
        sum += int32_t{q16[b][d]} * int32_t{kblock[int8_key_index(d, offset + t, BS)]};
      isum[b][t] = sum;
    }
  }
}

// products[b * D + d] (b < kRowBlock, d in [d_begin, d_end)) = the sum over a key partition's
// chunks c < num_chunks of sum_t w16[b * w_stride + c * 16 + t] * value(t, d), where chunk c's
// 2 * num_pairs[c] tokens start at the pair row vchunks[c] of their block's values ([BS/2][D][2]).
// The sums stay in integer registers across the partition: it holds at most 128 tokens, and
// 128 * 32767 * 127 < 2^31.
inline void int8_partition_values(const int16_t* w16, int64_t w_stride, int64_t num_chunks,
                                  const int8_t* const* vchunks, const int64_t* num_pairs, int64_t D, int64_t d_begin,
                                  int64_t d_end, int32_t* products) {
  static_assert(kKeyPartition * 32767LL * 127 < (1LL << 31), "a partition's int8 value sums must fit in int32");
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (!g_portable_int8_attention.load(std::memory_order_relaxed)) {
    for (int64_t d0 = d_begin; d0 < d_end; d0 += kKeyChunk) {
      // Two chains per row (even and odd pairs of tokens).
      __m512i even[kRowBlock], odd[kRowBlock];
      for (int64_t b = 0; b < kRowBlock; ++b) even[b] = odd[b] = _mm512_setzero_si512();
      for (int64_t c = 0; c < num_chunks; ++c) {
        const int8_t* src = vchunks[c] + d0 * 2;
        const int16_t* wc = w16 + c * kKeyChunk;
        int64_t j = 0;
        for (; j + 1 < num_pairs[c]; j += 2, src += 4 * D) {
          const __m512i v0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
          const __m512i v1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * D)));
          for (int64_t b = 0; b < kRowBlock; ++b) {
            even[b] = dpwssd_pair(even[b], v0, wc + b * w_stride + 2 * j);
            odd[b] = dpwssd_pair(odd[b], v1, wc + b * w_stride + 2 * j + 2);
          }
        }
        if (j < num_pairs[c]) {
          const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
          for (int64_t b = 0; b < kRowBlock; ++b)
            even[b] = dpwssd_pair(even[b], v, wc + b * w_stride + 2 * j);
        }
      }
      for (int64_t b = 0; b < kRowBlock; ++b)
        _mm512_storeu_si512(products + b * D + d0, _mm512_add_epi32(even[b], odd[b]));
    }
    return;
  }
#elif defined(__AVX2__)
  if (!g_portable_int8_attention.load(std::memory_order_relaxed)) {
    for (int64_t d0 = d_begin; d0 < d_end; d0 += kKeyChunk) {
      PairSums16 sums;
      for (int64_t c = 0; c < num_chunks; ++c) {
        const int8_t* src = vchunks[c] + d0 * 2;
        for (int64_t j = 0; j < num_pairs[c]; ++j, src += 2 * D) {
          int32_t pairs[kRowBlock];
          for (int64_t b = 0; b < kRowBlock; ++b) pairs[b] = int16_pair(w16 + b * w_stride + c * kKeyChunk + 2 * j);
          sums.add(src, pairs);
        }
      }
      sums.store(products + d0, D);
    }
    return;
  }
#endif
  for (int64_t b = 0; b < kRowBlock; ++b) {
    for (int64_t d = d_begin; d < d_end; ++d) {
      int32_t sum = 0;
      for (int64_t c = 0; c < num_chunks; ++c)
        for (int64_t t = 0; t < 2 * num_pairs[c]; ++t)
          sum += int32_t{w16[b * w_stride + c * kKeyChunk + t]} * int32_t{vchunks[c][int8_value_index(t, d, D)]};
      products[b * D + d] = sum;
    }
  }
}

// attention_tile for an int8 cache (its heads' scales beside it, [groups, BS] per block), over
// one key partition: the same chunks, partitions and masks, with the integer products above, in
// the cache's rotated basis (queries rotated by the caller; paged_attention rotates the outputs
// back). Rows go in blocks of kRowBlock, as on the bf16-dot route: a block scores every chunk some row
// of it sees, then each row's softmax runs over the whole partition (partition_softmax_f32), then
// the block's values. Per row and group of dims, the weights times the tokens' value scales are
// rounded to int16 with one scale over the partition, and their products with the values are
// summed in integers across it (int8_partition_values): no rescaling of the sums per chunk.
// The queries come rotated and rounded once per step (rotated_int16_queries): query row t, head
// h at q16 + (t * H + h) * D, its scale at q_scale[t * H + h].
template <int64_t kD>
void attention_tile_int8(const int16_t* q16, const float* q_scale, int64_t H, float* out, int64_t o_s0, int64_t o_s1,
                         const int8_t* khead, const int8_t* vhead, const c10::Half* kscales,
                         const c10::Half* vscales, const int32_t* table, int64_t BS, int64_t d_runtime, int64_t G,
                         int64_t first_query_pos, int64_t num_queries, int64_t first_row, int64_t kvh, float scale,
                         int64_t window, float softcap, int64_t key_begin, int64_t key_end, float* partial,
                         std::vector<float>& work) {
  constexpr int64_t kMaxGroups = 8;  // head dims up to 512
  const int64_t D = kD > 0 ? kD : d_runtime;
  const int64_t group = int8_group_size(D), groups = D / group;
  TORCH_CHECK(groups <= kMaxGroups, "int8 KV: head dim too large");
  const int64_t rows = num_queries * G;
  const bool few_rows = rows <= kRowBlock;  // a decode's tile: one row block

  // The partition's chunks, on the grid of 16 positions every route shares (for_each_key_chunk):
  // a key's chunk depends on its position alone, so a row's arithmetic is the same in a decode, a
  // prefill chunk or a recompute. The grid also starts value pairs (2j, 2j + 1) on even positions.
  constexpr int64_t kMaxChunks = kKeyPartition;
  int64_t j0s[kMaxChunks], nks[kMaxChunks], blocks[kMaxChunks], offsets[kMaxChunks];
  int64_t num_chunks = 0;
  for_each_key_chunk(table, BS, D, first_query_pos, num_queries, window, key_begin, key_end, false,
                     [&](const KeyChunk& chunk) {
    TORCH_CHECK(num_chunks < kMaxChunks, "attention: more key chunks than a partition holds");
    j0s[num_chunks] = chunk.j0, nks[num_chunks] = chunk.j1 - chunk.j0;
    blocks[num_chunks] = table[chunk.j0 / BS], offsets[num_chunks] = chunk.j0 % BS;
    ++num_chunks;
  });

  // acc [rows, D], row_max, row_sum (adjacent, as finish_tile takes them); per chunk and group the
  // score scale x key scales and the value scales [chunks, groups, 16]; a row block's scores
  // [chunks, kRowBlock, 16], weights [kRowBlock, chunks, 16] in fp32 and int16, one row's weights
  // times the value scales [chunks, 16], value sums [kRowBlock, D].
  const int64_t chunk_floats = num_chunks * kKeyChunk;
  work.resize(rows * D + 2 * rows + 2 * groups * chunk_floats + 2 * kRowBlock * chunk_floats +
              (kRowBlock * chunk_floats + 1) / 2 + chunk_floats + kRowBlock * D);
  float* acc = work.data();
  float* row_max = acc + rows * D;
  float* row_sum = row_max + rows;
  float* key_mul = row_sum + rows;  // chunk c, group g: + (c * groups + g) * 16
  float* value_mul = key_mul + groups * chunk_floats;
  float(*scores)[kKeyChunk] = reinterpret_cast<float(*)[kKeyChunk]>(value_mul + groups * chunk_floats);
  float* weights = value_mul + groups * chunk_floats + kRowBlock * chunk_floats;
  int16_t* w16 = reinterpret_cast<int16_t*>(weights + kRowBlock * chunk_floats);
  float* scaled = weights + kRowBlock * chunk_floats + (kRowBlock * chunk_floats + 1) / 2;
  int32_t* products = reinterpret_cast<int32_t*>(scaled + chunk_floats);
  // Row r (query r / G, head r % G of KV head kvh): its int16 query and scale.
  const auto query_of = [&](int64_t r) { return (first_row + r / G) * H + kvh * G + r % G; };

  if (!few_rows) {  // a prefill tile reads the partition once per row block: fetch it all now
    for (int64_t c = 0; c < num_chunks; ++c) {
      if (c > 0 && blocks[c] == blocks[c - 1]) continue;
      prefetch_bytes(khead + blocks[c] * BS * D, BS * D);
      prefetch_bytes(vhead + blocks[c] * BS * D, BS * D);
    }
  }
  for (int64_t c = 0; c < num_chunks; ++c) {
    for (int64_t g = 0; g < groups; ++g) {
      float* km = key_mul + (c * groups + g) * kKeyChunk;
      float* vm = value_mul + (c * groups + g) * kKeyChunk;
      if (nks[c] < kKeyChunk) {  // zero past the chunk's keys
        std::fill(km, km + kKeyChunk, 0.f);
        std::fill(vm, vm + kKeyChunk, 0.f);
      }
      half_to_float(kscales + (blocks[c] * groups + g) * BS + offsets[c], nks[c], km);
      half_to_float(vscales + (blocks[c] * groups + g) * BS + offsets[c], nks[c], vm);
#pragma omp simd
      for (int64_t t = 0; t < kKeyChunk; ++t) km[t] *= scale;
    }
  }
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int64_t nr = std::min(kRowBlock, rows - r0);
    const int16_t* qr[kRowBlock];
    int64_t lo[kRowBlock], hi[kRowBlock];
    for (int64_t b = 0; b < kRowBlock; ++b) {
      const int64_t r = r0 + std::min(b, nr - 1);  // padding rows repeat the last one, unused
      qr[b] = q16 + query_of(r) * D;
      hi[b] = first_query_pos + r / G;
      lo[b] = window > 0 ? hi[b] - window + 1 : 0;
    }
    // The scores of the chunks some row of the block sees, in order.
    int64_t block_chunks[kMaxChunks], block_j0s[kMaxChunks], block_nks[kMaxChunks];
    const int8_t* block_values[kMaxChunks];
    int64_t block_pairs[kMaxChunks];
    int64_t n = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
      bool any_visible = false;
      for (int64_t b = 0; b < nr; ++b) any_visible |= j0s[c] <= hi[b] && j0s[c] + nks[c] > lo[b];
      if (!any_visible) continue;
      const int8_t* kblock = khead + blocks[c] * BS * D;
      const int8_t* vchunk = vhead + blocks[c] * BS * D + offsets[c] / 2 * 2 * D;
      // A decode fetches, a line at a time in the score loop (int8_chunk_scores), the keys
      // kPrefetchChunks chunks ahead and this chunk's values (read after every chunk's scores).
      const int8_t* k_ahead = nullptr;
      if (few_rows && c + kPrefetchChunks < num_chunks)
        k_ahead = khead + blocks[c + kPrefetchChunks] * BS * D + offsets[c + kPrefetchChunks] * 2;
      float(*x)[kKeyChunk] = scores + n * kRowBlock;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t isum[kRowBlock][kKeyChunk];
        const int16_t* qg[kRowBlock];
        for (int64_t b = 0; b < kRowBlock; ++b) qg[b] = qr[b] + g * group;
        // Group g's share of the chunk ahead: its key dims, and group / 4 of the chunk's D / 4
        // lines of values.
        int8_chunk_scores(qg, kblock + g * group * BS, BS, offsets[c], nks[c], group, isum,
                          k_ahead != nullptr ? k_ahead + g * group * BS : nullptr,
                          few_rows ? vchunk + g * group * 16 : nullptr);
        const float* km = key_mul + (c * groups + g) * kKeyChunk;
        for (int64_t b = 0; b < nr; ++b) {
          if (g == 0) {
#pragma omp simd
            for (int64_t t = 0; t < kKeyChunk; ++t) x[b][t] = static_cast<float>(isum[b][t]) * km[t];
          } else {
#pragma omp simd
            for (int64_t t = 0; t < kKeyChunk; ++t) x[b][t] += static_cast<float>(isum[b][t]) * km[t];
          }
        }
      }
      for (int64_t b = 0; b < nr; ++b) {
#pragma omp simd
        for (int64_t t = 0; t < kKeyChunk; ++t) x[b][t] *= q_scale[query_of(r0 + b)];
      }
      block_chunks[n] = c, block_j0s[n] = j0s[c], block_nks[n] = nks[c];
      block_values[n] = vchunk, block_pairs[n] = (nks[c] + 1) / 2;
      ++n;
    }
    const int64_t row_floats = n * kKeyChunk;
    for (int64_t b = 0; b < nr; ++b)
      partition_softmax_f32(scores[b], kRowBlock * kKeyChunk, n, block_j0s, block_nks, lo[b], hi[b], softcap,
                            row_max + r0 + b, row_sum + r0 + b, weights + b * row_floats);
    std::fill(w16 + nr * row_floats, w16 + kRowBlock * row_floats, int16_t{0});  // padding rows: no weight
    for (int64_t g = 0; g < groups; ++g) {
      float w_scale[kRowBlock];
      for (int64_t b = 0; b < nr; ++b) {
        const float* wb = weights + b * row_floats;
        for (int64_t i = 0; i < n; ++i) {
          const float* vm = value_mul + (block_chunks[i] * groups + g) * kKeyChunk;
#pragma omp simd
          for (int64_t t = 0; t < kKeyChunk; ++t) scaled[i * kKeyChunk + t] = wb[i * kKeyChunk + t] * vm[t];
        }
        w_scale[b] = quantize_int16(scaled, row_floats, w16 + b * row_floats);
      }
      int8_partition_values(w16, row_floats, n, block_values, block_pairs, D, g * group, (g + 1) * group, products);
      for (int64_t b = 0; b < nr; ++b) {
        float* a = acc + (r0 + b) * D;
        const int32_t* prod = products + b * D;
#pragma omp simd
        for (int64_t d = g * group; d < (g + 1) * group; ++d) a[d] = static_cast<float>(prod[d]) * w_scale[b];
      }
    }
  }
  finish_tile(acc, rows, D, partial, out, o_s0, o_s1, first_row, kvh, G);
}

// Every query row [T, H, D] (fp32, rows and heads strided) rotated into an int8 cache's basis and
// rounded to int16 with one scale per row and head: q16 [T * H, D], q_scale [T * H].
void rotated_int16_queries(const torch::Tensor& q, int64_t D, std::vector<int16_t>& q16, std::vector<float>& q_scale) {
  const int64_t T = q.size(0), H = q.size(1);
  const float* data = q.data_ptr<float>();
  const int64_t s0 = q.stride(0), s1 = q.stride(1);
  q16.resize(T * H * D);
  q_scale.resize(T * H);
  kvserve::parallel_for(0, T * H, std::max<int64_t>(1, 2048 / std::max<int64_t>(D, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(D);
    for (int64_t i = begin; i < end; ++i) {
      const float* row = data + (i / H) * s0 + (i % H) * s1;
      std::copy(row, row + D, rotated.data());
      hadamard_(rotated.data(), D);
      q_scale[i] = quantize_int16(rotated.data(), D, q16.data() + i * D);
    }
  });
}

// Combine a tile's per-partition partials (each [rows, D] unnormalised accumulators, then
// [rows] maxima, then [rows] sums, as attention_tile leaves them) in partition order:
// rescale to the common maximum, sum, normalise, write the rows of `out`.
void merge_partitions(const float* const* parts, int64_t num_parts, int64_t rows, int64_t D, int64_t G, float* out,
                      int64_t o_s0, int64_t o_s1, int64_t first_row, int64_t kvh, std::vector<float>& work) {
  work.resize(D);
  float* acc = work.data();
  for (int64_t r = 0; r < rows; ++r) {
    float row_max = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_parts; ++p) row_max = std::max(row_max, parts[p][rows * D + r]);
    float row_sum = 0.f;
    std::fill(acc, acc + D, 0.f);
    for (int64_t p = 0; p < num_parts; ++p) {
      const float weight = exp_nonpositive(parts[p][rows * D + r] - row_max);  // ~0 where nothing was seen
      row_sum += parts[p][rows * D + rows + r] * weight;
      const float* a = parts[p] + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * weight;
    }
    store_normalized_row(out, o_s0, o_s1, first_row, kvh, G, r, acc, row_sum, D);
  }
}

template <int64_t kD, typename cache_t>
void attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kv_cache,
                    const c10::Half* scales, const torch::Tensor& block_tables, const torch::Tensor& seq_lens, const torch::Tensor& seq_ids,
                    const torch::Tensor& query_starts, const torch::Tensor& query_lens, double scale,
                    int64_t window, double softcap) {
  const int64_t H = q.size(1), D = kD > 0 ? kD : q.size(2);
  const int64_t KVH = kv_cache.size(1), NB = kv_cache.size(2), BS = kv_cache.size(3);
  const int64_t G = H / KVH;
  const int64_t scale_groups = std::is_same_v<cache_t, int8_t> ? D / int8_group_size(D) : 0;
  const int64_t table_width = block_tables.size(1);
  const cache_t* keys = kv_cache.data_ptr<cache_t>();
  const cache_t* values = keys + KVH * NB * BS * D;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* seqs = seq_ids.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* qlens = query_lens.data_ptr<int64_t>();

  // Keys are taken in partitions of kKeyPartition positions, each with its own softmax,
  // merged in partition order (merge_partitions): the arithmetic of a row depends
  // only on its position, whatever the batch and whichever thread ran which partition.
  // Work items: (sequence, query tile, kv head) or, for a decode (one query, whose tile is
  // cheap and may be alone in the step), one item per partition so that every thread can
  // share it; most expensive first (queries x keys seen), taken from a shared counter, so
  // one long prefill and many short decodes in the same step keep every thread busy.
  struct Item {
    int64_t seq_index, tile_start, kv_head, first_part, last_part, cost, partial_offset;
  };
  struct SplitTile {
    int64_t seq_index, tile_start, kv_head, first_item, num_parts;
  };
  auto key_range = [&](int64_t first_key, int64_t last_pos, int64_t part) {
    return std::make_pair(std::max(first_key, part * kKeyPartition), std::min(last_pos + 1, (part + 1) * kKeyPartition));
  };
  std::vector<Item> items;
  std::vector<SplitTile> split_tiles;
  int64_t partial_floats = 0;
  for (int64_t i = 0; i < seq_ids.size(0); ++i) {
    for (int64_t t0 = 0; t0 < qlens[i]; t0 += kQueryTile) {
      const int64_t nq = std::min(kQueryTile, qlens[i] - t0);
      const int64_t first_pos = lens[seqs[i]] - qlens[i] + t0, last_pos = first_pos + nq - 1;
      const int64_t first_key = first_visible_key(first_pos, window);
      const int64_t first_part = first_key / kKeyPartition, last_part = last_pos / kKeyPartition;
      const bool split = nq == 1 && last_part > first_part;
      for (int64_t kvh = 0; kvh < KVH; ++kvh) {
        if (!split) {
          items.push_back({i, t0, kvh, first_part, last_part, nq * (last_pos + 1 - first_key), -1});
          continue;
        }
        split_tiles.push_back({i, t0, kvh, static_cast<int64_t>(items.size()), last_part - first_part + 1});
        for (int64_t part = first_part; part <= last_part; ++part) {
          const auto [lo, hi] = key_range(first_key, last_pos, part);
          items.push_back({i, t0, kvh, part, part, hi - lo, partial_floats});
          partial_floats += G * (D + 2);
        }
      }
    }
  }
  std::vector<float> partials(partial_floats);
  std::vector<int64_t> order(items.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<int64_t>(k);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return items[a].cost > items[b].cost; });
  int64_t total_cost = 0;
  for (const auto& it : items) total_cost += it.cost;
  std::atomic<int64_t> next{0};
  const int64_t num_workers = total_cost * G < 1024 || items.size() < 2 ? 1 : at::get_num_threads();
  float* out_data = out.data_ptr<float>();
  // An int8 cache's tiles take the queries rotated into its basis and rounded to int16, made
  // here once for the step (a tile spanning several partitions, or a decode split over them,
  // would repeat the work for each).
  std::vector<int16_t> q16;
  std::vector<float> q_scale;
  if constexpr (std::is_same_v<cache_t, int8_t>) rotated_int16_queries(q, D, q16, q_scale);

  kvserve::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    std::vector<float> work, local_partials;
    std::vector<const float*> parts;
    for (int64_t k = next++; k < static_cast<int64_t>(items.size()); k = next++) {
      const Item& it = items[order[k]];
      const int64_t s = seqs[it.seq_index];
      const int64_t num_queries = std::min(kQueryTile, qlens[it.seq_index] - it.tile_start);
      const int64_t first_query_pos = lens[s] - qlens[it.seq_index] + it.tile_start;
      const int64_t first_row = starts[it.seq_index] + it.tile_start;
      const int64_t first_key = first_visible_key(first_query_pos, window);
      const int64_t last_pos = first_query_pos + num_queries - 1;
      auto run_part = [&](int64_t part, float* partial) {
        const auto [lo, hi] = key_range(first_key, last_pos, part);
        const cache_t* khead = keys + it.kv_head * NB * BS * D;
        const cache_t* vhead = values + it.kv_head * NB * BS * D;
        const int32_t* table = tables + s * table_width;
        if constexpr (std::is_same_v<cache_t, int8_t>) {
          attention_tile_int8<kD>(q16.data(), q_scale.data(), H, out_data, out.stride(0), out.stride(1),
                                  khead, vhead, scales + it.kv_head * NB * scale_groups * BS,
                                  scales + (KVH + it.kv_head) * NB * scale_groups * BS,
                                  table, BS, D, G, first_query_pos, num_queries, first_row, it.kv_head,
                                  static_cast<float>(scale), window, static_cast<float>(softcap), lo, hi, partial,
                                  work);
        } else {
          attention_tile<kD, cache_t>(q.data_ptr<float>(), q.stride(0), q.stride(1), out_data, out.stride(0),
                                      out.stride(1), khead, vhead, table, BS, D, G, first_query_pos, num_queries,
                                      first_row, it.kv_head, static_cast<float>(scale), window,
                                      static_cast<float>(softcap), lo, hi, partial, work);
        }
      };
      if (it.partial_offset >= 0) {  // one partition of a split decode: merged after the loop
        run_part(it.first_part, partials.data() + it.partial_offset);
      } else if (it.first_part == it.last_part) {  // a single partition: normalised in place
        run_part(it.first_part, nullptr);
      } else {  // the tile's partitions one after another, then merged
        const int64_t num_parts = it.last_part - it.first_part + 1, stride = num_queries * G * (D + 2);
        local_partials.resize(num_parts * stride);
        parts.resize(num_parts);
        for (int64_t p = 0; p < num_parts; ++p) {
          parts[p] = local_partials.data() + p * stride;
          run_part(it.first_part + p, local_partials.data() + p * stride);
        }
        merge_partitions(parts.data(), num_parts, num_queries * G, D, G, out_data, out.stride(0), out.stride(1),
                         first_row, it.kv_head, work);
      }
    }
  });

  kvserve::parallel_for(0, static_cast<int64_t>(split_tiles.size()), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    std::vector<const float*> parts;
    for (int64_t k = begin; k < end; ++k) {
      const SplitTile& tile = split_tiles[k];
      parts.resize(tile.num_parts);
      for (int64_t p = 0; p < tile.num_parts; ++p) parts[p] = partials.data() + items[tile.first_item + p].partial_offset;
      merge_partitions(parts.data(), tile.num_parts, G, D, G, out_data, out.stride(0), out.stride(1),
                       starts[tile.seq_index] + tile.tile_start, tile.kv_head, work);
    }
  });
}

}  // namespace

// Causal attention for every sequence of a step over the paged cache, which already holds the
// step's new keys: sequence seq_ids[i] has query_lens[i] queries (1 for decode) at rows
// query_starts[i].. of q [T, H, D], the last at position seq_lens[seq] - 1; the query at
// position p sees keys (p - window, p] (all of [0, p] without a window). Results go to the
// same rows of out.
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, c10::optional<torch::Tensor> kv_scales,
                     torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor seq_ids, torch::Tensor query_starts,
                     torch::Tensor query_lens, double scale, int64_t window, double softcap) {
  check_fp32_cpu(q, "q");
  check_fp32_cpu(out, "out");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1, "q/out must be [T, H, D], head_dim contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be a contiguous [2, KVH, NB, BS, D]");
  TORCH_CHECK(q.size(1) % kv_cache.size(1) == 0 && q.size(2) == kv_cache.size(4), "q heads do not match the cache");
  TORCH_CHECK(q.size(2) % kKeyChunk == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(), "seq_lens: int32");
  for (const auto* t : {&seq_ids, &query_starts, &query_lens})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous(), "seq_ids/query_starts/query_lens: int64");
  auto run_typed = [&](auto cache_type, const c10::Half* scales) {
    using cache_t = typename decltype(cache_type)::type;
    const int64_t head_dim = q.size(2);
    auto run = [&](auto head_dim_constant) {
      attention_impl<decltype(head_dim_constant)::value, cache_t>(out, q, kv_cache, scales, block_tables, seq_lens,
                                                                  seq_ids, query_starts, query_lens, scale, window,
                                                                  softcap);
    };
    if (head_dim == 64) run(std::integral_constant<int64_t, 64>{});
    else if (head_dim == 128) run(std::integral_constant<int64_t, 128>{});
    else if (head_dim == 256) run(std::integral_constant<int64_t, 256>{});
    else run(std::integral_constant<int64_t, 0>{});
  };
  if (kv_scales) {
    check_int8_cache(kv_cache, *kv_scales);
    run_typed(TypeTag<int8_t>{}, kv_scales->data_ptr<c10::Half>());
    // The int8 cache holds rotated heads, so the outputs came out rotated: H is its own inverse.
    const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
    float* out_data = out.data_ptr<float>();
    kvserve::parallel_for(0, T * H, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) hadamard_(out_data + (i / H) * out.stride(0) + (i % H) * out.stride(1), D);
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "paged_attention", [&] {
    run_typed(TypeTag<scalar_t>{}, nullptr);
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

// The values [S, k] and indices [S, k] a top-k of the rows of x [S, V] fills (x checked).
std::tuple<torch::Tensor, torch::Tensor> top_k_outputs(const torch::Tensor& x, int64_t k) {
  check_fp32_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [S, V] with contiguous rows");
  TORCH_CHECK(k >= 1 && k <= x.size(1), "k must be in [1, V]");
  return {torch::empty({x.size(0), k}, x.options()), torch::empty({x.size(0), k}, x.options().dtype(torch::kInt64))};
}

// The k largest entries of each row of x [S, V], sorted descending, ties to the lower index
// (so k = 1 is torch's argmax). One pass: a 16-wide compare against the current k-th value
// rejects almost every chunk; the few survivors are insertion-sorted into the k kept. torch's
// topk / argmax take 40-90 us on one 49 k-vocabulary row here, this ~10.
std::tuple<torch::Tensor, torch::Tensor> top_k_rows(torch::Tensor x, int64_t k) {
  auto [values, indices] = top_k_outputs(x, k);
  const int64_t S = x.size(0), V = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  kvserve::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const float* row = xp + s * x.stride(0);
      float* vals = vp + s * k;
      int64_t* ids = ip + s * k;
      int64_t count = 0;
      float threshold = kNegInf;
      for (int64_t j0 = 0; j0 < V; j0 += 16) {
        const int64_t n = std::min<int64_t>(16, V - j0);
        if (count == k) {
          int any = 0;
#pragma omp simd reduction(| : any)
          for (int64_t t = 0; t < n; ++t) any |= row[j0 + t] > threshold;
          if (!any) continue;
        }
        for (int64_t t = 0; t < n; ++t) {
          const float v = row[j0 + t];
          if (count == k && !(v > threshold)) continue;
          int64_t p = count < k ? count++ : k - 1;
          while (p > 0 && vals[p - 1] < v) {  // strict: an equal value keeps the lower index first
            vals[p] = vals[p - 1];
            ids[p] = ids[p - 1];
            --p;
          }
          vals[p] = v;
          ids[p] = j0 + t;
          if (count == k) threshold = vals[k - 1];
        }
      }
    }
  });
  return {values, indices};
}

// The LM head's logits for a step that reads only each row's argmax (kvserve.quant.
// RescoredLMHead), in one call: the 4-bit screen ranks the vocabulary into out [S, V], each
// row's k best (top_k_rows) get their fp32 logits against exact [V, K] (gathered_rows_dot: fp32,
// or its Q8_0 blocks with exact_scales), and every other entry becomes -inf. The same kernels, in
// the same order, as the head's torch calls; one call instead of six saved ~0.05 ms of a 3.5 ms
// single-stream SmolLM2 step, whose Python and dispatcher state the weight stream has evicted
// from the caches by then.
void screened_logits_out(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor exact,
                         c10::optional<torch::Tensor> exact_scales, int64_t k) {
  RECORD_FUNCTION("kvserve::screened_logits", std::vector<c10::IValue>());
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  q4_screen_linear_out(out, x, packed);
  const auto [values, indices] = top_k_rows(out, k);
  const torch::Tensor best = gathered_rows_dot(x, exact, indices, exact_scales);
  const int64_t S = out.size(0), V = out.size(1);
  float* o = out.data_ptr<float>();
  const int64_t* ids = indices.data_ptr<int64_t>();
  const float* logit = best.data_ptr<float>();
  for (int64_t s = 0; s < S; ++s) {
    std::fill(o + s * V, o + (s + 1) * V, -std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < k; ++j) o[s * V + ids[s * k + j]] = logit[s * k + j];
  }
}

// Each row's argmax of what screened_logits_out writes (top_k_rows with k = 1 over it), into
// tokens [S] int64, without writing the rows of -inf: `scratch` [S, V] takes the screen's
// ranking. A greedy step of Gemma 3 (262 k-token vocabulary) at 32 rows otherwise fills 33 MB
// with -inf and the sampler's argmax reads it back. top_k_rows(k = 1) starts at entry 0 and
// moves to each later entry greater than the one it holds; over a row of -inf but the
// candidates, that is this scan of the candidates in ascending token id (the same token for
// ties, NaNs and a row of all -inf).
void screened_argmax_out(torch::Tensor tokens, torch::Tensor scratch, torch::Tensor x, torch::Tensor packed,
                         torch::Tensor exact, c10::optional<torch::Tensor> exact_scales, int64_t k) {
  RECORD_FUNCTION("kvserve::screened_argmax", std::vector<c10::IValue>());
  TORCH_CHECK(scratch.is_contiguous(), "scratch must be contiguous");
  TORCH_CHECK(tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous() && tokens.numel() == scratch.size(0),
              "tokens must be a contiguous int64 [S]");
  q4_screen_linear_out(scratch, x, packed);
  const auto [values, indices] = top_k_rows(scratch, k);
  const torch::Tensor best = gathered_rows_dot(x, exact, indices, exact_scales);
  const int64_t S = scratch.size(0);
  const int64_t* ids = indices.data_ptr<int64_t>();
  const float* logit = best.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  std::vector<int64_t> order(k);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t* row_ids = ids + s * k;
    for (int64_t j = 0; j < k; ++j) order[j] = j;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row_ids[a] < row_ids[b]; });
    int64_t token = 0;
    float held = -std::numeric_limits<float>::infinity();  // entry 0's value unless it is a candidate
    for (const int64_t j : order) {
      const float v = logit[s * k + j];
      if (row_ids[j] == 0) {
        held = v;
      } else if (v > held) {
        held = v;
        token = row_ids[j];
      }
    }
    out[s] = token;
  }
}

// A float's bits as an unsigned key in the same order: -inf lowest, every NaN (either sign)
// highest, as torch's topk ranks them, and -0.0 the same key as +0.0 (equal values: the lower
// index first, as top_k_rows).
inline uint32_t order_key(uint32_t bits) {
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 0xFFFFFFFFu;
  if (magnitude == 0) bits = 0;
  return bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
}

// top_k_rows for many candidates (the CPU sampler's 1,024 for top-p): the same result (sorted
// descending, ties to the lower index) by selection instead of insertion. Per row: a threshold
// from a strided sample of the row (its largest entries, about twice the share of k that the
// sample stands for), one pass keeping the entries at or above it (a 16-wide compare rejects
// almost every chunk), and when they are at least k (almost always; they then hold the k
// largest) the k largest of those ranked (nth_element) and sorted. Otherwise a histogram of the
// keys' top 11 bits finds the bin of the k-th largest, and the entries above it and the bin's
// best make the k. torch's topk took ~230 us per 49 k-vocabulary row at k = 1,024.
std::tuple<torch::Tensor, torch::Tensor> top_k_rows_select(torch::Tensor x, int64_t k) {
  auto [values, indices] = top_k_outputs(x, k);
  const int64_t S = x.size(0), V = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  constexpr int kBinBits = 11, kBins = 1 << kBinBits, kCopies = 4;  // copies: increments of one bin in flight
  constexpr int64_t kSample = 4096;
  // An entry as one integer: its key above, its index inverted below, so that a larger entry
  // comes first and, of equal keys, the lower index.
  TORCH_CHECK(V < (int64_t{1} << 32), "rows of at most 2^32 - 1 entries");
  using Entry = uint64_t;
  const auto entry = [](uint32_t key, int64_t index) {
    return (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(index));
  };
  const auto index_of = [](Entry e) { return static_cast<int64_t>(~static_cast<uint32_t>(e)); };
  const auto before = std::greater<Entry>();
  kvserve::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> histogram, sample;
    std::vector<Entry> kept, tied;
    for (int64_t s = begin; s < end; ++s) {
      const float* row = xp + s * x.stride(0);
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
      // Entries with keys >= lowest: those of bins above `bin` to kept, those of `bin` to tied
      // (bin -1: every entry at or above lowest to kept).
      const auto collect = [&](uint32_t lowest, int64_t bin) {
        kept.clear();
        tied.clear();
        for (int64_t j0 = 0; j0 < V; j0 += 16) {
          const int64_t n = std::min<int64_t>(16, V - j0);
          int any = 0;
#pragma omp simd reduction(| : any)
          for (int64_t t = 0; t < n; ++t) any |= order_key(bits[j0 + t]) >= lowest;
          if (!any) continue;
          for (int64_t t = 0; t < n; ++t) {
            const uint32_t key = order_key(bits[j0 + t]);
            if (key < lowest) continue;
            if (bin >= 0 && (key >> (32 - kBinBits)) == static_cast<uint32_t>(bin)) tied.push_back(entry(key, j0 + t));
            else kept.push_back(entry(key, j0 + t));
          }
        }
      };
      bool done = false;
      if (V >= 4 * kSample) {
        const int64_t stride = V / kSample;
        sample.resize(kSample);
        for (int64_t i = 0; i < kSample; ++i) sample[i] = order_key(bits[i * stride]);
        const int64_t rank = std::min<int64_t>(kSample - 1, 2 * k / stride + 8);
        std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<uint32_t>());
        collect(sample[rank], -1);
        done = static_cast<int64_t>(kept.size()) >= k;
      }
      if (!done) {
        histogram.assign(kCopies * kBins, 0u);
        uint32_t* h = histogram.data();
        int64_t j = 0;
        for (; j + kCopies <= V; j += kCopies)
          for (int c = 0; c < kCopies; ++c) ++h[c * kBins + (order_key(bits[j + c]) >> (32 - kBinBits))];
        for (; j < V; ++j) ++h[order_key(bits[j]) >> (32 - kBinBits)];
        int64_t above = 0, bin = kBins - 1;  // the bin of the k-th largest: every entry above it is kept
        for (;; --bin) {
          int64_t count = 0;
          for (int c = 0; c < kCopies; ++c) count += histogram[c * kBins + bin];
          if (above + count >= k) break;
          above += count;
        }
        collect(static_cast<uint32_t>(bin) << (32 - kBinBits), bin);
        const auto wanted = tied.begin() + (k - above);
        std::nth_element(tied.begin(), wanted, tied.end(), before);
        kept.insert(kept.end(), tied.begin(), wanted);
      }
      std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), before);
      std::sort(kept.begin(), kept.begin() + k, before);
      for (int64_t i = 0; i < k; ++i) {
        ip[s * k + i] = index_of(kept[i]);
        vp[s * k + i] = row[index_of(kept[i])];
      }
    }
  });
  return {values, indices};
}

// Random sampling of rows of logits x [S, V] (kvserve.sampler on the CPU): row s's token t is
// drawn with probability proportional to exp((x[t] - max) * inv_temperature[s]) over the
// entries whose scaled logit is at least max + log_min_p[s] (min-p, relative to the top
// token; -inf keeps every finite entry), by inverting the cumulative distribution at
// uniforms[s] * total (one uniform per row, drawn from the request's generator by the caller).
// Three passes over the row: its max; the weights' sums per block of kSampleBlock tokens
// (double across blocks); the block holding the target, its weights again and a running sum.
// torch's route (the softmax, a uniform per token, their logs, a division and an argmax, each
// a fresh [S, V] tensor) took ~80 ms for 32 rows of Gemma 3's 262k vocabulary; this ~4 ms.
namespace {
constexpr int64_t kSampleBlock = 1024;

// The weights of row[j0, j0 + n): exp((x - m) * scale) where that is >= floor, else 0.
inline void sample_weights(const float* row, int64_t j0, int64_t n, float m, float scale, float floor,
                           float* w) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m), vs = _mm512_set1_ps(scale), vf = _mm512_set1_ps(floor);
  for (; j + 16 <= n; j += 16) {
    const __m512 z = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j0 + j), vm), vs);
    const __mmask16 keep = _mm512_cmp_ps_mask(z, vf, _CMP_GE_OQ);  // NaN fails (and -inf, floor being finite)
    _mm512_storeu_ps(w + j, _mm512_maskz_mov_ps(keep, exp_nonpositive16(_mm512_min_ps(z, _mm512_setzero_ps()))));
  }
#endif
  for (; j < n; ++j) {
    const float z = (row[j0 + j] - m) * scale;
    w[j] = z >= floor ? std::exp(std::min(z, 0.f)) : 0.f;
  }
}

// A row's largest value (a NaN never wins).
inline float row_max(const float* row, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < V; ++j) m = std::max(m, row[j]);
  return m;
}

// The first index of a row holding v (argmax's choice among equals); the last index if none does.
inline int64_t first_index_of(const float* row, int64_t V, float v) {
  int64_t j = 0;
  while (j + 1 < V && !(row[j] == v)) ++j;
  return j;
}
}  // namespace

torch::Tensor sample_rows(torch::Tensor x, torch::Tensor inv_temperature, torch::Tensor log_min_p,
                          torch::Tensor uniforms) {
  check_fp32_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [S, V] with contiguous rows");
  const int64_t S = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "x must have at least one column");
  check_fp32_cpu(inv_temperature, "inv_temperature");
  check_fp32_cpu(log_min_p, "log_min_p");
  TORCH_CHECK(inv_temperature.numel() == S && log_min_p.numel() == S && inv_temperature.is_contiguous() &&
                  log_min_p.is_contiguous(),
              "inv_temperature and log_min_p: one float per row");
  TORCH_CHECK(uniforms.scalar_type() == torch::kFloat64 && uniforms.numel() == S && uniforms.is_contiguous(),
              "uniforms: one float64 per row");
  auto tokens = torch::empty({S}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  const float* tp = inv_temperature.data_ptr<float>();
  const float* fp = log_min_p.data_ptr<float>();
  const double* up = uniforms.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t blocks = (V + kSampleBlock - 1) / kSampleBlock;
  kvserve::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> block_sums(blocks);
    std::vector<float> w(kSampleBlock);
    for (int64_t s = begin; s < end; ++s) {
      const float* row = xp + s * x.stride(0);
      const float m = row_max(row, V);
      if (!std::isfinite(m)) {  // nothing finite to weigh (or +inf): the first of the largest, as argmax
        out[s] = first_index_of(row, V, m);
        continue;
      }
      // Never below the lowest float, so that -inf logits (masked tokens) fail it even with
      // min-p off: the vector exp would give them its floor, ~1e-38, not 0.
      const float floor = std::max(fp[s], std::numeric_limits<float>::lowest());
      double total = 0.0;
      int64_t last_weighed = 0;  // the last block with a weight (the top token's, at least)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t j0 = b * kSampleBlock, n = std::min(kSampleBlock, V - j0);
        sample_weights(row, j0, n, m, tp[s], floor, w.data());
        double block = 0.0;
        for (int64_t j = 0; j < n; ++j) block += w[j];
        block_sums[b] = block;
        total += block;
        if (block > 0.0) last_weighed = b;
      }
      // The token whose interval of the cumulative weights holds the target; rounding that
      // leaves the target past the last interval takes the last token with a weight.
      if (!(total > 0.0)) {  // min-p past the top token: nothing weighed, take the top token
        out[s] = first_index_of(row, V, m);
        continue;
      }
      const double target = up[s] * total;
      double cumulative = 0.0;
      int64_t b = 0;
      while (b < last_weighed && !(cumulative + block_sums[b] > target)) cumulative += block_sums[b++];
      const int64_t j0 = b * kSampleBlock, n = std::min(kSampleBlock, V - j0);
      sample_weights(row, j0, n, m, tp[s], floor, w.data());
      int64_t token = -1;
      for (int64_t j = 0; j < n; ++j) {
        if (w[j] == 0.f) continue;
        token = j0 + j;
        cumulative += w[j];
        if (cumulative > target) break;
      }
      out[s] = token;
    }
  });
  return tokens;
}

// Top-p over whole rows of x [S, V] without a sort (the sampler's rows whose nucleus reaches
// past its candidates): the scaled logit z = (x - max) * inv_temperature of the last token the
// nucleus keeps, so that z >= that floor is the kept set (ties at the floor all kept). Sorted by
// z, a token is kept while the mass before it is under top_p of the row's. The weights exp(z)
// go into 4,096 bins of z between the row's least finite z and 0; the bins above the one where
// the mass crosses top_p are kept whole, and only that bin's tokens are sorted. -inf for rows
// with nothing finite. A full sort of a 262k-token row took ~10 ms; this ~1 ms.
torch::Tensor top_p_floor(torch::Tensor x, torch::Tensor inv_temperature, torch::Tensor top_p) {
  check_fp32_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [S, V] with contiguous rows");
  check_fp32_cpu(inv_temperature, "inv_temperature");
  check_fp32_cpu(top_p, "top_p");
  const int64_t S = x.size(0), V = x.size(1);
  TORCH_CHECK(inv_temperature.numel() == S && top_p.numel() == S && inv_temperature.is_contiguous() &&
                  top_p.is_contiguous(),
              "inv_temperature and top_p: one float per row");
  constexpr int64_t kBins = 4096;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  auto floors = torch::empty({S}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* tp = inv_temperature.data_ptr<float>();
  const float* pp = top_p.data_ptr<float>();
  float* out = floors.data_ptr<float>();
  kvserve::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> mass(kBins);
    // Every token's weight and bin, from the pass that builds the histogram, for the pass that
    // collects the crossing bin's tokens (which computed them afresh: a second exp per token).
    std::vector<float> w(V);
    std::vector<int16_t> bins(V);
    std::vector<std::pair<float, float>> boundary;  // (z, weight) of the crossing bin's tokens
    for (int64_t s = begin; s < end; ++s) {
      const float* row = xp + s * x.stride(0);
      const float m = row_max(row, V);
      float least = std::numeric_limits<float>::infinity();
#pragma omp simd reduction(min : least)
      for (int64_t j = 0; j < V; ++j) least = std::min(least, row[j] > kNegInf ? row[j] : least);
      if (!std::isfinite(m)) {
        out[s] = kNegInf;
        continue;
      }
      const float scale = tp[s], z_least = (least - m) * scale;
      if (!(z_least < 0.f)) {  // every finite logit the same: all kept
        out[s] = 0.f;
        continue;
      }
      const float per_bin = static_cast<float>(kBins) / -z_least;
      std::fill(mass.begin(), mass.end(), 0.0);
      double total = 0.0;
      for (int64_t j0 = 0; j0 < V; j0 += kSampleBlock) {
        const int64_t n = std::min(kSampleBlock, V - j0);
        sample_weights(row, j0, n, m, scale, std::numeric_limits<float>::lowest(), w.data() + j0);
        int16_t* block_bins = bins.data() + j0;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {  // (z - z_least) * per_bin within [0, kBins - 1]; NaN / -inf: 0, weight 0
          const float position = ((row[j0 + j] - m) * scale - z_least) * per_bin;
          block_bins[j] = static_cast<int16_t>(position >= static_cast<float>(kBins - 1) ? kBins - 1
                                               : position > 0.f ? static_cast<int32_t>(position) : 0);
        }
        for (int64_t j = j0; j < j0 + n; ++j) {
          if (w[j] == 0.f) continue;
          mass[bins[j]] += w[j];
          total += w[j];
        }
      }
      const double target = static_cast<double>(pp[s]) * total;
      double above = 0.0;
      int64_t b = kBins - 1;
      while (b > 0 && !(above + mass[b] >= target)) above += mass[b--];
      boundary.clear();
      for (int64_t j0 = 0; j0 < V; j0 += 32) {
        const int64_t n = std::min<int64_t>(32, V - j0);
        int any = 0;
#pragma omp simd reduction(| : any)
        for (int64_t j = 0; j < n; ++j) any |= bins[j0 + j] == b;
        if (!any) continue;
        for (int64_t j = j0; j < j0 + n; ++j)
          if (bins[j] == b && w[j] != 0.f) boundary.emplace_back((row[j] - m) * scale, w[j]);
      }
      std::sort(boundary.begin(), boundary.end(), [](const auto& a, const auto& c) { return a.first > c.first; });
      // Kept while the mass before it is under the target, and the first token always (top_p 0).
      float floor = boundary.empty() ? z_least : boundary.back().first;
      for (size_t i = 0; i < boundary.size(); ++i) {
        if (i > 0 && !(above < target)) break;
        floor = boundary[i].first;
        above += boundary[i].second;
      }
      out[s] = floor;
    }
  });
  return floors;
}

// log(sum(exp(x * inv_temperature))) of each row of x [S, V] (the top-p normaliser of the
// sampler's candidate route), one pass past the max and no [S, V] temporary; -inf or the
// non-finite max for rows with nothing finite.
torch::Tensor row_logsumexp(torch::Tensor x, torch::Tensor inv_temperature) {
  check_fp32_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [S, V] with contiguous rows");
  check_fp32_cpu(inv_temperature, "inv_temperature");
  const int64_t S = x.size(0), V = x.size(1);
  TORCH_CHECK(inv_temperature.numel() == S && inv_temperature.is_contiguous(), "inv_temperature: one float per row");
  auto out = torch::empty({S}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* tp = inv_temperature.data_ptr<float>();
  float* op = out.data_ptr<float>();
  kvserve::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kSampleBlock);
    for (int64_t s = begin; s < end; ++s) {
      const float* row = xp + s * x.stride(0);
      const float m = row_max(row, V);
      if (!std::isfinite(m)) {
        op[s] = m * tp[s];
        continue;
      }
      double total = 0.0;
      for (int64_t j0 = 0; j0 < V; j0 += kSampleBlock) {
        const int64_t n = std::min(kSampleBlock, V - j0);
        sample_weights(row, j0, n, m, tp[s], std::numeric_limits<float>::lowest(), w.data());  // (-inf: 0)
        for (int64_t j = 0; j < n; ++j) total += w[j];
      }
      op[s] = static_cast<float>(m * tp[s] + std::log(total));
    }
  });
  return out;
}

// Structured outputs: a copy of the logits x [S, V] where the constrained rows (rows[r] for
// row r of bitmask [R, W]) keep only the tokens their grammar allows: token t is allowed when
// bit t % 32 of int32 word t / 32 is set (llguidance's layout); tokens past 32 W are not.
// One pass writing each row once, a 32-token word per two 16-lane blends: ~0.2 ms for 32
// rows of a 49 k vocabulary, where numpy's unpack-to-bool plus select took ~1.1 ms.
torch::Tensor apply_token_bitmask(torch::Tensor x, torch::Tensor bitmask, torch::Tensor rows) {
  check_fp32_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [S, V] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(),
              "bitmask must be a contiguous [R, W] int32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.size(0) == bitmask.size(0),
              "rows must be [R] int64, one per bitmask row");
  const int64_t S = x.size(0), V = x.size(1), R = bitmask.size(0), W = bitmask.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t* rp = rows.data_ptr<int64_t>();
  std::vector<int64_t> mask_row(S, -1);  // each logits row's bitmask row (-1: unconstrained)
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(rp[r] >= 0 && rp[r] < S, "row index out of range");
    mask_row[rp[r]] = r;
  }
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t full_words = std::min<int64_t>(W, V / 32);
  for (int64_t s = 0; s < S; ++s) {
    const float* in = xp + s * V;
    float* dst = op + s * V;
    if (mask_row[s] < 0) {
      std::memcpy(dst, in, V * sizeof(float));
      continue;
    }
    const uint32_t* words = bp + mask_row[s] * W;
    int64_t w = 0;
#if defined(__AVX512F__)
    const __m512 neg = _mm512_set1_ps(kNegInf);
    for (; w < full_words; ++w) {
      const uint32_t bits = words[w];
      const float* src = in + 32 * w;
      _mm512_storeu_ps(dst + 32 * w, _mm512_mask_blend_ps(static_cast<__mmask16>(bits), neg, _mm512_loadu_ps(src)));
      _mm512_storeu_ps(dst + 32 * w + 16,
                       _mm512_mask_blend_ps(static_cast<__mmask16>(bits >> 16), neg, _mm512_loadu_ps(src + 16)));
    }
#endif
    for (int64_t t = 32 * w; t < V; ++t) {
      const bool allowed = t / 32 < W && ((words[t / 32] >> (t % 32)) & 1u);
      dst[t] = allowed ? in[t] : kNegInf;
    }
  }
  return out;
}

// Ask the kernel for transparent huge pages under a large tensor (call before first touch).
// Paged attention reads blocks scattered over the KV pool: with 4 KB pages nearly every
// block read is a TLB miss. Returns whether the advice was taken (Linux only).
bool advise_huge_pages(torch::Tensor t) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = 2 << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = start + t.numel() * t.element_size();
  const uintptr_t aligned_start = (start + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t aligned_end = end & ~(kHuge - 1);
  if (aligned_end <= aligned_start) return false;
  return madvise(reinterpret_cast<void*>(aligned_start), aligned_end - aligned_start, MADV_HUGEPAGE) == 0;
#else
  return false;
#endif
}

void register_fused_decoder(pybind11::module& m);  // decoder.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("advise_huge_pages", &advise_huge_pages);
  m.def("rms_norm", &rms_norm);
  m.def("rope_qk_", &rope_qk_);
  m.def("write_kv_cache", &write_kv_cache);
  m.def("paged_attention", &paged_attention);
  // The route attention over a bf16 cache takes (a head dimension that is not a multiple of 32
  // takes the vector route below the tiles: dot or widened).
  m.def("attention_kernel_route", []() -> std::string {
#ifdef KVSERVE_ATTENTION_BF16_DOT
    if (const int amx = attention_amx_mode()) return amx == 1 ? "amx" : "amx-emulated";
    return g_attention_bf16_dot ? "dot" : "widened";
#else
    attention_amx_mode();  // (raises where KVSERVE_ATTENTION_ROUTE=amx)
    return "widened";
#endif
  });
  // Tests only: a process that switches routes between steps computes rows two ways.
  m.def("set_attention_kernel_route", [](const std::string& route) {
    TORCH_CHECK(route == "dot" || route == "widened" || route == "amx" || route == "amx-emulated",
                "attention route must be dot, widened, amx or amx-emulated");
#ifdef KVSERVE_ATTENTION_BF16_DOT
    attention_amx_mode();  // resolved first, so that the choice below stays
    if (route == "amx" || route == "amx-emulated") {
      TORCH_CHECK(route == "amx-emulated" || attention_tiles_refusal().empty(), "the AMX tiles cannot run here: ",
                  attention_tiles_refusal());
      g_attention_amx.store(route == "amx" ? 1 : 2, std::memory_order_relaxed);
      return;
    }
    g_attention_amx.store(0, std::memory_order_relaxed);
    g_attention_bf16_dot = route == "dot";
#else
    TORCH_CHECK(route == "widened", "this build has only the widened attention route");
#endif
  });
  // Tests, on any Linux x86-64 machine with AVX512-BF16: the attention self-test's fork and
  // comparison with the child running the emulation (true: they agree, as they must).
  m.def("amx_attention_self_test_machinery", []() {
#ifdef KVSERVE_ATTENTION_BF16_DOT
    return attention_tiles_disagreement(false).empty();
#else
    return false;
#endif
  });
  m.def("set_portable_int8_attention", [](bool portable) { g_portable_int8_attention = portable; });
  m.def("act_and_mul", &act_and_mul);
  m.def("top_k_rows", &top_k_rows);
  m.def("top_k_rows_select", &top_k_rows_select);
  m.def("screened_logits_out", &screened_logits_out);
  m.def("screened_argmax_out", &screened_argmax_out);
  m.def("sample_rows", &sample_rows);
  m.def("row_logsumexp", &row_logsumexp);
  m.def("top_p_floor", &top_p_floor);
  m.def("apply_token_bitmask", &apply_token_bitmask);
  m.def("q4_linear", &q4_linear);
  m.def("q5_linear", &q5_linear);
  m.def("tiled_nibble_linear", &tiled_nibble_linear);
  m.def("q8_linear", &q8_linear);
  m.def("q8_linear_out", &q8_linear_out);
  m.def("q8_0_quantize", &q8_0_quantize);
  m.def("q8_0_reproduces", &q8_0_reproduces);
  kvserve::register_step_team(m);
  m.def("set_portable_quant_kernels", &set_portable_quant_kernels);
  m.def("quant_kernel_isa", &quant_kernel_isa);
  m.def("nibble_activation_format", &nibble_activation_format);
  m.def("q4_screen_linear", &q4_screen_linear);
  m.def("q4_screen_linear_out", &q4_screen_linear_out);
  m.def("q4_screen_pack", &q4_screen_pack);
  m.def("set_portable_screen_kernel", &set_portable_screen_kernel);
  m.def("bf16_linear", &bf16_linear);
  m.def("bf16_linear_out", &bf16_linear_out);
  m.def("pack_bf16_weight", &pack_bf16_weight);
  m.def("fp32_linear", &fp32_linear);
  m.def("gathered_rows_dot", &gathered_rows_dot, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("idx"),
        pybind11::arg("w_scales") = pybind11::none());
  m.def("set_portable_dense_kernels", &set_portable_dense_kernels);
  m.def("bf16_kernel_route", &bf16_kernel_route);
  m.def("w8a8_linear", &w8a8_linear, pybind11::arg("x"), pybind11::arg("wp"), pybind11::arg("affine"), pybind11::arg("n"),
        pybind11::arg("bias"), pybind11::arg("largest_codes") = pybind11::none());
  m.def("w8a8_linear_out", &w8a8_linear_out, pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("wp"),
        pybind11::arg("affine"), pybind11::arg("bias"), pybind11::arg("largest_codes") = pybind11::none());
  m.def("w8a8_activations", &w8a8_activations);
  m.def("w8a8_kernel_route", &w8a8_kernel_route);
  m.def("set_portable_w8a8_kernel", &set_portable_w8a8_kernel);
  m.def("set_bf16_kernel_route", &set_bf16_kernel_route);
  m.def("amx_bf16_available", &amx_bf16_available);
  m.def("amx_bf16_status", &amx_bf16_status);
  m.def("amx_self_test_machinery", &amx_self_test_machinery);
  register_fused_decoder(m);
}
