// Linear layers on block-quantized weights for a few activation rows, the shape of decode.
//
// A decode step reads every weight once per token, so its speed is the speed at which
// weights stream from memory: the kernels below read GGUF's 4- and 8-bit blocks as stored
// and do the arithmetic as they go, one pass over the weights for all rows of the step.
//
//   Q4_1 (kvserve int4): groups of 32 weights w = d * q + m, q in 0..15, d and m fp16.
//     y = sum_g d_g * (q_g . x_g) + m_g * sum(x_g), with x rounded once per group of 32 to
//     16-bit integers times a scale (2^-16 of the group's largest |x|: finer than bf16), so that
//     q_g . x_g is an exact integer dot product (the weights' bytes times each activation's two
//     bytes: vpdpbusd on AVX512, vpmaddubsw and vpmaddwd on AVX2), scaled once per group.
//   Q4_K (Gemma 3's file): super-blocks of 256 with 6-bit sub-scales, w = d * sc * q - dmin * mn
//     per group of 32. Loaded into the Q4_1 layout with the group's d * sc and -dmin * mn as
//     fp32 (both exact in fp32, not in fp16): the same kernel with fp32 scales.
//   Q5_0 (Gemma 3's file): groups of 32, w = d * (q - 16), q in 0..31: the 4 low bits as in
//     Q4_1, the fifth bits (GGUF's qh) regrouped for the kernel. Same integer products as Q4_1.
//   Q8_0 (the int4 mode's LM head, as llama.cpp stores it): groups of 32, w = d * q,
//     q in -127..127. fp32 products. Q6_K (Gemma 3's file): groups of 16, w = d * sc * (q - 32),
//     loaded as int8 q - 32 with the group's d * sc in fp32 (exact): the Q8_0 kernel with
//     fine-grained fp32 scales.
//
// Every output row is computed in the same order whatever the number of activation rows, so
// results do not depend on batch composition. Without AVX512-VNNI, CPUs with AVX2 and FMA
// (Zen 2/3) widen the 8-bit values to fp32 in 8-lane vectors (the same products, an fp32 FMA
// chain per lane); a portable loop computes the nibble formats on bf16 activations elsewhere
// (each path in its own fixed order).
#include "quant_linear.h"
#include "avx2_reduce.h"
#include "step_team.h"
#include "linear_args.h"
#include "nibble_tiles.h"
#include "tile_formats.h"
#include "row_dispatch.h"
#include "fp16.h"
#include "row_table.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>


namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kChunk = 64;        // two groups: the nibble formats' unit of padding and scales
constexpr int64_t kRowsPerTask = 16;  // output rows per task: their weights stay in cache while every input row uses them
constexpr int64_t kInputRowBlock = 4;  // input rows sharing one decode of the weights
// How far ahead of the kernels the weight stream is fetched (software prefetch). The hardware
// prefetcher alone leaves a decode-shaped call (weights from memory, little arithmetic per
// byte) waiting on memory: on Zen 4 the 4-bit kernel read 5.6 GB/s per core from DRAM with it
// alone, 10.5 with this, one row at a time (2 and 4 KiB ahead alike, 1 KiB less). One output
// row per pass for the same reason: in a test kernel two rows' interleaved streams (faster
// from cache) read 8.4 GB/s from DRAM with the same prefetch where one row read 12.8.
constexpr int64_t kPrefetchBytes = 2048;
// The nibble formats' activations as integers, per group of 32 inputs: q = round(x * L / a),
// a the group's largest |x|, on AVX2 and AVX512 alike. L = 127 * 256 + 127 rather than 32767,
// so that q splits into two signed bytes (see SplitInt16Activations).
constexpr float kActivationLevels = 32639.f;
constexpr int64_t kActivationScales = 4;  // floats per row and group of SplitInt16Activations

bool g_portable = false;

// buffer's first n elements, growing it when it is shorter (its contents are the caller's to set).
template <typename T>
T* grown(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

inline uint16_t float_to_bf16_rne(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Per-group scales as a format stores them: fp16 bits (GGUF's own) or fp32 (scales that are
// products of two stored numbers, exact only in fp32).

// The activations of one nibble-format call for the portable loop: per 64-input chunk, the bf16
// inputs paired with the low nibbles (inputs 0-15 and 32-47) then with the high nibbles
// (16-31 and 48-63), and each group's fp32 sum of its bf16 inputs divided by 8 (exact) in the
// 8 lanes whose products belong to that group.
struct Q4Activations {
  int64_t chunks;
  std::vector<uint16_t> xb;  // [M][chunks][64]
  std::vector<float> group_sums;  // [M][chunks][16]

  Q4Activations(const float* x, int64_t x_stride, int64_t M, int64_t K, int64_t Kp)
      : chunks(Kp / kChunk), xb(M * Kp), group_sums(M * chunks * 16) {
    for (int64_t r = 0; r < M; ++r) {
      const float* xr = x + r * x_stride;
      for (int64_t c = 0; c < chunks; ++c) {
        uint16_t* dst = xb.data() + (r * chunks + c) * kChunk;
        float* sums = group_sums.data() + (r * chunks + c) * 16;
        for (int64_t half = 0; half < 2; ++half) {  // group 2c, then 2c + 1
          const int64_t base = c * kChunk + half * kGroup;
          float sum = 0.f;
          for (int64_t j = 0; j < kGroup; ++j) {
            const uint16_t v = float_to_bf16_rne(base + j < K ? xr[base + j] : 0.f);
            sum += bf16_to_float(v);
            // nibble j < 16 (low) pairs with word half * 16 + j of the low vector
            dst[(j < 16 ? 0 : 32) + half * 16 + (j & 15)] = v;
          }
          for (int64_t l = 0; l < 8; ++l) sums[half * 8 + l] = sum * 0.125f;
        }
      }
    }
  }
};

template <typename Scale>
struct Q4Format {
  static constexpr bool kOffset = true;
  const uint8_t* qs;
  const Scale* dm;  // (d, d', m, m') per 64-weight chunk
  int64_t chunks;

  float portable_scale(int64_t n, int64_t c, int half) const { return scale_value(dm[(n * chunks + c) * 4 + half]); }
  float portable_offset(int64_t n, int64_t c, int half) const {
    return scale_value(dm[(n * chunks + c) * 4 + 2 + half]);
  }
  // byte j of group `half`: (low-nibble value, high-nibble value)
  std::pair<int, int> portable_values(int64_t n, int64_t c, int half, int j) const {
    const uint8_t byte = qs[(n * chunks + c) * 32 + half * 16 + j];
    return {byte & 15, byte >> 4};
  }
};

struct Q5Format {
  static constexpr bool kOffset = false;
  const uint8_t* qs;   // as Q4_1's
  const uint32_t* qh;  // per 128-weight block, 4 masks: bit i of mask p = fifth bit of plane p's word i
  const uint16_t* d;   // per group, fp16
  int64_t chunks;

  float portable_scale(int64_t n, int64_t c, int half) const { return fp16_bits_to_float(d[(n * chunks + c) * 2 + half]); }
  float portable_offset(int64_t, int64_t, int) const { return 0.f; }
  // The fifth bit of weight j of group g of row n. The masks number a block's 64 bytes of
  // nibbles as 32 16-bit words, 4 nibbles each: word i holds weights 2 (i % 8) and + 1 of group
  // i / 8 in its bytes, each with a low and a high nibble; mask p holds nibble p of every word.
  int fifth_bit(int64_t n, int64_t g, int j) const {
    const int plane = (j >= 16) + 2 * (j & 1), word = (g % 4) * 8 + ((j & 15) >> 1);
    return (qh[(n * ((chunks + 1) / 2) + g / 4) * 4 + plane] >> word) & 1;
  }
  std::pair<int, int> portable_values(int64_t n, int64_t c, int half, int j) const {
    const uint8_t byte = qs[(n * chunks + c) * 32 + half * 16 + j];
    const int64_t g = 2 * c + half;
    return {static_cast<int>((byte & 15) | (fifth_bit(n, g, j) << 4)) - 16,
            static_cast<int>((byte >> 4) | (fifth_bit(n, g, j + 16) << 4)) - 16};
  }
};

#ifdef KVSERVE_QUANT_AVX2
// 32 int32 lanes in -128..127 as 32 bytes in their order (the packs interleave 128-bit halves:
// dword i of the result holds lanes 4 i .. 4 i + 3 of the inputs' order 0, 4, 1, 5, ...).
inline __m256i packed_bytes(const __m256i (&v)[4]) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

#if defined(KVSERVE_Q4_AVX512) || defined(KVSERVE_QUANT_AVX2)
// L / a, the factor that takes a group's inputs to integers; 0 where that is not a finite number
// (a group of zeros, past K, non-finite, or so small that L / a overflows: below ~1e-34, all its
// q = 0), so that no finite input becomes a vcvtps2dq overflow.
inline float activation_inverse(float a, float levels = kActivationLevels) {
  const float inverse = levels / a;
  return a > 0.f && std::isfinite(a) && std::isfinite(inverse) ? inverse : 0.f;
}

// The activations of a nibble-format call: per group of 32 inputs q = round(x * L / a), a the
// group's largest |x| and s = a / L, each q split into two signed bytes q = 256 h + l
// (h = floor((q + 128) / 256) in -127..127, l in -128..127: L = 32639 keeps h a byte), so that
// the weights' unsigned bytes multiply each half (vpdpbusd; vpmaddubsw on AVX2) and
// 256 dot(v, h) + dot(v, l) is the exact integer dot product. Per row and group: 64 bytes, h of
// the 32 inputs in order then l, and four floats, s, s * sum(q), and s * the sums of its two
// halves of 16 (Q6_K's sub-groups). AVX512 and AVX2 compute the
// same bytes and floats (the same fp32 operations; the maximum and the sum are exact).
struct SplitInt16Activations {
  int64_t groups;
  int8_t* bytes;   // [M][groups][64]
  float* scales;   // [M][groups][kActivationScales]

  // In the calling thread's scratch memory, reused by its next call: a decode step makes a few
  // hundred calls, and fresh vectors per call (allocation, fill, free) were ~4 % of a SmolLM2
  // int4 step's main thread. Read by the call's workers while the caller waits.
  SplitInt16Activations(const float* x, int64_t x_stride, int64_t M, int64_t K, int64_t Kp) : groups(Kp / kGroup) {
    thread_local std::vector<int8_t> bytes_scratch;
    thread_local std::vector<float> scales_scratch;
    bytes = grown(bytes_scratch, M * groups * 64);
    scales = grown(scales_scratch, M * groups * kActivationScales);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t g = 0; g < groups; ++g) split_group(x + r * x_stride, g, K, bytes + (r * groups + g) * 64,
                                                       scales + (r * groups + g) * kActivationScales);
  }

 private:
  // Group g of row x (zeros past K) into its 64 bytes and two scales.
  static void split_group(const float* x, int64_t g, int64_t K, int8_t* dst, float* scale) {
    const int64_t k0 = g * kGroup, n = std::max<int64_t>(0, std::min(kGroup, K - k0));
#ifdef KVSERVE_Q4_AVX512
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m512 v0 = _mm512_maskz_loadu_ps(_cvtu32_mask16(n >= 16 ? 0xFFFFu : (1u << n) - 1), x + k0);
    const __m512 v1 = _mm512_maskz_loadu_ps(_cvtu32_mask16(n <= 16 ? 0u : n >= 32 ? 0xFFFFu : (1u << (n - 16)) - 1),
                                            x + k0 + 16);
    float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, abs_mask), _mm512_and_ps(v1, abs_mask)));
    // A non-finite input keeps a non-finite scale, so that the row's outputs are not finite
    // either, as a float product would leave them (vmaxps alone may drop a NaN).
    if (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q))
      a = std::numeric_limits<float>::quiet_NaN();
    const __m512 inv = _mm512_set1_ps(activation_inverse(a));
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    const __m512i bias = _mm512_set1_epi32(128);
    const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(q0, bias), 8), h1 = _mm512_srai_epi32(_mm512_add_epi32(q1, bias), 8);
    const __m512i l0 = _mm512_sub_epi32(q0, _mm512_slli_epi32(h0, 8)), l1 = _mm512_sub_epi32(q1, _mm512_slli_epi32(h1, 8));
    // (saturating, as AVX2's packs: a NaN lane's integer, INT_MIN, gives h = -128 on both)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(h0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(h1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32), _mm512_cvtsepi32_epi8(l0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 48), _mm512_cvtsepi32_epi8(l1));
    const int32_t first = _mm512_reduce_add_epi32(q0), second = _mm512_reduce_add_epi32(q1);
