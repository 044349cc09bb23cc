// Byte codes of the weights times int8 activations: int4 mode's prompt rows with int4_prefill
// "int8" (issue #17).
//
// A prompt of hundreds of tokens makes each linear layer compute-bound, where a 4-bit format's
// unpacking costs more than the bytes it saves: int4 mode computes prompt rows through copies of
// its weights (kvserve.quant.DecodeFormatLinear), bf16 by default. On a CPU with AVX512-VNNI,
// vpdpbusd adds 64 products of bytes per instruction where vdpbf16ps adds 32 of bf16 pairs, at
// the same instruction rate (measured on Zen 4: 937 against 468 G multiply-adds per second, 2
// cores), so byte copies compute faster, with less memory than bf16 ones.
//
// Numbers. The weights lose nothing: GGUF's block formats store each group of 32 weights as
// `w = a * u + b` with small unsigned integer codes u (Q4_1 and Q4_K: 0..15; Q5_0: 0..31 with
// b = -16a; Q8_0: q + 128 with b = -128a), and the copy keeps those codes as bytes with the
// group's a and b in fp32 (kvserve.quant.W8A8Linear). Rounding the weights to int8 against a
// scale of their own (an earlier version of this kernel) was most of the error: the mean |logit
// error| 0.15 against 0.07 with exact codes. The activations are rounded per row and group of 32
// inputs to int8, after each row's kOutliers largest magnitudes are taken out: LLMs'
// activations have a few channels tens of times the others (the residual stream's "massive"
// dimensions, in every row of the qkv and gate_up inputs), which would set their groups' steps.
// Those inputs stay exact fp32 and are multiplied by their exact weights.
//
// vpdpbusd multiplies unsigned bytes (the codes) by signed ones (the activations). Per output
// (s_x: the row's group scale; a, b: the column's group constants; q: the rounded activations):
//
//   acc_g = sum(u * q)                    over the group's 32 inputs, exact in int32
//   sum   = fma(float(acc_g), s_x * a, sum)
//   sum   = fma(b, s_x * float(sum(q)), sum)   over the groups in ascending order, from 0
//   sum   = fma(fma(float(u_k), a, b), x_k, sum)   for each outlier input k, in ascending k
//   y     = sum + bias                    (bias 0 when there is none)
//
// (With VNNI an outlier's u_k comes from vpdpbusd too: the codes times a one-hot word of 1.)
// Integer sums are exact in any order, and the fp32 steps are the same for every row whatever the
// tile: a row's result does not depend on how many rows share the call (batch invariant), and the
// portable loop gives the same bits as the vector kernels (AVX512-VNNI; AVX2, below, also where
// AVX512 comes without VNNI).
#include "w8a8_linear.h"
#include "avx2_reduce.h"
#include "step_team.h"
#include "linear_args.h"
#include "row_dispatch.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define KVSERVE_W8A8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSERVE_W8A8_AVX2 1
#endif

namespace {

constexpr int64_t kGroup = 32;  // inputs per group: the weights' a and b, the activations' scale
constexpr int64_t kPanel = 16;  // output columns per packed panel (one 16-lane vector)
constexpr int64_t kRowBlock = 96;  // activation rows kept in cache while a thread's panels pass over them
constexpr int64_t kSmallWork = 1 << 18;  // multiply-adds below which one thread does the whole call
constexpr float kSmallestGroup = 127.f / std::numeric_limits<float>::max();  // largest magnitude of a group read as zeros

constexpr int64_t kOutliers = 4;  // activation inputs per row kept exact (fewer when K is smaller)

bool g_portable = false;

// One call's activations, in the calling thread's scratch memory (valid until its next call).
struct Activations {
  const int8_t* q;  // [M][Kp], the outliers zeroed
  const float* scale;  // [M][G]
  const float* scaled_sum;  // [M][G]: scale * the group's sum of q (what the weights' b multiplies)
  const int32_t* outlier_index;  // [M][R], ascending
  const float* outlier_value;  // [M][R]: x at those inputs
  int64_t R;
};

// |x| with a NaN as the largest magnitude: a NaN input becomes an outlier (kept exact, so the
// outputs it reaches are NaN) rather than reaching the int8 rounding.
inline float magnitude(float x) {
  const float a = std::fabs(x);
  return a != a ? std::numeric_limits<float>::infinity() : a;
}

// The indices of row x's R <= kOutliers largest magnitudes (of equal ones, the lower index), in
// ascending order. R inputs in distinct lanes of 16 are R distinct inputs, so the R-th largest
// of the lanes' maxima bounds the row's R-th largest magnitude from below: a first pass takes
// the lanes' maxima, a second offers, in ascending order, only the few inputs at least that
// large to a scalar insertion. (Offering every input of each 16 that beat the R-th largest so
// far, as before, ran the insertion for a good part of a row's inputs and mispredicted its
// branches: the rounding of the activations was 11 % of an int8 prompt's time on Zen 4.)
void largest_magnitudes(const float* x, int64_t K, int64_t R, int32_t* index) {
  float best[kOutliers];  // descending; of equal magnitudes the earlier input first
  int32_t at[kOutliers];
  int64_t count = 0;
  auto offer = [&](int64_t i) {
    const float v = magnitude(x[i]);
    if (count == R && !(v > best[R - 1])) return;
    int64_t j = std::min(count, R - 1);  // the free slot (full: the smallest, dropped)
    for (; j > 0 && v > best[j - 1]; --j) {
      best[j] = best[j - 1];
      at[j] = at[j - 1];
    }
    best[j] = v;
    at[j] = static_cast<int32_t>(i);
    count = std::min(count + 1, R);
  };
  constexpr int64_t kLanes = 16;
  const int64_t chunked = K / kLanes * kLanes;
  float lane_max[kLanes] = {};
#ifdef KVSERVE_W8A8_VNNI
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < chunked; k0 += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + k0);
    lanes = _mm512_max_ps(lanes, _mm512_mask_mov_ps(_mm512_abs_ps(v), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), inf));
  }
  _mm512_storeu_ps(lane_max, lanes);
