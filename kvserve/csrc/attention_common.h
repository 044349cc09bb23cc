// What the attention routes share (attention.cpp: the float, bf16 and fp16 caches' routes;
// attention_int8.cpp: the int8 cache's): the key chunks and partitions every route visits, the
// softmax's masks, and the step's work split (attention_impl), which each route's file
// instantiates for its cache types with its own tiles. In an anonymous namespace, as in the one
// file these came from: each file compiles its own copy.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_kernels.h"
#include "int8_kv.h"
#include "step_team.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

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
// visible_run as a lane mask.
inline __mmask16 visible_lanes(int64_t j0, int64_t n_keys, int64_t lo, int64_t hi) {
  const auto [t_lo, t_hi] = visible_run(j0, n_keys, lo, hi);
  return t_lo > t_hi ? static_cast<__mmask16>(0)
                     : static_cast<__mmask16>(((1u << (t_hi + 1)) - 1) & ~((1u << t_lo) - 1));
}
#endif

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

// The routes' tiles, each defined in its route's file (attention_impl instantiates only those of
// its file's cache types).
template <int64_t kD, typename cache_t>
void attention_tile(const float* q, int64_t q_s0, int64_t q_s1, float* out, int64_t o_s0, int64_t o_s1,
                    const cache_t* khead, const cache_t* vhead, const int32_t* table, int64_t BS,
                    int64_t d_runtime, int64_t G, int64_t first_query_pos, int64_t num_queries, int64_t first_row,
                    int64_t kvh, float scale, int64_t window, float softcap, int64_t key_begin, int64_t key_end,
                    float* partial, std::vector<float>& work);  // attention.cpp
template <int64_t kD>
void attention_tile_int8(const int16_t* q16, const float* q_scale, int64_t H, float* out, int64_t o_s0, int64_t o_s1,
                         const int8_t* khead, const int8_t* vhead, const c10::Half* kscales,
                         const c10::Half* vscales, const int32_t* table, int64_t BS, int64_t d_runtime, int64_t G,
                         int64_t first_query_pos, int64_t num_queries, int64_t first_row, int64_t kvh, float scale,
                         int64_t window, float softcap, int64_t key_begin, int64_t key_end, float* partial,
                         std::vector<float>& work);  // attention_int8.cpp
void rotated_int16_queries(const torch::Tensor& q, int64_t D, std::vector<int16_t>& q16,
                           std::vector<float>& q_scale);  // attention_int8.cpp

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

// paged_attention over a cache of cache_t (its arguments checked; scales: an int8 cache's): the
// head dims of the shipped models as constants, others at run time.
template <typename cache_t>
void run_attention(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kv_cache,
                   const c10::Half* scales, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                   const torch::Tensor& seq_ids, const torch::Tensor& query_starts, const torch::Tensor& query_lens,
                   double scale, int64_t window, double softcap) {
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
}

}  // namespace

// paged_attention over an int8 cache with its scales (attention_int8.cpp; the arguments checked).
void paged_attention_int8(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kv_cache,
                          const torch::Tensor& kv_scales, const torch::Tensor& block_tables,
                          const torch::Tensor& seq_lens, const torch::Tensor& seq_ids,
                          const torch::Tensor& query_starts, const torch::Tensor& query_lens, double scale,
                          int64_t window, double softcap);
