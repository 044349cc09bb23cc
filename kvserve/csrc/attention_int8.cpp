// Paged attention over an int8 cache (its heads rotated and quantized by kv_write.cpp): integer
// products of int16 queries and weights with the int8 keys and values.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_ops.h"
#include "attention_common.h"
#include "avx2_reduce.h"

#if defined(__AVX512BW__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// int8_chunk_scores' VNNI loop for the block's first kRows rows (a decode's block holds its
// query heads per KV head: 3 of 4 rows for SmolLM2's groups of 3, 1 for plain multi-head
// attention), so no padding row's products are computed. Two chains per row (even and odd
// pairs of dims): with one, the rows' chains waited on vpdpwssd's latency. Integer sums, so the
// same in any order. The chains are named: as arrays GCC kept them in memory, a store after
// every product (2x the scores' time).
template <int kRows>
__attribute__((always_inline)) inline void vnni_chunk_scores(const int16_t* const* q16, const int8_t* src, int64_t BS,
                                                             int64_t D, __mmask32 mask, int32_t (*isum)[kKeyChunk],
                                                             const int8_t* k_ahead, const int8_t* v_ahead) {
  static_assert(kRows >= 1 && kRows <= kRowBlock, "a row block's rows");
  __m512i e0 = _mm512_setzero_si512(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  const int16_t *q0 = q16[0], *q1 = q16[kRows > 1 ? 1 : 0], *q2 = q16[kRows > 2 ? 2 : 0], *q3 = q16[kRows > 3 ? 3 : 0];
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
    if constexpr (kRows > 1) {
      e1 = dpwssd_pair(e1, k0, q1 + 2 * dp);
      o1 = dpwssd_pair(o1, k1, q1 + 2 * dp + 2);
    }
    if constexpr (kRows > 2) {
      e2 = dpwssd_pair(e2, k0, q2 + 2 * dp);
      o2 = dpwssd_pair(o2, k1, q2 + 2 * dp + 2);
    }
    if constexpr (kRows > 3) {
      e3 = dpwssd_pair(e3, k0, q3 + 2 * dp);
      o3 = dpwssd_pair(o3, k1, q3 + 2 * dp + 2);
    }
  }
  _mm512_storeu_si512(isum[0], _mm512_add_epi32(e0, o0));
  if constexpr (kRows > 1) _mm512_storeu_si512(isum[1], _mm512_add_epi32(e1, o1));
  if constexpr (kRows > 2) _mm512_storeu_si512(isum[2], _mm512_add_epi32(e2, o2));
  if constexpr (kRows > 3) _mm512_storeu_si512(isum[3], _mm512_add_epi32(e3, o3));
}
#endif

// isum[b][t] = sum_d q16[b][d] * key(d, offset + t) of one block's keys ([D/2][BS][2]), for
// t < n_keys; 0 beyond; rows b < nr (the VNNI route computes only those; the others may compute
// all kRowBlock). With k_ahead (a decode), the same dims of a chunk ahead are fetched into
// L2 a line per step; with v_ahead, a line of the values at v_ahead every other step: the
// fetches ride along with the products, as in attention_tile.
inline void int8_chunk_scores(const int16_t* const* q16, const int8_t* kblock, int64_t BS, int64_t offset,
                              int64_t n_keys, int64_t D, int64_t nr, int32_t (*isum)[kKeyChunk],
                              const int8_t* k_ahead = nullptr, const int8_t* v_ahead = nullptr) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (!g_portable_int8_attention.load(std::memory_order_relaxed)) {
    const __mmask32 mask = n_keys >= kKeyChunk ? 0xFFFFFFFFu : (1u << (2 * n_keys)) - 1u;
    const int8_t* src = kblock + offset * 2;
    static_assert(kRowBlock == 4, "int8_chunk_scores dispatches one to four rows");
    switch (nr) {
      case 1: vnni_chunk_scores<1>(q16, src, BS, D, mask, isum, k_ahead, v_ahead); return;
      case 2: vnni_chunk_scores<2>(q16, src, BS, D, mask, isum, k_ahead, v_ahead); return;
      case 3: vnni_chunk_scores<3>(q16, src, BS, D, mask, isum, k_ahead, v_ahead); return;
      default: vnni_chunk_scores<4>(q16, src, BS, D, mask, isum, k_ahead, v_ahead); return;
    }
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

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// int8_partition_values' VNNI loop for the first kRows rows (see vnni_chunk_scores). Two chains
// per row (even and odd pairs of tokens).
template <int kRows>
void vnni_partition_values(const int16_t* w16, int64_t w_stride, int64_t num_chunks, const int8_t* const* vchunks,
                           const int64_t* num_pairs, int64_t D, int64_t d_begin, int64_t d_end, int32_t* products) {
  for (int64_t d0 = d_begin; d0 < d_end; d0 += kKeyChunk) {
    __m512i even[kRows], odd[kRows];
    for (int b = 0; b < kRows; ++b) even[b] = odd[b] = _mm512_setzero_si512();
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int8_t* src = vchunks[c] + d0 * 2;
      const int16_t* wc = w16 + c * kKeyChunk;
      int64_t j = 0;
      for (; j + 1 < num_pairs[c]; j += 2, src += 4 * D) {
        const __m512i v0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
        const __m512i v1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * D)));
#pragma GCC unroll 4
        for (int b = 0; b < kRows; ++b) {
          even[b] = dpwssd_pair(even[b], v0, wc + b * w_stride + 2 * j);
          odd[b] = dpwssd_pair(odd[b], v1, wc + b * w_stride + 2 * j + 2);
        }
      }
      if (j < num_pairs[c]) {
        const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#pragma GCC unroll 4
        for (int b = 0; b < kRows; ++b) even[b] = dpwssd_pair(even[b], v, wc + b * w_stride + 2 * j);
      }
    }