#elif defined(KVSERVE_W8A8_AVX2)
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t k0 = 0; k0 < chunked; k0 += kLanes)
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_loadu_ps(x + k0 + 8 * h);
      const __m256 magnitude = _mm256_blendv_ps(_mm256_andnot_ps(sign, v), inf, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      lanes[h] = _mm256_max_ps(lanes[h], magnitude);
    }
  _mm256_storeu_ps(lane_max, lanes[0]);
  _mm256_storeu_ps(lane_max + 8, lanes[1]);
#else
  for (int64_t k0 = 0; k0 < chunked; k0 += kLanes)
    for (int64_t i = 0; i < kLanes; ++i) lane_max[i] = std::max(lane_max[i], magnitude(x[k0 + i]));
#endif
  float bound = 0.f;  // (no full 16: the loop below is empty, and the one after it offers every input)
  if (chunked) {  // (then K >= 16 >= R)
    std::nth_element(lane_max, lane_max + R - 1, lane_max + kLanes, std::greater<float>());
    bound = lane_max[R - 1];
  }
  for (int64_t k0 = 0; k0 < chunked; k0 += kLanes) {
#ifdef KVSERVE_W8A8_VNNI
    const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + k0));  // (a NaN compares unordered: offered)
    for (unsigned at_least = _mm512_cmp_ps_mask(v, _mm512_set1_ps(bound), _CMP_NLT_UQ); at_least; at_least &= at_least - 1)
      offer(k0 + __builtin_ctz(at_least));
#elif defined(KVSERVE_W8A8_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.f), at = _mm256_set1_ps(bound);
    const unsigned lo = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k0)), at, _CMP_NLT_UQ));
    const unsigned hi = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k0 + 8)), at, _CMP_NLT_UQ));
    for (unsigned at_least = lo | hi << 8; at_least; at_least &= at_least - 1) offer(k0 + __builtin_ctz(at_least));
#else
    for (int64_t i = k0; i < k0 + kLanes; ++i)
      if (!(magnitude(x[i]) < bound)) offer(i);
#endif
  }
  for (int64_t i = chunked; i < K; ++i) offer(i);
  std::sort(at, at + R);
  std::copy(at, at + R, index);
}

