// Single-query and prefill paged attention over a float, bf16 or fp16 cache (the int8 cache's is
// attention_int8.cpp), and its routes for a bf16 cache: the widened vector route (the cache
// widened to fp32 for FMAs), the bf16-dot route (vdpbf16ps, AMD's Zen 4) and Intel's tiles (AMX).
//
// Reductions run in fp32 with vectorised (reordered) sums (on the bf16-dot route: products of
// bf16 pairs, see attention_tile_dot); every row is computed the same way whatever the batch, so
// results do not depend on batch composition.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_ops.h"
#include "attention_common.h"
#include "bf16.h"
#include "amx_linear.h"
#include "amx_tiles.h"
#include "row_dispatch.h"
#include "avx2_reduce.h"

#if defined(__F16C__) || defined(__AVX512BW__) || defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {


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

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
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

// Attention over a bf16 cache on Intel's matrix unit (attention_tile_amx): 0 off (the vector
// routes), 1 the hardware's tiles, 2 their emulation (tests, any CPU with AVX512-BF16). Opt-in
// (set_attention_kernel_route("amx"), which the engine calls at start-up from its settings) until
// it has been measured on an AMX machine; like every route it is fixed until the setter is called
// again, so that a decode's row and a prompt's row take the same instructions. "amx" where the
// tiles cannot run raises in the setter.
std::atomic<int> g_attention_amx{0};
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
const std::string& attention_tiles_refusal();  // "" where the hardware's tiles may run it (below)
#endif

int attention_amx_mode() { return g_attention_amx.load(std::memory_order_relaxed); }

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define KVSERVE_ATTENTION_BF16_DOT 1
// Whether attention over a bf16 cache multiplies in bf16 pairs with vdpbf16ps (the queries and
// the softmax weights rounded to bf16, sums in fp32) rather than widening the cache to fp32 for
// FMAs: 32 products per instruction against 16 where vdpbf16ps runs at the FMA's rate (see
// bf16_dot_default; set_attention_kernel_route("dot" | "widened") overrides).
bool g_attention_bf16_dot = bf16_dot_default();

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
  if (kv_scales) {
    check_int8_cache(kv_cache, *kv_scales);
    paged_attention_int8(out, q, kv_cache, *kv_scales, block_tables, seq_lens, seq_ids, query_starts, query_lens,
                         scale, window, softcap);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "paged_attention", [&] {
    run_attention<scalar_t>(out, q, kv_cache, nullptr, block_tables, seq_lens, seq_ids, query_starts, query_lens,
                            scale, window, softcap);
  });
}

// The route attention over a bf16 cache takes (a head dimension that is not a multiple of 32
// takes the vector route below the tiles: dot or widened).
std::string attention_kernel_route() {
#ifdef KVSERVE_ATTENTION_BF16_DOT
  if (const int amx = attention_amx_mode()) return amx == 1 ? "amx" : "amx-emulated";
  return g_attention_bf16_dot ? "dot" : "widened";
#else
  return "widened";
#endif
}

// "auto": this CPU's default (no tiles; the bf16-dot route where bf16_dot_default says so), "dot",
// "widened", "amx" (raises where the tiles cannot run) or "amx-emulated" (tests). Every call then
// takes that route until the next set: a process that switches routes between steps computes rows
// two ways (the engine sets it once, at start-up; tests switch it and back).
void set_attention_kernel_route(const std::string& route) {
  TORCH_CHECK(route == "auto" || route == "dot" || route == "widened" || route == "amx" || route == "amx-emulated",
              "attention route must be auto, dot, widened, amx or amx-emulated");
#ifdef KVSERVE_ATTENTION_BF16_DOT
  if (route == "amx" || route == "amx-emulated") {
    TORCH_CHECK(route == "amx-emulated" || attention_tiles_refusal().empty(),
                "attention_route=amx, but the AMX tiles cannot run here: ", attention_tiles_refusal());
    g_attention_amx.store(route == "amx" ? 1 : 2, std::memory_order_relaxed);
    return;
  }
  g_attention_amx.store(0, std::memory_order_relaxed);
  g_attention_bf16_dot = route == "auto" ? bf16_dot_default() : route == "dot";
#else
  TORCH_CHECK(route != "amx", "attention_route=amx, but the AMX tiles cannot run here: ",
              amx_bf16_available() ? std::string("this build has no AVX512-BF16") : amx_bf16_status());
  TORCH_CHECK(route == "auto" || route == "widened", "this build has only the widened attention route");
#endif
}

// Tests, on any Linux x86-64 machine with AVX512-BF16: the attention self-test's fork and
// comparison with the child running the emulation (true: they agree, as they must).
bool amx_attention_self_test_machinery() {
#ifdef KVSERVE_ATTENTION_BF16_DOT
  return attention_tiles_disagreement(false).empty();
#else
  return false;
#endif
}