#else
    float group[kGroup] = {};
    std::memcpy(group, x + k0, n * sizeof(float));
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 v[4], largest = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(group + 8 * i);
      largest = _mm256_max_ps(largest, _mm256_and_ps(v[i], abs_mask));
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    float a = horizontal_max(largest);
    if (_mm256_movemask_ps(unordered)) a = std::numeric_limits<float>::quiet_NaN();  // as on AVX512
    const __m256 inv = _mm256_set1_ps(activation_inverse(a));
    const __m256i bias = _mm256_set1_epi32(128);
    __m256i high[4], low[4], totals[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int i = 0; i < 4; ++i) {
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round to nearest, ties to even
      high[i] = _mm256_srai_epi32(_mm256_add_epi32(q, bias), 8);
      low[i] = _mm256_sub_epi32(q, _mm256_slli_epi32(high[i], 8));
      totals[i / 2] = _mm256_add_epi32(totals[i / 2], q);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed_bytes(high));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), packed_bytes(low));
    const int32_t first = horizontal_sum(totals[0]), second = horizontal_sum(totals[1]);
#endif
    const float s = a / kActivationLevels;
    scale[0] = s;
    scale[1] = s * static_cast<float>(first + second);
    scale[2] = s * static_cast<float>(first);  // (Q6_K's sub-scales: per 16 inputs)
    scale[3] = s * static_cast<float>(second);
  }
};
#endif

#ifdef KVSERVE_Q4_AVX512
// Word i (inputs 4 i .. 4 i + 3) of 32 activation bytes, in every lane.
inline __m512i broadcast_word(const int8_t* bytes, int i) {
  int32_t word;
  std::memcpy(&word, bytes + 4 * i, sizeof(word));
  return _mm512_set1_epi32(word);
}

// Per output row (lane), the tile-group's products with one row's split activations x (64 bytes:
// h of the 32 inputs, then l): hl, ll the low nibbles' (values 0-15) with h and l, hh, lh the high
// nibbles' (16-31). Four independent chains of four: one chain of 16 would leave each group's sum
// ~80 cycles of latency behind (-35 % time at K = 576 with four). Integer sums: the order does not
// change the result.
inline void split_dots(const __m512i (&low)[4], const __m512i (&high)[4], const int8_t* x, __m512i& hl,
                       __m512i& hh, __m512i& ll, __m512i& lh) {
  hl = hh = ll = lh = _mm512_setzero_si512();
  for (int i = 0; i < 4; ++i) {
    hl = _mm512_dpbusd_epi32(hl, low[i], broadcast_word(x, i));
    hh = _mm512_dpbusd_epi32(hh, high[i], broadcast_word(x, 4 + i));
    ll = _mm512_dpbusd_epi32(ll, low[i], broadcast_word(x, 8 + i));
    lh = _mm512_dpbusd_epi32(lh, high[i], broadcast_word(x, 12 + i));
  }
}

// Tile t's 16 outputs (fewer in the last tile) of MR rows, plus the bias, into out's rows.
template <int MR>
inline void store_tile_rows(const __m512 (&acc)[MR], int64_t t, int64_t N, const float* bias, float* out,
                            int64_t out_stride) {
  const int64_t n0 = t * kTileRows;
  const __mmask16 keep = n0 + kTileRows <= N ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * out_stride + n0, keep, _mm512_add_ps(acc[r], b));
}