Activations quantize_rows(const float* x, int64_t stride, int64_t M, int64_t K, int64_t Kp) {
  const int64_t G = Kp / kGroup, R = std::min(kOutliers, K);
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scale, scaled_sum, outlier_value;
  thread_local std::vector<int32_t> outlier_index;
  if (static_cast<int64_t>(q.size()) < M * Kp) q.resize(M * Kp);
  if (static_cast<int64_t>(scale.size()) < M * G) {
    scale.resize(M * G);
    scaled_sum.resize(M * G);
  }
  if (static_cast<int64_t>(outlier_index.size()) < M * R) {
    outlier_index.resize(M * R);
    outlier_value.resize(M * R);
  }
  int8_t* const qd = q.data();  // the caller's buffers (inside the workers the thread_locals are theirs)
  float* const sd = scale.data();
  float* const ss = scaled_sum.data();
  int32_t* const oi = outlier_index.data();
  float* const ov = outlier_value.data();
  kvserve::parallel_for(0, M, std::max<int64_t>(1, 8192 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* src = x + m * stride;
      int32_t* const outliers = oi + m * R;  // ascending
      largest_magnitudes(src, K, R, outliers);
      for (int64_t i = 0; i < R; ++i) ov[m * R + i] = src[outliers[i]];
      int64_t next_outlier = 0;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t k0 = g * kGroup, n = std::min(kGroup, K - k0);
        uint32_t is_outlier = 0;  // bit i: input k0 + i (zero in the rounded group)
        for (; next_outlier < R && outliers[next_outlier] < k0 + kGroup; ++next_outlier)
          is_outlier |= 1u << (outliers[next_outlier] - k0);
#ifdef KVSERVE_W8A8_VNNI
        if (n == kGroup) {  // the loop below in two vectors (the same bits: max, product and sum are exact or alike)
          // (non-finite inputs past the outliers read as 0, as below: fpclass 0x99 = NaN or inf)
          const auto finite = [](__m512 v) {
            return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_fpclass_ps_mask(v, 0x99)), v);
          };
          const __m512 lo = finite(_mm512_maskz_loadu_ps(static_cast<__mmask16>(~is_outlier), src + k0));
          const __m512 hi = finite(_mm512_maskz_loadu_ps(static_cast<__mmask16>(~is_outlier >> 16), src + k0 + 16));
          const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
          const __m512 inv = _mm512_set1_ps(amax > kSmallestGroup ? 127.f / amax : 0.f);
          const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qd + m * Kp + k0), _mm512_cvtepi32_epi8(qlo));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qd + m * Kp + k0 + 16), _mm512_cvtepi32_epi8(qhi));
          sd[m * G + g] = amax / 127.f;
          ss[m * G + g] = sd[m * G + g] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
          continue;
        }
#endif
#ifdef KVSERVE_W8A8_AVX2
        if (n == kGroup) {  // the loop below in four vectors (the same bits, as the VNNI path's)
          const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
          const __m256 sign = _mm256_set1_ps(-0.f);
          const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
          __m256 v[4];
          __m256 amax8 = _mm256_setzero_ps();
          for (int j = 0; j < 4; ++j) {
            const __m256i outlier = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>((is_outlier >> (8 * j)) & 0xFF)), lane_bit);
            const __m256 kept = _mm256_castsi256_ps(_mm256_cmpeq_epi32(outlier, _mm256_setzero_si256()));
            const __m256 x8 = _mm256_loadu_ps(src + k0 + 8 * j);
            const __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(sign, x8), inf, _CMP_LT_OQ);  // (false for NaN)
            v[j] = _mm256_and_ps(x8, _mm256_and_ps(kept, finite));
            amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[j]));
          }
          const float amax = horizontal_max(amax8);
          const __m256 inv = _mm256_set1_ps(amax > kSmallestGroup ? 127.f / amax : 0.f);
          __m256i q[4];
          for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
          // int32 -> int8 (|q| <= 127), the 128-bit lanes' interleaving undone by one permute
          const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qd + m * Kp + k0),
                              _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
          const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
          sd[m * G + g] = amax / 127.f;
          ss[m * G + g] = sd[m * G + g] * static_cast<float>(horizontal_sum(sum));
          continue;
        }
#endif
        // The outliers read as 0 here; a NaN or inf input past them (only when the row has more
        // than kOutliers of them: its outputs are NaN or inf through those anyway) too.
        float xg[kGroup];
        for (int64_t i = 0; i < n; ++i) {
          const float v = (is_outlier >> i) & 1 ? 0.f : src[k0 + i];
          xg[i] = std::isfinite(v) ? v : 0.f;
        }
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xg[i]));
        // (A group below 127 / FLT_MAX would overflow 127 / amax: it counts as zeros.)
        const float inv = amax > kSmallestGroup ? 127.f / amax : 0.f;
        int8_t* qg = qd + m * Kp + k0;
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(xg[i] * inv));  // |v| <= 127
          qg[i] = static_cast<int8_t>(v);
          sum += v;
        }
        for (int64_t i = n; i < kGroup; ++i) qg[i] = 0;  // K's padding
        sd[m * G + g] = amax / 127.f;
        ss[m * G + g] = sd[m * G + g] * static_cast<float>(sum);  // |sum| <= 32 * 127: exact
      }
    }
  });
  return {qd, sd, ss, oi, ov, R};
}

struct Call {
  Activations x;
  const uint8_t* w;  // codes [P][Kp / 4][16][4]
  const float* affine;  // [P][G][2][16]: per group the 16 columns' a, then their b
  const float* bias;  // [N] or null
  int64_t Kp, G, N;
  float* out;
  int64_t out_stride;
  const uint8_t* largest_codes;  // [P] or null (w8a8_linear.h)
};