#pragma GCC unroll 4
    for (int b = 0; b < kRows; ++b) _mm512_storeu_si512(products + b * D + d0, _mm512_add_epi32(even[b], odd[b]));
  }
}
#endif

// products[b * D + d] (b < nr; the VNNI route computes only those, the others all kRowBlock, d in
// [d_begin, d_end)) = the sum over a key partition's
// chunks c < num_chunks of sum_t w16[b * w_stride + c * 16 + t] * value(t, d), where chunk c's
// 2 * num_pairs[c] tokens start at the pair row vchunks[c] of their block's values ([BS/2][D][2]).
// The sums stay in integer registers across the partition: it holds at most 128 tokens, and
// 128 * 32767 * 127 < 2^31.
inline void int8_partition_values(const int16_t* w16, int64_t w_stride, int64_t num_chunks,
                                  const int8_t* const* vchunks, const int64_t* num_pairs, int64_t D, int64_t d_begin,
                                  int64_t d_end, int64_t nr, int32_t* products) {
  static_assert(kKeyPartition * 32767LL * 127 < (1LL << 31), "a partition's int8 value sums must fit in int32");
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (!g_portable_int8_attention.load(std::memory_order_relaxed)) {
    switch (nr) {
      case 1: return vnni_partition_values<1>(w16, w_stride, num_chunks, vchunks, num_pairs, D, d_begin, d_end, products);
      case 2: return vnni_partition_values<2>(w16, w_stride, num_chunks, vchunks, num_pairs, D, d_begin, d_end, products);
      case 3: return vnni_partition_values<3>(w16, w_stride, num_chunks, vchunks, num_pairs, D, d_begin, d_end, products);
      default: return vnni_partition_values<4>(w16, w_stride, num_chunks, vchunks, num_pairs, D, d_begin, d_end, products);
    }
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
  constexpr int64_t kMaxGroups = 16;  // head dims up to 512 (32-dim groups)
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
        int8_chunk_scores(qg, kblock + g * group * BS, BS, offsets[c], nks[c], group, nr, isum,
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
      int8_partition_values(w16, row_floats, n, block_values, block_pairs, D, g * group, (g + 1) * group, nr, products);
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

}  // namespace

void paged_attention_int8(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kv_cache,
                          const torch::Tensor& kv_scales, const torch::Tensor& block_tables,
                          const torch::Tensor& seq_lens, const torch::Tensor& seq_ids,
                          const torch::Tensor& query_starts, const torch::Tensor& query_lens, double scale,
                          int64_t window, double softcap) {
  run_attention<int8_t>(out, q, kv_cache, kv_scales.data_ptr<c10::Half>(), block_tables, seq_lens, seq_ids,
                        query_starts, query_lens, scale, window, softcap);
  // The int8 cache holds rotated heads, so the outputs came out rotated: H is its own inverse.
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  float* out_data = out.data_ptr<float>();
  kvserve::parallel_for(0, T * H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) hadamard_(out_data + (i / H) * out.stride(0) + (i % H) * out.stride(1), D);
  });
}

void set_portable_int8_attention(bool portable) { g_portable_int8_attention = portable; }