// Tiles [t0, t1) of N output rows for MR activation rows from r0. Per tile-group and activation
// row, each of the 16 lanes (output rows) gets its group's exact integer dot product
// 256 dot(v, h) + dot(v, l) (at most 32 * 31 * 32639 < 2^25: exact in fp32 but for Q5_0's
// largest, rounded to 2^-24), then acc += m * s sum(q) and acc += dot * (d s), in group order:
// every output the same operations whatever MR and wherever its tile falls in the call.
template <typename Tiles, int MR>
void nibble_tiles_avx512(const Tiles& w, int64_t t0, int64_t t1, int64_t N, const SplitInt16Activations& act,
                         int64_t r0, float* out, int64_t out_stride, const float* bias) {
  const int64_t groups = act.groups;
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = w.group(t, g);
      __m512i low[4], high[4];
      load_tile_nibbles(p, Tiles::kGroupBytes, low, high);
      Tiles::values(p, low, high);
      __m512 d, m;
      tile_scales(w, p, t, g, d, m);
      for (int r = 0; r < MR; ++r) {
        const int64_t ag = (r0 + r) * groups + g;
        const int8_t* x = act.bytes + ag * 64;
        __m512i hl, hh, ll, lh;
        split_dots(low, high, x, hl, hh, ll, lh);
        const __m512i dot =
            _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(hl, hh), 8), _mm512_add_epi32(ll, lh));
        const float* s = act.scales + ag * kActivationScales;
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(s[1]), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(s[0])), acc[r]);
      }
    }
    store_tile_rows<MR>(acc, t, N, bias, out + r0 * out_stride, out_stride);
  }
}

// Prompt rows' activations as single signed bytes (the int8 prompt path; decode rows keep the
// split 16-bit integers above). A prompt of hundreds of tokens makes each linear layer
// compute-bound, and the split activations cost two vpdpbusd per product: one byte halves the
// multiplies. Per row and half-group of 16 inputs q = round(x * 127 / a), a the half's largest
// |x| (a step of a / 127: llama.cpp's Q8_0 activations round per 32, its K-quants' per 256).
// A half whose a exceeds kWideHalf times the row's RMS holds one of the few "massive" channels
// LLMs' residual streams carry: rounded against it, its 15 other inputs would lose most of their
// bits, so its group keeps the split 16-bit integers (and two vpdpbusd per product; ~10 % of the
// groups of SmolLM2 and Gemma 3). On both models' tolerance text (tests/test_precision.py) the KL
// divergence from exact activations was 0.00022 / 0.00020 this way (top-1 agreement 99.4 % on
// both; 98.7 % on both on 600 positions of the long text), 0.0003 with a limit of 6 RMS, 0.0011 /
// 0.0009 with bytes everywhere (per 16), 0.0018 / 0.0016 per 32, and 0.0005 with each row's 4
// largest inputs exact (W8A8Linear's way). Opt-in (--int4-prefill int8): the exact path holds
// 99.7-100 %.
// Per row and group: 32 bytes q (a wide group's h, its l apart), five floats s_lo,
// s_hi (the halves' steps), s_lo sum(q_lo) + s_hi sum(q_hi), s_lo sum(q_lo), s_hi sum(q_hi), and
// whether the group is wide. Every value depends on its own row only (batch invariance).
constexpr float kInt8ActivationLevels = 127.f;
constexpr float kWideHalf = 4.f;
constexpr int64_t kPromptScales = 5;

struct PromptActivations {
  int64_t groups;
  int8_t* bytes;      // [M][groups][32]
  int8_t* low_bytes;  // [M][groups][32], the wide groups' l only (read only for them)
  float* scales;      // [M][groups][kPromptScales]
  uint8_t* wide;    // [M][groups]

  // (thread-local scratch as SplitInt16Activations'; the rows are rounded in parallel: a prompt's
  // hundreds of rows took ~2 % of a 256-token prefill on one thread)
  PromptActivations(const float* x, int64_t x_stride, int64_t M, int64_t K, int64_t Kp) : groups(Kp / kGroup) {
    thread_local std::vector<int8_t> bytes_scratch;
    thread_local std::vector<float> scales_scratch;
    thread_local std::vector<uint8_t> wide_scratch;
    thread_local std::vector<int8_t> low_scratch;
    bytes = grown(bytes_scratch, M * groups * kGroup);
    low_bytes = grown(low_scratch, M * groups * kGroup);
    scales = grown(scales_scratch, M * groups * kPromptScales);
    wide = grown(wide_scratch, M * groups);
    int8_t* const b = bytes;
    int8_t* const lb = low_bytes;
    float* const sc = scales;
    uint8_t* const wd = wide;
    const int64_t G = groups;
    kvserve::parallel_for(0, M, M * K < (1 << 16) ? M : 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* row = x + r * x_stride;
        const float limit = kWideHalf * root_mean_square(row, K);
        for (int64_t g = 0; g < G; ++g)
          round_group(row, g, K, limit, b + (r * G + g) * kGroup, lb + (r * G + g) * kGroup,
                      sc + (r * G + g) * kPromptScales, wd + r * G + g);
      }
    });
  }

 private:
  // In a fixed order of lanes: the same bits for the row wherever it is.
  static float root_mean_square(const float* x, int64_t K) {
    __m512 sum = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + k);
      sum = _mm512_fmadd_ps(v, v, sum);
    }
    const __m512 v = _mm512_maskz_loadu_ps(_cvtu32_mask16((1u << (K - k)) - 1), x + k);
    sum = _mm512_fmadd_ps(v, v, sum);
    return std::sqrt(_mm512_reduce_add_ps(sum) / static_cast<float>(K));
  }

  static void round_group(const float* x, int64_t g, int64_t K, float limit, int8_t* dst, int8_t* low_dst, float* scale,
                          uint8_t* wide) {
    const int64_t k0 = g * kGroup, n = std::max<int64_t>(0, std::min(kGroup, K - k0));
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m512 v[2] = {_mm512_maskz_loadu_ps(_cvtu32_mask16(n >= 16 ? 0xFFFFu : (1u << n) - 1), x + k0),
                         _mm512_maskz_loadu_ps(_cvtu32_mask16(n <= 16 ? 0u : n >= 32 ? 0xFFFFu : (1u << (n - 16)) - 1),
                                               x + k0 + 16)};
    float a[2];
    for (int h = 0; h < 2; ++h) {
      a[h] = _mm512_reduce_max_ps(_mm512_and_ps(v[h], abs_mask));
      // (as SplitInt16Activations: a non-finite input leaves the outputs not finite either)
      if (_mm512_cmp_ps_mask(v[h], v[h], _CMP_UNORD_Q)) a[h] = std::numeric_limits<float>::quiet_NaN();
    }
    // (a NaN row's limit is NaN: its groups stay bytes, their scales NaN)
    *wide = a[0] > limit || a[1] > limit;
    const float levels = *wide ? kActivationLevels : kInt8ActivationLevels;
    const __m512i bias = _mm512_set1_epi32(128);
    int32_t sums[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(activation_inverse(a[h], levels))));
      if (*wide) {  // SplitInt16Activations' h (in dst) and l (in low_dst)
        const __m512i high = _mm512_srai_epi32(_mm512_add_epi32(q, bias), 8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * h), _mm512_cvtsepi32_epi8(high));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(low_dst + 16 * h),
                         _mm512_cvtsepi32_epi8(_mm512_sub_epi32(q, _mm512_slli_epi32(high, 8))));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * h), _mm512_cvtsepi32_epi8(q));
      }
      sums[h] = _mm512_reduce_add_epi32(q);
    }
    scale[0] = a[0] / levels;
    scale[1] = a[1] / levels;
    scale[3] = scale[0] * static_cast<float>(sums[0]);
    scale[4] = scale[1] * static_cast<float>(sums[1]);
    scale[2] = scale[3] + scale[4];
  }
};

// Input rows sharing one decode of the weights on the int8 prompt path: a tile-group's unpacking
// is worth twice as many rows when each row costs half the multiplies.
constexpr int kInt8RowBlock = 8;

// The tile-group's exact integer products with one row's prompt activations x: lo, the low
// nibbles' (values 0-15, inputs 0-15) and hi, the high nibbles' (16-31); from the bytes, or a
// wide group's split integers (256 dot(v, h) + dot(v, l)).
inline void byte_dots(const __m512i (&low)[4], const __m512i (&high)[4], const int8_t* x, __m512i& lo, __m512i& hi) {
  __m512i part[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int i = 0; i < 2; ++i) {  // (four chains of two: integer sums, the order does not change them)
    part[0] = _mm512_dpbusd_epi32(part[0], low[2 * i], broadcast_word(x, 2 * i));
    part[1] = _mm512_dpbusd_epi32(part[1], low[2 * i + 1], broadcast_word(x, 2 * i + 1));
    part[2] = _mm512_dpbusd_epi32(part[2], high[2 * i], broadcast_word(x, 4 + 2 * i));
    part[3] = _mm512_dpbusd_epi32(part[3], high[2 * i + 1], broadcast_word(x, 5 + 2 * i));
  }
  lo = _mm512_add_epi32(part[0], part[1]);
  hi = _mm512_add_epi32(part[2], part[3]);
}