#ifdef KVSERVE_W8A8_VNNI
// MR activation rows x NV panels of 16 columns: MR * NV int32 sums for the current group and as
// many fp32 sums across groups (4 x 3: 24 registers, the 3 code vectors beside them; each
// activation word is broadcast from memory by vpdpbusd itself).
template <int MR, int NV>
void w8a8_tile(const Call& c, int64_t m0, int64_t p0) {
  __m512 total[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) total[r][v] = _mm512_setzero_ps();
  const uint8_t* w[NV];
  const float* affine[NV];  // per group: a[16], b[16]
  for (int v = 0; v < NV; ++v) {
    w[v] = c.w + (p0 + v) * c.Kp * kPanel;
    affine[v] = c.affine + (p0 + v) * c.G * 2 * kPanel;
  }
  const int8_t* x[MR];  // each 4 bytes: one row's 4 consecutive inputs, broadcast as one word
  for (int r = 0; r < MR; ++r) x[r] = c.x.q + (m0 + r) * c.Kp;
  for (int64_t g = 0; g < c.G; ++g) {
    __m512i acc[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_si512();
    // A constant trip count, unrolled: with a variable one GCC copied every accumulator to
    // another register after each vpdpbusd (the W8A8 GEMMs ran at ~0.7x).
#pragma GCC unroll 8
    for (int i = 0; i < kGroup / 4; ++i) {
      const int64_t kq = g * (kGroup / 4) + i;
      __m512i b[NV];
      for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(w[v] + kq * 4 * kPanel);
      for (int r = 0; r < MR; ++r) {
        int32_t word;
        std::memcpy(&word, x[r] + 4 * kq, sizeof(word));  // (no int32 alias of the int8 buffer)
        const __m512i a = _mm512_set1_epi32(word);
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], b[v], a);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 sx = _mm512_set1_ps(c.x.scale[(m0 + r) * c.G + g]);
      const __m512 sq = _mm512_set1_ps(c.x.scaled_sum[(m0 + r) * c.G + g]);
      for (int v = 0; v < NV; ++v) {
        const float* ab = affine[v] + g * 2 * kPanel;
        const __m512 both = _mm512_mul_ps(sx, _mm512_loadu_ps(ab));
        total[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][v]), both, total[r][v]);
        total[r][v] = _mm512_fmadd_ps(_mm512_loadu_ps(ab + kPanel), sq, total[r][v]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    const int32_t* index = c.x.outlier_index + (m0 + r) * c.x.R;
    const float* value = c.x.outlier_value + (m0 + r) * c.x.R;
    for (int64_t i = 0; i < c.x.R; ++i) {
      const int64_t k = index[i];
      const __m512i one_hot = _mm512_set1_epi32(1 << (8 * (k % 4)));  // picks byte k % 4 of each lane
      const __m512 xk = _mm512_set1_ps(value[i]);
      for (int v = 0; v < NV; ++v) {
        const __m512i uk = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(w[v] + (k / 4) * 4 * kPanel),
                                               one_hot);
        const float* ab = affine[v] + (k / kGroup) * 2 * kPanel;
        const __m512 wk = _mm512_fmadd_ps(_mm512_cvtepi32_ps(uk), _mm512_loadu_ps(ab), _mm512_loadu_ps(ab + kPanel));
        total[r][v] = _mm512_fmadd_ps(wk, xk, total[r][v]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t col = (p0 + v) * kPanel;
    if (col >= c.N) continue;
    const __mmask16 keep = static_cast<__mmask16>((1u << std::min<int64_t>(kPanel, c.N - col)) - 1);
    const __m512 bias = c.bias ? _mm512_maskz_loadu_ps(keep, c.bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)
      _mm512_mask_storeu_ps(c.out + (m0 + r) * c.out_stride + col, keep, _mm512_add_ps(total[r][v], bias));
  }
}

template <int MR>
void w8a8_tile_np(const Call& c, int64_t m0, int64_t p0, int64_t np) {
  switch (np) {
    case 1: w8a8_tile<MR, 1>(c, m0, p0); break;
    case 2: w8a8_tile<MR, 2>(c, m0, p0); break;
    default: w8a8_tile<MR, 3>(c, m0, p0); break;
  }
}

// Panels [pb, pe) for all rows: blocks of kRowBlock rows (their activations stay in cache),
// three panels at a time, four rows at a time over them (measured on Zen 4 at 256 rows, the
// decoder GEMMs of SmolLM2 against its bf16 copies: 4 x 3 1.18x, 4 x 2 1.14x, 6 x 2 1.10x).
constexpr int64_t kTilePanels = 3;
constexpr int kTileRows = 4;
void w8a8_panels_vnni(const Call& c, int64_t M, int64_t pb, int64_t pe) {
  for (int64_t mb = 0; mb < M; mb += kRowBlock) {
    const int64_t me = std::min(M, mb + kRowBlock);
    for (int64_t p = pb; p < pe; p += kTilePanels) {
      const int64_t np = std::min<int64_t>(kTilePanels, pe - p);
      for (int64_t m = mb; m < me; m += kTileRows)
        dispatch_rows<kTileRows>(std::min<int64_t>(kTileRows, me - m), [&](auto mr) { w8a8_tile_np<decltype(mr)::value>(c, m, p, np); });
    }
  }
}
#endif

#ifdef KVSERVE_W8A8_AVX2
// Without VNNI, vpmaddubsw multiplies the codes (unsigned bytes) by the activations (signed ones)
// and adds each two neighbouring products into an int16, which saturates past 32767; vpmaddwd
// then adds neighbouring int16s into int32 lanes (one column's 4 inputs each, as vpdpbusd). Each
// pair sum is at most 2 * 127 * u_max, so a group whose codes are small keeps `depth` of them in
// int16 before one vpmaddwd (Q4_1 and Q4_K, codes to 15: the whole group of 8 quads; Q5_0, to
// 31: 4), about one vpmaddubsw and one vpaddw per 32 products, twice the fp32 FMAs' rate. Codes
// past 129 (Q8_0's q + 128) run as their two nibbles, 16 * high + low. The integer sums are
// exact either way, so the bits are the portable loop's.
constexpr int kQuadsPerGroup = kGroup / 4;
// 3 rows x 1 panel of 16 columns (measured on Zen 3 at 256 rows, SmolLM2's decoder GEMMs:
// 2 x 2 panels and 4 x 1 were 1.03x as long; row blocks of 24 or 48 rows made no difference).
constexpr int kAvx2TileRows = 3;
constexpr int64_t kAvx2TilePanels = 1;
static_assert(kAvx2TilePanels == 1 || kAvx2TilePanels == 2, "w8a8_panels_avx2 runs a short run of panels one by one");

// Int16 pair sums of a group that can be added before one could pass 32767 (|q| <= 127), for
// codes up to max_code; 0: too large for one vpmaddubsw (split into nibbles).
inline int pair_sum_depth(int max_code) {
  if (max_code <= 16) return 8;
  if (max_code <= 32) return 4;
  if (max_code <= 64) return 2;
  return max_code <= 129 ? 1 : 0;
}

// The int32 sums of group g, rows x[r] by the 8 columns of vector v (NV vectors: panel v / 2,
// its half v % 2), `depth` quads' int16 pair sums at a time, into acc (kAdd: added to it); part:
// the whole codes or one of their nibbles.
enum class CodePart { kWhole, kLow, kHigh };

template <int MR, int NV, CodePart part, int depth, bool kAdd>
__attribute__((always_inline)) inline void group_sums(const uint8_t* const (&w)[NV], const int8_t* const (&x)[MR],
                                                      int64_t g, __m256i (&acc)[MR][NV]) {
  const __m256i ones = _mm256_set1_epi16(1), low_nibble = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 8
  for (int c = 0; c < kQuadsPerGroup; c += depth) {
    __m256i pairs[MR][NV];
#pragma GCC unroll 8
    for (int i = c; i < c + depth; ++i) {
      const int64_t kq = g * kQuadsPerGroup + i;
      __m256i b[NV];
      for (int v = 0; v < NV; ++v) {
        b[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[v] + kq * 4 * kPanel));
        if constexpr (part == CodePart::kLow) b[v] = _mm256_and_si256(b[v], low_nibble);
        if constexpr (part == CodePart::kHigh) b[v] = _mm256_and_si256(_mm256_srli_epi16(b[v], 4), low_nibble);
      }
      for (int r = 0; r < MR; ++r) {
        int32_t word;
        std::memcpy(&word, x[r] + 4 * kq, sizeof(word));
        const __m256i a = _mm256_set1_epi32(word);
        for (int v = 0; v < NV; ++v) {
          if (i == c) {
            pairs[r][v] = _mm256_maddubs_epi16(b[v], a);
            continue;
          }
          // pairs += vpmaddubsw(b, a) as one statement: GCC, free to reassociate integer adds,
          // otherwise ran a group's products first and spilled them (the GEMMs at ~0.6x).
          __m256i product;
          __asm__("vpmaddubsw %[a], %[b], %[product]\n\tvpaddw %[product], %[pairs], %[pairs]"
                  : [pairs] "+x"(pairs[r][v]), [product] "=&x"(product)
                  : [a] "x"(a), [b] "x"(b[v]));
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) {
        const __m256i sums = _mm256_madd_epi16(pairs[r][v], ones);
        acc[r][v] = kAdd || c > 0 ? _mm256_add_epi32(acc[r][v], sums) : sums;
      }
  }
}

// MR activation rows x NP panels: the same steps per row, column and group as the portable loop
// (and the VNNI tile), each group's codes read `depth` quads at a time (0: as two nibbles), the
// most that the panels' largest code allows (Call::largest_codes). The fp32 sums pass each group
// in memory, so that the products' loop has the registers. Held in registers at depth 8 (6 of 16
// at 3 x 1) they left one for the weights, and GCC reloaded each weight vector once per row (6
// loads and 3 broadcasts a quad, not 2 and 3: SmolLM2's decoder GEMMs 1.04x as long); at the
// other depths GCC spilled the int16 sums inside the products' loop (codes to 31 ran 1.13x as
// fast as bf16 copies, not 1.33x, at 960 x 576). GCC may still promote the array to registers:
// at depth 8 two asm statements stop it. (With them at every depth, Gemma 3's qkv, Q5_0 and Q8_0
// codes, measured 1.05x as long in one A/B and the same in another: the other depths are left to
// GCC.)
template <int MR, int NP, int depth>
void w8a8_tile_avx2(const Call& c, int64_t m0, int64_t p0) {
  constexpr int NV = 2 * NP;
  alignas(32) float total_in_memory[MR][NV][8] = {};
  const uint8_t* w[NV];
  const float* affine[NV];  // per group: a[16], b[16] of the vector's panel, from its half
  for (int v = 0; v < NV; ++v) {
    w[v] = c.w + (p0 + v / 2) * c.Kp * kPanel + (v % 2) * 32;
    affine[v] = c.affine + (p0 + v / 2) * c.G * 2 * kPanel + (v % 2) * 8;
  }
  const int8_t* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = c.x.q + (m0 + r) * c.Kp;
  for (int64_t g = 0; g < c.G; ++g) {
    __m256i acc[MR][NV];
    if constexpr (depth > 0) {
      group_sums<MR, NV, CodePart::kWhole, depth, false>(w, x, g, acc);
    } else {
      group_sums<MR, NV, CodePart::kHigh, 8, false>(w, x, g, acc);
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_slli_epi32(acc[r][v], 4);
      group_sums<MR, NV, CodePart::kLow, 8, true>(w, x, g, acc);
    }
    if constexpr (depth == 8) asm("" : "+m"(total_in_memory));  // (else loaded above the products, held in registers)
    for (int r = 0; r < MR; ++r) {
      const __m256 sx = _mm256_set1_ps(c.x.scale[(m0 + r) * c.G + g]);
      const __m256 sq = _mm256_set1_ps(c.x.scaled_sum[(m0 + r) * c.G + g]);
      for (int v = 0; v < NV; ++v) {
        const float* ab = affine[v] + g * 2 * kPanel;
        const __m256 both = _mm256_mul_ps(sx, _mm256_loadu_ps(ab));
        __m256 t = _mm256_load_ps(total_in_memory[r][v]);
        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][v]), both, t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(ab + kPanel), sq, t);
        _mm256_store_ps(total_in_memory[r][v], t);
      }
    }
    if constexpr (depth == 8) asm("" : "+m"(total_in_memory));  // (else held through the next group's products)
  }
  __m256 total[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) total[r][v] = _mm256_load_ps(total_in_memory[r][v]);
  const __m256i byte = _mm256_set1_epi32(0xFF);
  for (int r = 0; r < MR; ++r) {
    const int32_t* index = c.x.outlier_index + (m0 + r) * c.x.R;
    const float* value = c.x.outlier_value + (m0 + r) * c.x.R;
    for (int64_t i = 0; i < c.x.R; ++i) {
      const int64_t k = index[i];
      const __m256 xk = _mm256_set1_ps(value[i]);
      for (int v = 0; v < NV; ++v) {
        const __m256i quad = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[v] + (k / 4) * 4 * kPanel));
        const __m256i uk = _mm256_and_si256(_mm256_srli_epi32(quad, static_cast<int>(8 * (k % 4))), byte);
        const float* ab = affine[v] + (k / kGroup) * 2 * kPanel;
        const __m256 wk = _mm256_fmadd_ps(_mm256_cvtepi32_ps(uk), _mm256_loadu_ps(ab), _mm256_loadu_ps(ab + kPanel));
        total[r][v] = _mm256_fmadd_ps(wk, xk, total[r][v]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t col = (p0 + v / 2) * kPanel + (v % 2) * 8;
    if (col >= c.N) continue;
    const int64_t n = std::min<int64_t>(8, c.N - col);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 bias = c.bias ? _mm256_maskload_ps(c.bias + col, keep) : _mm256_setzero_ps();
    for (int r = 0; r < MR; ++r)
      _mm256_maskstore_ps(c.out + (m0 + r) * c.out_stride + col, keep, _mm256_add_ps(total[r][v], bias));
  }
}

// The largest code of each panel p in [pb, pe) (max_code[p - pb]), over all its groups.
void w8a8_max_codes(const Call& c, int64_t pb, int64_t pe, uint8_t* max_code) {
  for (int64_t p = pb; p < pe; ++p) {
    const uint8_t* codes = c.w + p * c.Kp * kPanel;
    __m256i m = _mm256_setzero_si256();
    for (int64_t i = 0; i < c.Kp * kPanel / 32; ++i)
      m = _mm256_max_epu8(m, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * i)));
    alignas(32) uint8_t bytes[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), m);
    max_code[p - pb] = *std::max_element(bytes, bytes + 32);
  }
}

template <int MR, int NP>
void w8a8_tile_avx2_depth(const Call& c, int largest_code, int64_t m0, int64_t p0) {
  switch (pair_sum_depth(largest_code)) {
    case 8: return w8a8_tile_avx2<MR, NP, 8>(c, m0, p0);
    case 4: return w8a8_tile_avx2<MR, NP, 4>(c, m0, p0);
    case 2: return w8a8_tile_avx2<MR, NP, 2>(c, m0, p0);
    case 1: return w8a8_tile_avx2<MR, NP, 1>(c, m0, p0);
    default: return w8a8_tile_avx2<MR, NP, 0>(c, m0, p0);
  }
}

void w8a8_panels_avx2(const Call& c, int64_t M, int64_t pb, int64_t pe) {
  thread_local std::vector<uint8_t> max_code;
  const uint8_t* mc = c.largest_codes ? c.largest_codes + pb : nullptr;  // mc[p - pb]: panel p's
  if (!mc) {
    if (static_cast<int64_t>(max_code.size()) < pe - pb) max_code.resize(pe - pb);
    w8a8_max_codes(c, pb, pe, max_code.data());
    mc = max_code.data();
  }
  for (int64_t mb = 0; mb < M; mb += kRowBlock) {
    const int64_t me = std::min(M, mb + kRowBlock);
    for (int64_t p = pb; p < pe; p += kAvx2TilePanels) {
      const int64_t np = std::min<int64_t>(kAvx2TilePanels, pe - p);
      const int largest = *std::max_element(mc + (p - pb), mc + (p - pb + np));
      for (int64_t m = mb; m < me; m += kAvx2TileRows)
        dispatch_rows<kAvx2TileRows>(std::min<int64_t>(kAvx2TileRows, me - m), [&](auto mr) {
          constexpr int MR = decltype(mr)::value;
          if (np == kAvx2TilePanels) return w8a8_tile_avx2_depth<MR, kAvx2TilePanels>(c, largest, m, p);
          w8a8_tile_avx2_depth<MR, 1>(c, largest, m, p);  // (kAvx2TilePanels is 1 or 2)
        });
    }
  }
}
#endif