inline void prompt_dots(const __m512i (&low)[4], const __m512i (&high)[4], const PromptActivations& act, int64_t ag,
                        __m512i& lo, __m512i& hi) {
  byte_dots(low, high, act.bytes + ag * kGroup, lo, hi);
  if (act.wide[ag]) {
    __m512i lo_l, hi_l;
    byte_dots(low, high, act.low_bytes + ag * kGroup, lo_l, hi_l);
    lo = _mm512_add_epi32(_mm512_slli_epi32(lo, 8), lo_l);
    hi = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), hi_l);
  }
}

// Whether any of the MR rows from `first` (a row-group index; rows `groups` apart) is wide
// there: nearly never, and then the rows' byte products run with no branch between them, so that
// their chains interleave (a branch per row left each row's eight dependent vpdpbusd alone, and
// kept the accumulators in memory: no faster than the split activations' sixteen).
template <int MR>
inline bool any_wide(const PromptActivations& act, int64_t first, int64_t groups) {
  bool wide = false;
  for (int r = 0; r < MR; ++r) wide |= act.wide[first + r * groups];
  return wide;
}

// accumulate(r, lo, hi) for each of the MR rows from `first` with their products with the
// tile-group (low, high): straight-line byte products when no row is wide there, else each row
// by its own kind; both loops unrolled (an accumulator indexed at run time would live in memory).
template <int MR, typename Accumulate>
__attribute__((always_inline)) inline void for_prompt_rows(const __m512i (&low)[4], const __m512i (&high)[4],
                                                           const PromptActivations& act, int64_t first,
                                                           int64_t groups, const Accumulate& accumulate) {
  if (!any_wide<MR>(act, first, groups)) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m512i lo, hi;
      byte_dots(low, high, act.bytes + (first + r * groups) * kGroup, lo, hi);
      accumulate(r, lo, hi);
    }
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    __m512i lo, hi;
    prompt_dots(low, high, act, first + r * groups, lo, hi);
    accumulate(r, lo, hi);
  }
}

// The nibble tiles on prompt activations, per row and group, in this order: acc += m * (s_lo
// sum(q_lo) + s_hi sum(q_hi)), then acc += (lo * s_lo + hi * s_hi) * d: the same steps for every
// row whatever MR and whichever tile.
template <typename Tiles, int MR>
void nibble_tiles_int8_avx512(const Tiles& w, int64_t t0, int64_t t1, int64_t N, const PromptActivations& act,
                              int64_t r0, float* out, int64_t out_stride, const float* bias) {
  const int64_t groups = act.groups;
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = w.group(t, g);
      __m512i low[4], high[4];
      load_tile_nibbles(p, Tiles::kGroupBytes, low, high);
      Tiles::values(p, low, high);
      __m512 d, m;
      tile_scales(w, p, t, g, d, m);
      const auto accumulate = [&](int r, __m512i lo, __m512i hi) __attribute__((always_inline)) {
        const float* s = act.scales + ((r0 + r) * groups + g) * kPromptScales;
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(s[2]), acc[r]);
        const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(s[1]),
                                           _mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(s[0])));
        acc[r] = _mm512_fmadd_ps(dot, d, acc[r]);
      };
      for_prompt_rows<MR>(low, high, act, r0 * groups + g, groups, accumulate);
    }
    store_tile_rows<MR>(acc, t, N, bias, out + r0 * out_stride, out_stride);
  }
}
#endif

#ifdef KVSERVE_QUANT_AVX2
// The AVX512 kernel's tiles in two 8-lane halves (rows 0-7, 8-15), as the LM head's screen reads
// them on AVX2 (screen_linear.cpp): each group's exact integer dot product per row
// (256 dot(v, h) + dot(v, l), nibble_tiles.h's dot_bytes), then acc += m * s sum(q) and acc += dot * (d s), the
// same fp32 operations in the same order as nibble_tiles_avx512, so the same outputs bit for
// bit. For one activation row GCC's code takes ~90 instructions per 256 weights (~50 of them
// vector arithmetic), the row layout's kernel (16-bit weights against 16-bit activations,
// vpmaddwd) took ~125: on a 2-core Zen 3 both threads of a decode step stream at the memory's
// rate either way, and the cores have more time for the rest.
template <typename Tiles, int MR>
void nibble_tiles_avx2(const Tiles& w, int64_t t0, int64_t t1, int64_t N, const SplitInt16Activations& act,
                       int64_t r0, float* out, int64_t out_stride, const float* bias) {
  const int64_t groups = act.groups;
  const __m256i ones = _mm256_set1_epi16(1), times_256 = _mm256_set1_epi16(256);
  for (int64_t t = t0; t < t1; ++t) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = w.group(t, g);
      for (int64_t line = 0; line < Tiles::kGroupBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p) + kTilePrefetchBytes + line, _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {  // rows 8 h .. 8 h + 7
        __m256i low[4], high[4];
        load_tile_half_nibbles(p, h, low, high);
        Tiles::values(p, h, low, high);
        __m256 d, m;
        tile_scales(w, p, t, g, h, d, m);
        for (int r = 0; r < MR; ++r) {
          const int64_t ag = (r0 + r) * groups + g;
          const int8_t* x = act.bytes + ag * 64;
          const __m256i dot = _mm256_add_epi32(dot_bytes<Tiles::kMaxValue>(low, high, x, times_256),
                                               dot_bytes<Tiles::kMaxValue>(low, high, x + 32, ones));
          const float* s = act.scales + ag * kActivationScales;
          acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(s[1]), acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(s[0])), acc[r][h]);
        }
      }
    }
    const int64_t n0 = t * kTileRows, valid = std::min(kTileRows, N - n0);
    alignas(32) float b[kTileRows] = {};
    if (bias) std::memcpy(b, bias + n0, valid * sizeof(float));
    for (int r = 0; r < MR; ++r) {
      alignas(32) float lanes[kTileRows];
      float* o = valid == kTileRows ? out + (r0 + r) * out_stride + n0 : lanes;
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(o + 8 * h, _mm256_add_ps(acc[r][h], _mm256_load_ps(b + 8 * h)));
      if (o == lanes) std::memcpy(out + (r0 + r) * out_stride + n0, lanes, valid * sizeof(float));
    }
  }
}
#endif

template <typename Format>
void nibble_rows_portable(const Format& f, int64_t n_begin, int64_t n_end, const Q4Activations& act, int64_t r0,
                          int64_t rows, float* out, int64_t out_stride, const float* bias) {
  const int64_t chunks = f.chunks;
  for (int64_t r = r0; r < r0 + rows; ++r) {
    for (int64_t n = n_begin; n < n_end; ++n) {
      float acc = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* x = act.xb.data() + (r * chunks + c) * kChunk;
        const float* sums = act.group_sums.data() + (r * chunks + c) * 16;
        for (int half = 0; half < 2; ++half) {
          float dot = 0.f;
          for (int j = 0; j < 16; ++j) {
            const auto [low, high] = f.portable_values(n, c, half, j);
            dot += static_cast<float>(low) * bf16_to_float(x[half * 16 + j]) +
                   static_cast<float>(high) * bf16_to_float(x[32 + half * 16 + j]);
          }
          acc += f.portable_scale(n, c, half) * dot;
          if (Format::kOffset) acc += f.portable_offset(n, c, half) * sums[half * 8] * 8.f;
        }
      }
      out[r * out_stride + n] = acc + (bias ? bias[n] : 0.f);
    }
  }
}