// The same integers and fp32 operations, one row and panel at a time (columns innermost, so
// that nothing reorders a sum across groups).
void w8a8_panels_portable(const Call& c, int64_t M, int64_t pb, int64_t pe) {
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* xq = c.x.q + m * c.Kp;
    for (int64_t p = pb; p < pe; ++p) {
      const uint8_t* w = c.w + p * c.Kp * kPanel;
      const float* affine = c.affine + p * c.G * 2 * kPanel;
      float total[kPanel] = {};
      for (int64_t g = 0; g < c.G; ++g) {
        int32_t acc[kPanel] = {};
        for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
          const uint8_t* wk = w + (k / 4) * 4 * kPanel + k % 4;
          for (int j = 0; j < kPanel; ++j) acc[j] += static_cast<int32_t>(wk[4 * j]) * xq[k];
        }
        const float sx = c.x.scale[m * c.G + g], sq = c.x.scaled_sum[m * c.G + g];
        const float* a = affine + g * 2 * kPanel;
        const float* b = a + kPanel;
        for (int j = 0; j < kPanel; ++j) {
          total[j] = std::fma(static_cast<float>(acc[j]), sx * a[j], total[j]);
          total[j] = std::fma(b[j], sq, total[j]);
        }
      }
      for (int64_t i = 0; i < c.x.R; ++i) {
        const int64_t k = c.x.outlier_index[m * c.x.R + i];
        const float xk = c.x.outlier_value[m * c.x.R + i];
        const uint8_t* wk = w + (k / 4) * 4 * kPanel + k % 4;
        const float* a = affine + (k / kGroup) * 2 * kPanel;
        const float* b = a + kPanel;
        for (int j = 0; j < kPanel; ++j)
          total[j] = std::fma(std::fma(static_cast<float>(wk[4 * j]), a[j], b[j]), xk, total[j]);
      }
      for (int j = 0; j < kPanel; ++j) {
        const int64_t col = p * kPanel + j;
        if (col < c.N) c.out[m * c.out_stride + col] = total[j] + (c.bias ? c.bias[col] : 0.f);
      }
    }
  }
}

}  // namespace