#ifdef KVSERVE_Q4_AVX512
// Tiles [t0, t1) of a Q6KTiles matrix for MR activation rows from r0: per tile-group and row,
// the two half-groups' exact integer dot products (values 0..63 against the split activations),
// then, in this order, acc += -32 s0 * (s sum(q 0-15)), -32 s1 * (s sum(q 16-31)),
// dot0 * (s0 s), dot1 * (s1 s): every output the same operations whatever MR.
template <int MR>
void q6_tiles_avx512(const Q6KTiles& w, int64_t t0, int64_t t1, int64_t N, const SplitInt16Activations& act,
                     int64_t r0, float* out, int64_t out_stride, const float* bias) {
  const int64_t groups = act.groups;
  const __m512 minus_32 = _mm512_set1_ps(-32.f);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = w.group(t, g);
      __m512i low[4], high[4];
      load_tile_nibbles(p, Q6KTiles::kGroupBytes, low, high);
      Q6KTiles::values(p, low, high);
      __m512 s0, s1;
      w.scales(p, t, g, s0, s1);
      const __m512 m0 = _mm512_mul_ps(minus_32, s0), m1 = _mm512_mul_ps(minus_32, s1);
      for (int r = 0; r < MR; ++r) {
        const int64_t ag = (r0 + r) * groups + g;
        const int8_t* x = act.bytes + ag * 64;
        __m512i hl, hh, ll, lh;
        split_dots(low, high, x, hl, hh, ll, lh);
        const __m512i dot0 = _mm512_add_epi32(_mm512_slli_epi32(hl, 8), ll);
        const __m512i dot1 = _mm512_add_epi32(_mm512_slli_epi32(hh, 8), lh);
        const float* s = act.scales + ag * kActivationScales;
        const __m512 scale = _mm512_set1_ps(s[0]);
        acc[r] = _mm512_fmadd_ps(m0, _mm512_set1_ps(s[2]), acc[r]);
        acc[r] = _mm512_fmadd_ps(m1, _mm512_set1_ps(s[3]), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(s0, scale), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(s1, scale), acc[r]);
      }
    }
    store_tile_rows<MR>(acc, t, N, bias, out + r0 * out_stride, out_stride);
  }
}

// Q6KTiles on prompt activations, per row and group in this order: acc += -32 s0 * (s_lo
// sum(q_lo)), -32 s1 * (s_hi sum(q_hi)), lo * (s0 s_lo), hi * (s1 s_hi).
template <int MR>
void q6_tiles_int8_avx512(const Q6KTiles& w, int64_t t0, int64_t t1, int64_t N, const PromptActivations& act,
                          int64_t r0, float* out, int64_t out_stride, const float* bias) {
  const int64_t groups = act.groups;
  const __m512 minus_32 = _mm512_set1_ps(-32.f);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = w.group(t, g);
      __m512i low[4], high[4];
      load_tile_nibbles(p, Q6KTiles::kGroupBytes, low, high);
      Q6KTiles::values(p, low, high);
      __m512 s0, s1;
      w.scales(p, t, g, s0, s1);
      const __m512 m0 = _mm512_mul_ps(minus_32, s0), m1 = _mm512_mul_ps(minus_32, s1);
      const auto accumulate = [&](int r, __m512i dot0, __m512i dot1) __attribute__((always_inline)) {
        const float* s = act.scales + ((r0 + r) * groups + g) * kPromptScales;
        acc[r] = _mm512_fmadd_ps(m0, _mm512_set1_ps(s[3]), acc[r]);
        acc[r] = _mm512_fmadd_ps(m1, _mm512_set1_ps(s[4]), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(s0, _mm512_set1_ps(s[0])), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(s1, _mm512_set1_ps(s[1])), acc[r]);
      };
      for_prompt_rows<MR>(low, high, act, r0 * groups + g, groups, accumulate);
    }
    store_tile_rows<MR>(acc, t, N, bias, out + r0 * out_stride, out_stride);
  }
}
#endif

// The portable loop for Q6KTiles: per row, w = d sc (v - 32) in fp32 (exact) against the bf16
// activations, in input order.
void q6_tiles_portable(const Q6KTiles& w, int64_t N, const Q4Activations& act, int64_t M, float* out,
                       int64_t out_stride, const float* bias) {
  const int64_t chunks = act.chunks;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t t = n / kTileRows, row = n % kTileRows;
      float acc = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        const uint16_t* x = act.xb.data() + (r * chunks + g / 2) * kChunk;  // (per chunk: low halves, then high)
        for (int j = 0; j < 32; ++j) {
          const int half = j / 16, jj = j % 16;
          const float weight = w.sub_scale(t, g, row, half) * static_cast<float>(w.value(t, g, row, j) - 32);
          acc += weight * bf16_to_float(x[(j < 16 ? 0 : 32) + (g % 2) * 16 + jj]);
        }
      }
      out[r * out_stride + n] = acc + (bias ? bias[n] : 0.f);
    }
  }
}

// Output rows in tasks of kRowsPerTask spread over the threads (one thread for a call too small
// to be worth waking the others), input rows in blocks of kInputRowBlock within each task:
// calls block(first output row, end output row, first input row, input rows).
template <typename Block>
void over_row_blocks(int64_t N, int64_t M, int64_t work, const Block& block) {
  const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t grain = work < (1 << 18) ? tasks : 1;
  kvserve::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * kRowsPerTask, n1 = std::min(N, t1 * kRowsPerTask);
    for (int64_t r0 = 0; r0 < M; r0 += kInputRowBlock) block(n0, n1, r0, std::min(kInputRowBlock, M - r0));
  });
}

// The tiles of N output rows spread over the threads (one thread for a call too small to be worth
// waking the other) and, per tile, every block of input rows while the tile is in cache: calls
// kernel(first tile, end tile, first input row, input rows <= kInputRowBlock).
template <int64_t RowBlock = kInputRowBlock, typename Kernel>
void over_tiles(int64_t N, int64_t M, int64_t Kp, const Kernel& kernel) {
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t grain = M * N * Kp < (1 << 18) ? tiles : 1;
  kvserve::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    if (M <= RowBlock) return kernel(t0, t1, 0, M);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r0 = 0; r0 < M; r0 += RowBlock) kernel(t, t + 1, r0, std::min(RowBlock, M - r0));
  });
}

// over_tiles for prompts of many rows: per thread, blocks of tiles whose weights stay in L2 while
// chunks of input rows whose activations stay there too go through them (over_tiles streams every
// row's activations past each tile: for a 256-token prompt a 1.3 MB pass per tile, from L3).
// Each (tile, row block) is the same kernel call as over_tiles makes: the same results.
template <int64_t RowBlock, typename Kernel>
void over_tile_blocks(int64_t N, int64_t M, int64_t tile_bytes, int64_t row_bytes, const Kernel& kernel) {
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  constexpr int64_t kBudget = 256 << 10;  // bytes of each, weights and activations, per block (L2: 1-2 MB)
  const int64_t tiles_per_block = std::max<int64_t>(1, kBudget / tile_bytes);
  const int64_t rows_per_chunk = std::max<int64_t>(RowBlock, kBudget / row_bytes / RowBlock * RowBlock);
  kvserve::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    if (M <= RowBlock) return kernel(t0, t1, 0, M);
    for (int64_t tb = t0; tb < t1; tb += tiles_per_block)
      for (int64_t rc = 0; rc < M; rc += rows_per_chunk)
        for (int64_t t = tb; t < std::min(t1, tb + tiles_per_block); ++t)
          for (int64_t r0 = rc; r0 < std::min(M, rc + rows_per_chunk); r0 += RowBlock)
            kernel(t, t + 1, r0, std::min(RowBlock, M - r0));
  });
}

// y = x @ W^T + bias for a nibble format in the row layout (the portable loop; the AVX512 and
// AVX2 kernels read the tiled layout): the activations laid out once, then every block of
// output rows with every block of input rows.
template <typename Format>
void nibble_linear_out(const Format& f, torch::Tensor& out, const torch::Tensor& x, int64_t N,
                       const c10::optional<torch::Tensor>& bias) {
  const int64_t Kp = f.chunks * kChunk, M = x.size(0), K = x.size(1);
  float* o = out.data_ptr<float>();
  const int64_t o_stride = out.stride(0);
  const float* b = optional_bias(bias, N);
#if defined(KVSERVE_Q4_AVX512) || defined(KVSERVE_QUANT_AVX2)
  TORCH_CHECK(g_portable, "this CPU's nibble kernel reads the tiled layout (kvserve.quant.tile_nibbles)");
#endif
  const Q4Activations act(x.data_ptr<float>(), x.stride(0), M, K, Kp);
  over_row_blocks(N, M, M * N * Kp, [&](int64_t n0, int64_t n1, int64_t r0, int64_t rows) {
    nibble_rows_portable(f, n0, n1, act, r0, rows, o, o_stride, b);
  });
}

// The same for the tiled layout: the AVX512 or AVX2 kernel, tiles spread over the threads and, per
// tile, every block of input rows while the tile is in cache; or the portable loop.
template <typename Tiles>
void nibble_tiles_out(const Tiles& w, torch::Tensor& out, const torch::Tensor& x, int64_t N,
                      const c10::optional<torch::Tensor>& bias) {
  const int64_t Kp = w.groups * kGroup, M = x.size(0), K = x.size(1);
  if (M == 0) return;  // (dispatch_rows needs a row)
  float* o = out.data_ptr<float>();
  const int64_t o_stride = out.stride(0);
  const float* b = optional_bias(bias, N);
#if defined(KVSERVE_Q4_AVX512) || defined(KVSERVE_QUANT_AVX2)
  if (!g_portable) {
    const SplitInt16Activations act(x.data_ptr<float>(), x.stride(0), M, K, Kp);
    over_tiles(N, M, Kp, [&](int64_t t0, int64_t t1, int64_t r0, int64_t rows) {
      dispatch_rows<kInputRowBlock>(rows, [&](auto mr) {
#ifdef KVSERVE_Q4_AVX512
        nibble_tiles_avx512<Tiles, decltype(mr)::value>(w, t0, t1, N, act, r0, o, o_stride, b);
#else
        nibble_tiles_avx2<Tiles, decltype(mr)::value>(w, t0, t1, N, act, r0, o, o_stride, b);
#endif
      });
    });
    return;
  }
#endif
  const Q4Activations act(x.data_ptr<float>(), x.stride(0), M, K, Kp);
  over_row_blocks(N, M, M * N * Kp, [&](int64_t n0, int64_t n1, int64_t r0, int64_t rows) {
    nibble_rows_portable(w, n0, n1, act, r0, rows, o, o_stride, b);
  });
}

// y = x @ W^T + bias for Q6KTiles: the AVX512 kernel over tiles spread on the threads, or the
// portable loop.
void q6_tiles_out(const Q6KTiles& w, torch::Tensor& out, const torch::Tensor& x, int64_t N,
                  const c10::optional<torch::Tensor>& bias) {
  const int64_t Kp = w.groups * kGroup, M = x.size(0), K = x.size(1);
  if (M == 0) return;
  float* o = out.data_ptr<float>();
  const int64_t o_stride = out.stride(0);
  const float* b = optional_bias(bias, N);
#ifdef KVSERVE_Q4_AVX512
  if (!g_portable) {
    const SplitInt16Activations act(x.data_ptr<float>(), x.stride(0), M, K, Kp);
    over_tiles(N, M, Kp, [&](int64_t t0, int64_t t1, int64_t r0, int64_t rows) {
      dispatch_rows<kInputRowBlock>(rows, [&](auto mr) {
        q6_tiles_avx512<decltype(mr)::value>(w, t0, t1, N, act, r0, o, o_stride, b);
      });
    });
    return;
  }
#endif
  const Q4Activations act(x.data_ptr<float>(), x.stride(0), M, K, Kp);
  q6_tiles_portable(w, N, act, M, o, o_stride, b);
}

// x, out and the nibbles of a nibble-format call: qs uint8 [N, ceil(K / 64) * 32].
void check_nibble_rows(const torch::Tensor& x, const torch::Tensor& out, const torch::Tensor& qs) {
  const int64_t Kp = qs.size(1) * 2, K = x.size(1);
  check_linear_rows(x, out, qs.size(0));
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && Kp % kChunk == 0 && K <= Kp &&
                  Kp - K < kChunk,
              "qs must be uint8 [N, ceil(K / 64) * 32]");
}

}  // namespace

void set_portable_quant_kernels(bool portable) { g_portable = portable; }

std::string quant_kernel_isa() {
#if defined(KVSERVE_Q4_AVX512)
  return "avx512";
#elif defined(KVSERVE_QUANT_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

std::string nibble_activation_format() {
#if defined(KVSERVE_Q4_AVX512) || defined(KVSERVE_QUANT_AVX2)
  if (!g_portable) return "int16";
#endif
  return "bf16";
}

void q4_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor dm,
                   c10::optional<torch::Tensor> bias) {
  RECORD_FUNCTION("kvserve::q4_linear", std::vector<c10::IValue>());  // kvserve profile's label, every caller
  const int64_t N = qs.size(0), Kp = qs.size(1) * 2;
  check_nibble_rows(x, out, qs);
  TORCH_CHECK((dm.scalar_type() == torch::kInt16 || dm.scalar_type() == torch::kFloat32) && dm.is_contiguous() &&
                  dm.numel() == N * (Kp / kChunk) * 4,
              "dm must be [N, K / 64, 4] = (d, d', m, m') per chunk, as fp16 bits (int16) or fp32");
  const int64_t chunks = Kp / kChunk;
  const uint8_t* q = qs.data_ptr<uint8_t>();
  if (dm.scalar_type() == torch::kFloat32) {
    nibble_linear_out(Q4Format<float>{q, dm.data_ptr<float>(), chunks}, out, x, N, bias);
  } else {
    nibble_linear_out(Q4Format<uint16_t>{q, reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>()), chunks},
                      out, x, N, bias);
  }
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm, c10::optional<torch::Tensor> bias) {
  auto out = torch::empty({x.size(0), qs.size(0)}, x.options());
  q4_linear_out(out, x, qs, dm, bias);
  return out;
}

void q5_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor qh, torch::Tensor d,
                   c10::optional<torch::Tensor> bias) {
  RECORD_FUNCTION("kvserve::q5_linear", std::vector<c10::IValue>());  // kvserve profile's label, every caller
  const int64_t N = qs.size(0), Kp = qs.size(1) * 2;
  check_nibble_rows(x, out, qs);
  TORCH_CHECK(qh.scalar_type() == torch::kInt32 && qh.is_contiguous() && qh.numel() == N * ((Kp + 127) / 128) * 4,
              "qh must be int32 [N, ceil(Kp / 128) * 4] (the fifth bits as plane masks)");
  TORCH_CHECK(d.scalar_type() == torch::kInt16 && d.is_contiguous() && d.numel() == N * (Kp / kGroup),
              "d must be the fp16 bits (int16) of [N, Kp / 32]");
  nibble_linear_out(Q5Format{qs.data_ptr<uint8_t>(), reinterpret_cast<const uint32_t*>(qh.data_ptr<int32_t>()),
                             reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>()), Kp / kChunk},
                    out, x, N, bias);
}

torch::Tensor q5_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor qh, torch::Tensor d,
                        c10::optional<torch::Tensor> bias) {
  auto out = torch::empty({x.size(0), qs.size(0)}, x.options());
  q5_linear_out(out, x, qs, qh, d, bias);
  return out;
}

namespace {

// The packed tiles' format by the bytes of its last dimension, checked against out and x, as
// fn(tiles): Q4Tiles (fp16 or fp32 scales), Q5Tiles, or Q4_K's or Q6_K's own tiles.
template <typename Fn>
void visit_tiles(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed, const Fn& fn) {
  const int64_t group_bytes = packed.dim() == 3 ? packed.size(2) : 0;
  const bool q5 = group_bytes == Q5Tiles::kGroupBytes, q4_k = group_bytes == Q4KTiles::kSuperBytes,
             q5_k = group_bytes == Q5KTiles::kSuperBytes, q6_k = group_bytes == Q6KTiles::kSuperBytes;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  (q5 || q4_k || q5_k || q6_k || group_bytes == Q4Tiles<uint16_t>::kGroupBytes ||
                   group_bytes == Q4Tiles<float>::kGroupBytes),
              "packed must be uint8 [ceil(N / 16), Kp / 32, 320 | 384 | 352] (kvserve.quant.tile_nibbles) "
              "or [ceil(N / 16), K / 256, 2368 | 2880 | 3360] (Q4_K's, Q5_K's, Q6_K's own tiles)");
  const int64_t N = out.size(1), groups = packed.size(1) * (q4_k || q5_k || q6_k ? 8 : 1), Kp = groups * kGroup, K = x.size(1);
  check_linear_rows(x, out, N);
  TORCH_CHECK(packed.size(0) == (N + kTileRows - 1) / kTileRows, "packed holds ", packed.size(0) * kTileRows,
              " rows, out ", N);
  TORCH_CHECK(Kp % kChunk == 0 && K <= Kp && Kp - K < kChunk, "x has ", K, " features, the weights ", Kp);
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const int64_t chunks = Kp / kChunk;
  if (q6_k) {
    fn(Q6KTiles{p, groups});
  } else if (q5) {
    fn(Q5Tiles{p, groups, chunks});
  } else if (q4_k) {
    fn(Q4KTiles{p, groups, chunks});
  } else if (q5_k) {
    fn(Q5KTiles{p, groups, chunks});
  } else if (group_bytes == Q4Tiles<float>::kGroupBytes) {
    fn(Q4Tiles<float>{p, groups, chunks});
  } else {
    fn(Q4Tiles<uint16_t>{p, groups, chunks});
  }
}