void set_portable_w8a8_kernel(bool portable) { g_portable = portable; }

std::string w8a8_kernel_route() {
#ifdef KVSERVE_W8A8_VNNI
  if (!g_portable) return "avx512vnni";
#endif
#ifdef KVSERVE_W8A8_AVX2
  if (!g_portable) return "avx2";
#endif
  return "portable";
}

std::vector<torch::Tensor> w8a8_activations(torch::Tensor x, int64_t padded_k) {
  check_activation_rows(x);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(padded_k % kGroup == 0 && K <= padded_k && padded_k - K < kGroup, "padded_k must be K rounded up to ", kGroup);
  const Activations a = quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, padded_k);
  auto q = torch::from_blob(const_cast<int8_t*>(a.q), {M, padded_k}, torch::kInt8).clone();
  auto scale = torch::from_blob(const_cast<float*>(a.scale), {M, padded_k / kGroup}, torch::kFloat32).clone();
  auto index = torch::from_blob(const_cast<int32_t*>(a.outlier_index), {M, a.R}, torch::kInt32).clone();
  auto value = torch::from_blob(const_cast<float*>(a.outlier_value), {M, a.R}, torch::kFloat32).clone();
  auto scaled_sum = torch::from_blob(const_cast<float*>(a.scaled_sum), {M, padded_k / kGroup}, torch::kFloat32).clone();
  return {q, scale, index, value, scaled_sum};
}