// y = x @ W^T + bias on the int8 prompt path: the AVX512-VNNI kernels over tiles spread on the
// threads, eight input rows per decode of a tile-group.
template <typename Tiles>
void int8_tiles_out(const Tiles& w, torch::Tensor& out, const torch::Tensor& x, int64_t N,
                    const c10::optional<torch::Tensor>& bias) {
#ifdef KVSERVE_Q4_AVX512
  const int64_t Kp = w.groups * kGroup, M = x.size(0), K = x.size(1);
  if (M == 0) return;
  float* o = out.data_ptr<float>();
  const int64_t o_stride = out.stride(0);
  const float* b = optional_bias(bias, N);
  const PromptActivations act(x.data_ptr<float>(), x.stride(0), M, K, Kp);
  const int64_t groups = Kp / kGroup;
  const int64_t tile_bytes = groups * Tiles::kGroupBytes;
  const int64_t row_bytes = groups * (kGroup + 1 + kPromptScales * sizeof(float));
  const auto blocks = [&](const auto& kernel) {
    if (M * N * Kp < (1 << 18)) return over_tiles<kInt8RowBlock>(N, M, Kp, kernel);  // (one thread)
    over_tile_blocks<kInt8RowBlock>(N, M, tile_bytes, row_bytes, kernel);
  };
  blocks([&](int64_t t0, int64_t t1, int64_t r0, int64_t rows) {
    dispatch_rows<kInt8RowBlock>(rows, [&](auto mr) {
      if constexpr (std::is_same_v<Tiles, Q6KTiles>)
        q6_tiles_int8_avx512<decltype(mr)::value>(w, t0, t1, N, act, r0, o, o_stride, b);
      else
        nibble_tiles_int8_avx512<Tiles, decltype(mr)::value>(w, t0, t1, N, act, r0, o, o_stride, b);
    });
  });
#else
  TORCH_CHECK(false, "the int8 prompt kernels need AVX512 with VNNI (kvserve.ops.int8_prompt_kernels())");
#endif
}

}  // namespace

void tiled_nibble_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                             c10::optional<torch::Tensor> bias) {
  const bool q5 = packed.dim() == 3 && packed.size(2) == Q5Tiles::kGroupBytes;
  // kvserve profile's labels, every caller
  RECORD_FUNCTION(q5 ? "kvserve::q5_linear" : "kvserve::q4_linear", std::vector<c10::IValue>());
  const int64_t N = out.size(1);
  visit_tiles(out, x, packed, [&](const auto& w) {
    if constexpr (std::is_same_v<std::decay_t<decltype(w)>, Q6KTiles>)
      q6_tiles_out(w, out, x, N, bias);
    else
      nibble_tiles_out(w, out, x, N, bias);
  });
}

void tiled_nibble_int8_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                                  c10::optional<torch::Tensor> bias) {
  RECORD_FUNCTION("kvserve::int8_prompt_linear", std::vector<c10::IValue>());
  const int64_t N = out.size(1);
  visit_tiles(out, x, packed, [&](const auto& w) { int8_tiles_out(w, out, x, N, bias); });
}

torch::Tensor tiled_nibble_int8_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  auto out = torch::empty({x.size(0), N}, x.options());
  tiled_nibble_int8_linear_out(out, x, packed, bias);
  return out;
}

bool int8_prompt_kernels() {
#ifdef KVSERVE_Q4_AVX512
  return true;
#else
  return false;
#endif
}

torch::Tensor tiled_nibble_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  auto out = torch::empty({x.size(0), N}, x.options());
  tiled_nibble_linear_out(out, x, packed, bias);
  return out;
}

namespace {

// Q8 scales: fp16 per group of 32 (Q8_0 as stored) or fp32 per group of 16 (Q6_K's d * sc).
template <typename Scale>
struct Q8Scales {
  static constexpr int64_t kPerGroup = std::is_same_v<Scale, float> ? 16 : 32;
  const Scale* s;
  int64_t groups_per_row;  // of kPerGroup weights
  float operator()(int64_t n, int64_t g) const { return scale_value(s[n * groups_per_row + g]); }
  const Scale* row(int64_t n) const { return s + n * groups_per_row; }
};

#ifdef KVSERVE_Q4_AVX512
template <typename Scale, int MR>
void q8_rows_avx512(const int8_t* qs, const Q8Scales<Scale>& scales, int64_t n_begin, int64_t n_end, int64_t groups,
                    const float* x, int64_t x_stride, int64_t r0, float* out, int64_t out_stride, const float* bias) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* q = qs + n * groups * kGroup;
    const Scale* srow = scales.row(n);
    constexpr int64_t kPerGroup = Q8Scales<Scale>::kPerGroup;
    // Two accumulators (even / odd groups, or first / second 16 of each group for per-16
    // scales), named: indexing them by g & 1 would keep them in memory.
    __m512 even[MR], odd[MR];
    for (int r = 0; r < MR; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    auto group = [&](int64_t g, __m512 (&acc)[MR], __m512 (&second)[MR]) {
      const __m128i* p = reinterpret_cast<const __m128i*>(q + g * kGroup);
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(srow + g * kGroup / kPerGroup) +
                       kPrefetchBytes / kPerGroup * static_cast<int64_t>(sizeof(Scale)),
                   _MM_HINT_T0);
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
      const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
      if constexpr (kPerGroup == 32) {
        const __m512 scale = _mm512_set1_ps(scale_value(srow[g]));
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + (r0 + r) * x_stride + g * kGroup;
          const __m512 t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xr)));
          acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
        }
      } else {
        const __m512 s0 = _mm512_set1_ps(scale_value(srow[2 * g])), s1 = _mm512_set1_ps(scale_value(srow[2 * g + 1]));
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + (r0 + r) * x_stride + g * kGroup;
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(w0, _mm512_loadu_ps(xr)), s0, acc[r]);
          second[r] = _mm512_fmadd_ps(_mm512_mul_ps(w1, _mm512_loadu_ps(xr + 16)), s1, second[r]);
        }
      }
    };
    int64_t g = 0;
    if constexpr (kPerGroup == 32) {
      for (; g + 1 < groups; g += 2) {
        group(g, even, odd);
        group(g + 1, odd, even);
      }
    }
    for (; g < groups; ++g) group(g, even, odd);
    for (int r = 0; r < MR; ++r)
      out[(r0 + r) * out_stride + n] =
          _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + (bias ? bias[n] : 0.f);
  }
}
#endif

#ifdef KVSERVE_QUANT_AVX2
// Q8_0 / Q6_K for MR activation rows (fp32 inputs, as the other paths): per group of 32 the
// int8 values widened to fp32 in four vectors; per-32 scales: the four products per lane
// summed, then times the scale into the accumulator; per-16 scales (Q6_K): each half's two
// products times its own scale, first half then second. One fixed order for every MR.
template <typename Scale, int MR>
void q8_rows_avx2(const int8_t* qs, const Q8Scales<Scale>& scales, int64_t n_begin, int64_t n_end, int64_t groups,
                  const float* x, int64_t x_stride, int64_t r0, float* out, int64_t out_stride, const float* bias) {
  constexpr int64_t kPerGroup = Q8Scales<Scale>::kPerGroup;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* q = qs + n * groups * kGroup;
    const Scale* srow = scales.row(n);
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* p = q + g * kGroup;
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
      __m256 w[4];
      for (int i = 0; i < 4; ++i)
        w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + (r0 + r) * x_stride + g * kGroup;
        if constexpr (kPerGroup == 32) {
          __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
          for (int i = 1; i < 4; ++i) t = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), t);
          acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(scale_value(srow[g])), acc[r]);
        } else {
          for (int h = 0; h < 2; ++h) {
            const __m256 t = _mm256_fmadd_ps(w[2 * h + 1], _mm256_loadu_ps(xr + 16 * h + 8),
                                             _mm256_mul_ps(w[2 * h], _mm256_loadu_ps(xr + 16 * h)));
            acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(scale_value(srow[2 * g + h])), acc[r]);
          }
        }
      }
    }
    for (int r = 0; r < MR; ++r) out[(r0 + r) * out_stride + n] = horizontal_sum(acc[r]) + (bias ? bias[n] : 0.f);
  }
}
#endif

template <typename Scale>
void q8_rows_portable(const int8_t* qs, const Q8Scales<Scale>& scales, int64_t n_begin, int64_t n_end, int64_t K,
                      const float* x, int64_t x_stride, int64_t r0, int64_t rows, float* out, int64_t out_stride,
                      const float* bias) {
  constexpr int64_t per_group = Q8Scales<Scale>::kPerGroup;
  for (int64_t r = r0; r < r0 + rows; ++r) {
    for (int64_t n = n_begin; n < n_end; ++n) {
      float acc = 0.f;
      for (int64_t g = 0; g < K / per_group; ++g) {
        const int8_t* q = qs + n * K + g * per_group;
        const float* xr = x + r * x_stride + g * per_group;
        float dot = 0.f;
        for (int64_t j = 0; j < per_group; ++j) dot += static_cast<float>(q[j]) * xr[j];
        acc += scales(n, g) * dot;
      }
      out[r * out_stride + n] = acc + (bias ? bias[n] : 0.f);
    }
  }
}

template <typename Scale>
void q8_linear_impl(torch::Tensor& out, const torch::Tensor& x, const int8_t* q, const Q8Scales<Scale>& scales,
                    int64_t N, int64_t K, const c10::optional<torch::Tensor>& bias) {
  const int64_t M = x.size(0), groups = K / kGroup;
  const float* xp = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  float* o = out.data_ptr<float>();
  const int64_t o_stride = out.stride(0);
  const float* b = optional_bias(bias, N);
  over_row_blocks(N, M, M * N * K, [&](int64_t n0, int64_t n1, int64_t r0, int64_t rows) {
#ifdef KVSERVE_Q4_AVX512
    if (!g_portable) {
      dispatch_rows<4>(rows, [&](auto mr) { q8_rows_avx512<Scale, decltype(mr)::value>(q, scales, n0, n1, groups, xp, x_stride, r0, o, o_stride, b); });
      return;
    }
#endif
#ifdef KVSERVE_QUANT_AVX2
    if (!g_portable) {
      dispatch_rows<4>(rows, [&](auto mr) { q8_rows_avx2<Scale, decltype(mr)::value>(q, scales, n0, n1, groups, xp, x_stride, r0, o, o_stride, b); });
      return;
    }
#endif
    q8_rows_portable(q, scales, n0, n1, K, xp, x_stride, r0, rows, o, o_stride, b);
  });
}

}  // namespace

void q8_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor d,
                   c10::optional<torch::Tensor> bias) {
  RECORD_FUNCTION("kvserve::q8_linear", std::vector<c10::IValue>());  // kvserve profile's label, every caller
  const int64_t N = qs.size(0), K = qs.size(1);
  check_linear_rows(x, out, N);
  TORCH_CHECK(qs.scalar_type() == torch::kInt8 && qs.is_contiguous() && K % kGroup == 0 && x.size(1) == K,
              "qs must be int8 [N, K] with K a multiple of 32");
  TORCH_CHECK(d.is_contiguous() && ((d.scalar_type() == torch::kInt16 && d.numel() == N * (K / kGroup)) ||
                                    (d.scalar_type() == torch::kFloat32 && d.numel() == N * (K / 16))),
              "d must be the fp16 bits (int16) of [N, K / 32] or fp32 [N, K / 16]");
  const int8_t* q = qs.data_ptr<int8_t>();
  if (d.scalar_type() == torch::kFloat32) {
    q8_linear_impl(out, x, q, Q8Scales<float>{d.data_ptr<float>(), K / 16}, N, K, bias);
  } else {
    q8_linear_impl(out, x, q, Q8Scales<uint16_t>{reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>()), K / kGroup},
                   N, K, bias);
  }
}

#if defined(__AVX2__)
// One group of q8_0_quantize, 8 lanes at a time: the scalar loop's amax (a NaN skipped as
// std::max skips it), scale, IEEE division and round-to-nearest-even, so the same codes (a NaN
// quotient, from an infinite weight, gives 0 as the scalar cast's low byte does). ~2.5x the
// scalar loop's rate on Gemma 3's table: 0.25-0.31 -> 0.10-0.12 s of every start (the LM head's
// and the embedding's blocks).
inline void q8_0_group(const float* x, c10::Half* scale, int8_t* q) {
  static_assert(kGroup == 32, "four 8-lane vectors a group");
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), amax);  // (|x| > amax ? |x| : amax)
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  *scale = fp16_rne(_mm_cvtss_f32(m) / 127.0f);
  const __m256 step = _mm256_set1_ps(std::max(static_cast<float>(*scale), 1e-30f));
  const __m256 low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
  __m256i codes[4];
  for (int i = 0; i < 4; ++i) {
    __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], step), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(high, _mm256_max_ps(low, r));
    r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));  // NaN -> 0
    codes[i] = _mm256_cvtps_epi32(r);
  }
  // Packing works within 128-bit lanes: 4-code runs come out as 0a 1a 2a 3a 0b 1b 2b 3b.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                                            _mm256_packs_epi32(codes[2], codes[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#else
inline void q8_0_group(const float* x, c10::Half* scale, int8_t* q) {
  float amax = 0.0f;
  for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::abs(x[j]));
  *scale = fp16_rne(amax / 127.0f);
  const float step = std::max(static_cast<float>(*scale), 1e-30f);
  for (int64_t j = 0; j < kGroup; ++j)
    q[j] = static_cast<int8_t>(std::min(std::max(std::nearbyint(x[j] / step), -127.0f), 127.0f));
}
#endif

// kvserve.quant.Q8Linear.from_float's Q8_0 quantization in one pass: per group of 32,
// d = fp16(amax / 127), q = rint(w / max(d, 1e-30)) in -127..127 (fp32, the same operations, so
// the same codes and scales for finite weights). The torch version took 1.2 s of an int4 engine
// start on Gemma 3's head.
std::vector<torch::Tensor> q8_0_quantize(torch::Tensor weight) {
  check_fp32_weight(weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % kGroup == 0, "Q8_0 needs in_features divisible by ", kGroup, ", got ", K);
  auto qs = torch::empty({N, K}, weight.options().dtype(torch::kInt8));
  auto d = torch::empty({N, K / kGroup}, weight.options().dtype(torch::kInt16));
  const float* w = weight.data_ptr<float>();
  int8_t* q = qs.data_ptr<int8_t>();
  c10::Half* scales = reinterpret_cast<c10::Half*>(d.data_ptr<int16_t>());
  at::parallel_for(0, N * K / kGroup, 1024, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) q8_0_group(w + g * kGroup, scales + g, q + g * kGroup);
  });
  return {qs, d};
}

// Whether Q8_0 blocks (qs int8 [N, K], d the fp16 bits of [N, K / 32]) read as rows (row_table.h:
// d * q in fp32) give weight [N, K]'s bits exactly, signed zeros and NaNs included: only then may
// they stand in for it (kvserve.row_table.Q8Table).
bool q8_0_reproduces(torch::Tensor weight, torch::Tensor qs, torch::Tensor d) {
  check_fp32_weight(weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  const RowTable table(qs, d, "qs");
  TORCH_CHECK(table.rows() == N && table.width() == K, "the blocks must have the weight's shape");
  const float* w = weight.data_ptr<float>();
  std::atomic<bool> same{true};
  at::parallel_for(0, N, 256, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(K);
    for (int64_t r = r0; r < r1 && same.load(std::memory_order_relaxed); ++r)
      if (std::memcmp(table.row(r, row.data()), w + r * K, K * sizeof(float)) != 0) same = false;
  });
  return same;
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> bias) {
  auto out = torch::empty({x.size(0), qs.size(0)}, x.options());
  q8_linear_out(out, x, qs, d, bias);
  return out;
}