void w8a8_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor wp, torch::Tensor affine,
                     c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> largest_codes) {
  RECORD_FUNCTION("kvserve::w8a8_linear", std::vector<c10::IValue>());  // kvserve profile's label
  const int64_t N = out.size(1);
  check_linear_rows(x, out, N);
  TORCH_CHECK(wp.scalar_type() == torch::kUInt8 && wp.dim() == 4 && wp.is_contiguous() && wp.size(2) == kPanel &&
                  wp.size(3) == 4,
              "wp must be uint8 [Np / 16, Kp / 4, 16, 4] (kvserve.quant.pack_w8a8_weight)");
  const int64_t M = x.size(0), K = x.size(1), P = wp.size(0), Kp = wp.size(1) * 4;
  TORCH_CHECK(Kp % kGroup == 0 && K <= Kp && Kp - K < kGroup, "x has ", K, " inputs; the weights ", Kp, " padded");
  TORCH_CHECK(affine.scalar_type() == torch::kFloat32 && affine.is_contiguous() &&
                  affine.numel() == P * (Kp / kGroup) * 2 * kPanel,
              "affine must be a contiguous float32 [Np / 16, Kp / 32, 2, 16]");
  TORCH_CHECK(N <= P * kPanel && N > (P - 1) * kPanel, "out has ", N, " columns, not the weights' output columns");
  const float* b = optional_bias(bias, N);
  if (largest_codes)
    TORCH_CHECK(largest_codes->scalar_type() == torch::kUInt8 && largest_codes->is_contiguous() && largest_codes->numel() == P,
                "largest_codes must be a contiguous uint8 [Np / 16] (kvserve.quant.W8A8Linear.largest_codes)");
  if (M == 0) return;
  const Call call{quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, Kp), wp.data_ptr<uint8_t>(),
                  affine.data_ptr<float>(), b, Kp, Kp / kGroup, N, out.data_ptr<float>(), out.stride(0),
                  largest_codes ? largest_codes->data_ptr<uint8_t>() : nullptr};
  const int64_t threads = std::min(P, M * N * K < kSmallWork ? int64_t{1} : static_cast<int64_t>(at::get_num_threads()));
  kvserve::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pb = P * t / threads, pe = P * (t + 1) / threads;
      if (pb == pe) continue;
#ifdef KVSERVE_W8A8_VNNI
      if (!g_portable) {
        w8a8_panels_vnni(call, M, pb, pe);
        continue;
      }
#endif
#ifdef KVSERVE_W8A8_AVX2
      if (!g_portable) {
        w8a8_panels_avx2(call, M, pb, pe);
        continue;
      }
#endif
      w8a8_panels_portable(call, M, pb, pe);
    }
  });
}

torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor affine, int64_t n,
                          c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> largest_codes) {
  auto out = torch::empty({x.size(0), n}, x.options());
  w8a8_linear_out(out, x, wp, affine, bias, largest_codes);
  return out;
}
