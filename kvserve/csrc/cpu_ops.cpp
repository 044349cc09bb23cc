// CPU kernels for the parts of a step where plain torch spends more time dispatching small
// ops than computing: RMSNorm, rotary embedding (+ Gemma's QK-norm), the paged KV-cache
// write, single-query paged attention, and the gated activation.
//
// Each kernel has a plain-torch twin in kvserve/ops.py that the tests compare it with; the
// Python side only calls these for fp32 activations on the CPU. Activations are fp32; the KV
// cache may be fp32, bf16 or fp16 and is read in place (no gathered copy of the blocks).
// Reductions run in fp32 with vectorised (reordered) sums; every row is computed the same way
// whatever the batch, so results do not depend on batch composition.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <limits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
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

}  // namespace

// out[t] = x[t] / rms(x[t]) * (offset + w): offset 0 is LLaMA's RMSNorm, 1 is Gemma's.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset) {
  check_fp32_cpu(x, "x");
  check_fp32_cpu(weight, "weight");
  const int64_t n = x.size(-1);
  auto x2 = x.reshape({-1, n}).contiguous();
  auto w = weight.contiguous();
  auto out = torch::empty_like(x2);
  const float* xp = x2.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float off = static_cast<float>(offset);
  at::parallel_for(0, x2.size(0), std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * n;
      const float r = inv_rms(row, n, eps);
      float* o = op + t * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = (row[i] * r) * (off + wp[i]);
    }
  });
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
  at::parallel_for(0, T * rotated_heads, std::max<int64_t>(1, 4096 / D), [&](int64_t begin, int64_t end) {
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

template <typename cache_t>
void write_kv_impl(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kv_cache,
                   const torch::Tensor& slot_mapping) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t slots_per_head = kv_cache.size(2) * kv_cache.size(3);
  cache_t* cache = kv_cache.data_ptr<cache_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int c = 0; c < 2; ++c) {
    const float* src = c == 0 ? kp : vp;
    const auto& t_src = c == 0 ? k : v;
    const int64_t s0 = t_src.stride(0), s1 = t_src.stride(1);
    for (int64_t h = 0; h < KVH; ++h) {
      cache_t* head = cache + (c * KVH + h) * slots_per_head * D;
      for (int64_t t = 0; t < T; ++t) {
        const float* x = src + t * s0 + h * s1;
        cache_t* dst = head + slots[t] * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) dst[i] = from_float<cache_t>(x[i]);
      }
    }
  }
}

}  // namespace

// Store k, v [T, KVH, D] (fp32, any row/head strides, contiguous head_dim) at their flat slots
// of kv_cache [2, KVH, num_blocks, block_size, D], converting to the cache's dtype.
void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache, torch::Tensor slot_mapping) {
  check_fp32_cpu(k, "k");
  check_fp32_cpu(v, "v");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k/v head_dim must be contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be a contiguous [2, KVH, NB, BS, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  auto slots = slot_mapping.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "write_kv_cache", [&] {
    write_kv_impl<scalar_t>(k, v, kv_cache, slots);
  });
}

namespace {

// Calls f(slot, position) for the keys at positions [first, n) of a sequence, in order;
// slot = block * block_size + offset indexes a head's [num_blocks * block_size, D] rows.
// While one block is read, the next is prefetched: blocks sit anywhere in the pool, so the
// hardware prefetcher cannot guess the next address (a shuffled pool read 2.5x slower).
template <typename T>
inline void prefetch_block(const T* head, int32_t block, int64_t block_bytes, int64_t block_size, int64_t head_dim) {
  const char* p = reinterpret_cast<const char*>(head + static_cast<int64_t>(block) * block_size * head_dim);
  for (int64_t off = 0; off < block_bytes; off += 64) __builtin_prefetch(p + off);
}

// `also`: a second head (the values, during the pass over the keys) whose blocks are
// prefetched alongside, so that the next pass finds them in cache.
template <typename T, typename F>
inline void for_each_key(const int32_t* table, int64_t block_size, int64_t first, int64_t n, const T* head,
                         int64_t head_dim, const T* also, F&& f) {
  const int64_t block_bytes = block_size * head_dim * static_cast<int64_t>(sizeof(T));
  const int64_t last_block = (n - 1) / block_size;
  int64_t j = first;
  for (int64_t b = first / block_size; j < n; ++b) {
    if (b == first / block_size && b + 1 <= last_block) prefetch_block(head, table[b + 1], block_bytes, block_size, head_dim);
    if (b + 2 <= last_block) prefetch_block(head, table[b + 2], block_bytes, block_size, head_dim);
    if (also != nullptr) prefetch_block(also, table[b], block_bytes, block_size, head_dim);
    const int64_t base = static_cast<int64_t>(table[b]) * block_size - b * block_size;
    const int64_t block_end = std::min(n, (b + 1) * block_size);
    for (; j < block_end; ++j) f(base + j, j);
  }
}

// Head sizes known at compile time (kD > 0) unroll into a few vector instructions.
template <int64_t kD, typename T>
inline float dot(const float* q, const T* k, int64_t d_runtime) {
  const int64_t D = kD > 0 ? kD : d_runtime;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < D; ++d) sum += q[d] * to_float(k[d]);
  return sum;
}

// A cache row in fp32: converted once, then read by all G query heads of its KV head.
template <int64_t kD, typename T>
inline const float* widen(const T* row, float* buf, int64_t d_runtime) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    const int64_t D = kD > 0 ? kD : d_runtime;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) buf[d] = to_float(row[d]);
    return buf;
  }
}

template <int64_t kD, typename T>
inline void axpy(float p, const T* v, float* acc, int64_t d_runtime) {
  const int64_t D = kD > 0 ? kD : d_runtime;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] += p * to_float(v[d]);
}

template <int64_t kHeadDim, typename cache_t>
void decode_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kv_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                           const torch::Tensor& seq_ids, const torch::Tensor& rows, double scale, int64_t window,
                           double softcap) {
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t KVH = kv_cache.size(1), NB = kv_cache.size(2), BS = kv_cache.size(3);
  const int64_t G = H / KVH;
  const int64_t num_decode = seq_ids.size(0);
  const int64_t table_width = block_tables.size(1);
  const cache_t* keys = kv_cache.data_ptr<cache_t>();
  const cache_t* values = keys + KVH * NB * BS * D;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* seqs = seq_ids.data_ptr<int64_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);

  int64_t longest = 1;
  for (int64_t i = 0; i < num_decode; ++i) longest = std::max<int64_t>(longest, lens[seqs[i]]);
  if (window > 0) longest = std::min(longest, window);
  // One (sequence, kv head) pair per work item; small steps stay on one thread.
  const int64_t grain = std::max<int64_t>(1, 8192 / (longest * G));

  at::parallel_for(0, num_decode * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * D), row_f32(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / KVH, kvh = item % KVH;
      const int64_t s = seqs[i], row = row_of[i];
      const int64_t n = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const int64_t L = n - first;
      scores.resize(G * L);
      const int32_t* table = tables + s * table_width;
      const float* qrow = qp + row * q_s0 + kvh * G * q_s1;
      const cache_t* khead = keys + kvh * NB * BS * D;
      const cache_t* vhead = values + kvh * NB * BS * D;

      // Scores: each key row is read once and used by the G query heads sharing it.
      for_each_key(table, BS, first, n, khead, D, vhead, [&](int64_t slot, int64_t j) {
        const float* k = widen<kHeadDim>(khead + slot * D, row_f32.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          float sc = dot<kHeadDim>(qrow + g * q_s1, k, D) * fscale;
          if (fcap > 0.f) sc = std::tanh(sc / fcap) * fcap;
          scores[g * L + (j - first)] = sc;
        }
      });
      // Softmax per query head, unnormalised; the 1/sum is applied to the output.
      std::vector<float> inv_sum(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = sg[0];
        for (int64_t j = 1; j < L; ++j) m = std::max(m, sg[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < L; ++j) {
          sg[j] = exp_nonpositive(sg[j] - m);
          sum += sg[j];
        }
        inv_sum[g] = 1.0f / sum;
      }
      // Weighted sum of the value rows, again one read per row for all G heads.
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_key(table, BS, first, n, vhead, D, static_cast<const cache_t*>(nullptr), [&](int64_t slot, int64_t j) {
        const float* v = widen<kHeadDim>(vhead + slot * D, row_f32.data(), D);
        for (int64_t g = 0; g < G; ++g) axpy<kHeadDim>(scores[g * L + (j - first)], v, acc.data() + g * D, D);
      });
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + row * o_s0 + (kvh * G + g) * o_s1;
        const float* a = acc.data() + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv_sum[g];
      }
    }
  });
}

}  // namespace

// Single-query attention over the paged cache for the decode rows of a step, reading each
// sequence's blocks in place. For decode sequence i (a sequence index seq_ids[i] into
// block_tables/seq_lens), query row rows[i] of q [T, H, D] attends to keys
// [max(0, n - window), n) with n = seq_lens[seq]; the result goes to out[rows[i]].
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, torch::Tensor seq_ids, torch::Tensor rows, double scale,
                            int64_t window, double softcap) {
  check_fp32_cpu(q, "q");
  check_fp32_cpu(out, "out");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1, "q/out must be [T, H, D], head_dim contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be a contiguous [2, KVH, NB, BS, D]");
  TORCH_CHECK(q.size(1) % kv_cache.size(1) == 0 && q.size(2) == kv_cache.size(4), "q heads do not match the cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(), "seq_lens: int32");
  TORCH_CHECK(seq_ids.scalar_type() == torch::kInt64 && rows.scalar_type() == torch::kInt64, "seq_ids/rows: int64");
  auto seqs = seq_ids.contiguous();
  auto rws = rows.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "paged_decode_attention", [&] {
    const int64_t head_dim = q.size(2);
    auto run = [&](auto head_dim_constant) {
      decode_attention_impl<decltype(head_dim_constant)::value, scalar_t>(out, q, kv_cache, block_tables, seq_lens,
                                                                        seqs, rws, scale, window, softcap);
    };
    if (head_dim == 64) run(std::integral_constant<int64_t, 64>{});
    else if (head_dim == 128) run(std::integral_constant<int64_t, 128>{});
    else if (head_dim == 256) run(std::integral_constant<int64_t, 256>{});
    else run(std::integral_constant<int64_t, 0>{});
  });
}

namespace {

constexpr int64_t kKeyChunk = 16;  // keys per inner tile: one 16-float vector of scores
constexpr int64_t kQueryTile = 16;  // queries per work item (times G heads = rows)
constexpr int64_t kRowBlock = 4;  // score rows computed together

// Multi-query (prefill) attention for one sequence, one KV head and a tile of queries,
// flash-style: keys are visited in chunks of <= 16 from the paged cache, each chunk widened
// to fp32 and transposed once ([D][16]) so that every score row is 16-wide vector FMAs with
// no horizontal sums; the softmax is online (running max and sum per row).
template <int64_t kD, typename cache_t>
void prefill_tile(const float* q, int64_t q_s0, int64_t q_s1, float* out, int64_t o_s0, int64_t o_s1,
                  const cache_t* khead, const cache_t* vhead, const int32_t* table, int64_t BS,
                  int64_t d_runtime, int64_t G, int64_t first_query_pos, int64_t num_queries, int64_t first_row, int64_t kvh,
                  float scale, int64_t window, float softcap, std::vector<float>& work) {
  const int64_t D = kD > 0 ? kD : d_runtime;
  const int64_t rows = num_queries * G;
  work.resize(rows * D + 2 * rows + D * kKeyChunk + kKeyChunk * D);
  float* acc = work.data();  // [rows, D]
  float* row_max = acc + rows * D;
  float* row_sum = row_max + rows;
  float* kt = row_sum + rows;  // [D, 16] transposed key chunk
  float* vc = kt + D * kKeyChunk;  // [16, D] value chunk
  std::fill(acc, acc + rows * D, 0.f);
  std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + rows, 0.f);

  const int64_t last_query_pos = first_query_pos + num_queries - 1;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_query_pos - window + 1) : 0;
  for (int64_t j0 = first_key; j0 <= last_query_pos;) {
    // A chunk never crosses a paged block.
    const int64_t block_end = (j0 / BS + 1) * BS;
    const int64_t j1 = std::min({j0 + kKeyChunk, block_end, last_query_pos + 1});
    const int64_t n_keys = j1 - j0;
    const int64_t slot0 = static_cast<int64_t>(table[j0 / BS]) * BS + j0 % BS;
    for (int64_t t = 0; t < kKeyChunk; ++t) {
      if (t < n_keys) {
        const cache_t* k = khead + (slot0 + t) * D;
        const cache_t* v = vhead + (slot0 + t) * D;
        for (int64_t d = 0; d < D; ++d) kt[d * kKeyChunk + t] = to_float(k[d]);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vc[t * D + d] = to_float(v[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) kt[d * kKeyChunk + t] = 0.f;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vc[t * D + d] = 0.f;
      }
    }
    // Rows in blocks of kRowBlock: the key/value vectors loaded once serve all of them, and
    // their accumulators are independent FMA chains (one chain per row would stall on latency).
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t nr = std::min(kRowBlock, rows - r0);
      const float* qr[kRowBlock];
      int64_t lo[kRowBlock], hi[kRowBlock];
      bool any_visible = false;
      for (int64_t b = 0; b < kRowBlock; ++b) {
        const int64_t r = r0 + std::min(b, nr - 1);  // padding rows repeat the last one, unused
        const int64_t qi = r / G, g = r % G;
        qr[b] = q + (first_row + qi) * q_s0 + (kvh * G + g) * q_s1;
        hi[b] = first_query_pos + qi;  // the query's own position: its last visible key
        lo[b] = window > 0 ? hi[b] - window + 1 : 0;
        any_visible |= j0 <= hi[b] && j1 > lo[b];
      }
      if (!any_visible) continue;

      float sc[kRowBlock][kKeyChunk];
      float sc_odd[kRowBlock][kKeyChunk];  // a second partial sum over d: two chains per row
      for (int64_t b = 0; b < kRowBlock; ++b) {
#pragma omp simd
        for (int64_t t = 0; t < kKeyChunk; ++t) sc[b][t] = sc_odd[b][t] = 0.f;
      }
      for (int64_t d = 0; d < D; d += 2) {
        const float* k0 = kt + d * kKeyChunk;
        const float* k1 = k0 + kKeyChunk;
        for (int64_t b = 0; b < kRowBlock; ++b) {
          const float q0 = qr[b][d], q1 = qr[b][d + 1];
#pragma omp simd
          for (int64_t t = 0; t < kKeyChunk; ++t) {
            sc[b][t] += q0 * k0[t];
            sc_odd[b][t] += q1 * k1[t];
          }
        }
      }

      float p[kRowBlock][kKeyChunk];
      float correction[kRowBlock];
      for (int64_t b = 0; b < nr; ++b) {
        const int64_t r = r0 + b;
        float chunk_max = -std::numeric_limits<float>::infinity();
        float x[kKeyChunk];
        bool visible[kKeyChunk];
#pragma omp simd reduction(max : chunk_max)
        for (int64_t t = 0; t < kKeyChunk; ++t) {
          const int64_t key = j0 + t;
          visible[t] = t < n_keys && key <= hi[b] && key >= lo[b];
          float v = (sc[b][t] + sc_odd[b][t]) * scale;
          if (softcap > 0.f) v = std::tanh(v / softcap) * softcap;
          x[t] = v;
          chunk_max = std::max(chunk_max, visible[t] ? v : -std::numeric_limits<float>::infinity());
        }
        if (chunk_max == -std::numeric_limits<float>::infinity()) {  // nothing visible to this row
          correction[b] = 1.f;
#pragma omp simd
          for (int64_t t = 0; t < kKeyChunk; ++t) p[b][t] = 0.f;
          continue;
        }
        const float new_max = std::max(row_max[r], chunk_max);
        correction[b] = exp_nonpositive(row_max[r] - new_max);  // ~0 on the row's first chunk
        float p_sum = 0.f;
#pragma omp simd reduction(+ : p_sum)
        for (int64_t t = 0; t < kKeyChunk; ++t) {
          p[b][t] = visible[t] ? exp_nonpositive(x[t] - new_max) : 0.f;
          p_sum += p[b][t];
        }
        row_sum[r] = row_sum[r] * correction[b] + p_sum;
        row_max[r] = new_max;
      }
      for (int64_t b = nr; b < kRowBlock; ++b) {
        correction[b] = 1.f;
        for (int64_t t = 0; t < kKeyChunk; ++t) p[b][t] = 0.f;
      }

      // acc[r] = acc[r] * correction + sum_t p[r][t] v[t], 16 columns of d at a time, two
      // chains per row (even and odd keys). Masked keys have p = 0 and zeroed value rows.
      for (int64_t d0 = 0; d0 < D; d0 += kKeyChunk) {
        float even[kRowBlock][kKeyChunk], odd[kRowBlock][kKeyChunk];
        for (int64_t b = 0; b < kRowBlock; ++b) {
          const float* a = acc + std::min(r0 + b, rows - 1) * D + d0;
#pragma omp simd
          for (int64_t i = 0; i < kKeyChunk; ++i) {
            even[b][i] = a[i] * correction[b];
            odd[b][i] = 0.f;
          }
        }
        for (int64_t t = 0; t < kKeyChunk; t += 2) {
          const float* v0 = vc + t * D + d0;
          const float* v1 = v0 + D;
          for (int64_t b = 0; b < kRowBlock; ++b) {
            const float p0 = p[b][t], p1 = p[b][t + 1];
#pragma omp simd
            for (int64_t i = 0; i < kKeyChunk; ++i) {
              even[b][i] += p0 * v0[i];
              odd[b][i] += p1 * v1[i];
            }
          }
        }
        for (int64_t b = 0; b < nr; ++b) {
          float* a = acc + (r0 + b) * D + d0;
#pragma omp simd
          for (int64_t i = 0; i < kKeyChunk; ++i) a[i] = even[b][i] + odd[b][i];
        }
      }
    }
    j0 = j1;
  }
  for (int64_t qi = 0; qi < num_queries; ++qi) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = qi * G + g;
      float* o = out + (first_row + qi) * o_s0 + (kvh * G + g) * o_s1;
      const float inv = 1.0f / row_sum[r];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
    }
  }
}

template <int64_t kD, typename cache_t>
void prefill_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kv_cache,
                            const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                            const torch::Tensor& seq_ids, const torch::Tensor& query_starts,
                            const torch::Tensor& query_lens, double scale, int64_t window, double softcap) {
  const int64_t H = q.size(1), D = kD > 0 ? kD : q.size(2);
  const int64_t KVH = kv_cache.size(1), NB = kv_cache.size(2), BS = kv_cache.size(3);
  const int64_t G = H / KVH;
  const int64_t table_width = block_tables.size(1);
  const cache_t* keys = kv_cache.data_ptr<cache_t>();
  const cache_t* values = keys + KVH * NB * BS * D;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* seqs = seq_ids.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* qlens = query_lens.data_ptr<int64_t>();

  // Work items: (sequence, query tile, kv head). A causal tile costs in proportion to its
  // position, and parallel_for hands each thread a contiguous range: so the tiles of a
  // sequence are listed first, last, second, second to last... to give every range a mix.
  std::vector<std::array<int64_t, 3>> items;
  for (int64_t i = 0; i < seq_ids.size(0); ++i) {
    const int64_t num_tiles = (qlens[i] + kQueryTile - 1) / kQueryTile;
    for (int64_t k = 0; k < num_tiles; ++k) {
      const int64_t tile = k % 2 == 0 ? k / 2 : num_tiles - 1 - k / 2;
      for (int64_t kvh = 0; kvh < KVH; ++kvh) items.push_back({i, tile * kQueryTile, kvh});
    }
  }

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    for (int64_t it = begin; it < end; ++it) {
      const auto [i, t0, kvh] = items[it];
      const int64_t s = seqs[i];
      const int64_t num_queries = std::min(kQueryTile, qlens[i] - t0);
      const int64_t first_query_pos = lens[s] - qlens[i] + t0;
      prefill_tile<kD, cache_t>(q.data_ptr<float>(), q.stride(0), q.stride(1), out.data_ptr<float>(),
                                out.stride(0), out.stride(1), keys + kvh * NB * BS * D, values + kvh * NB * BS * D,
                                tables + s * table_width, BS, D, G, first_query_pos, num_queries, starts[i] + t0,
                                kvh, static_cast<float>(scale), window, static_cast<float>(softcap), work);
    }
  });
}

}  // namespace

// Causal attention for the prefill chunks of a step over the paged cache (which already
// holds their new keys): sequence seq_ids[i] has query_lens[i] queries at rows
// query_starts[i].. of q [T, H, D], the last at position seq_lens[seq] - 1; query at position
// p sees keys (p - window, p]. Results go to the same rows of out.
void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                             torch::Tensor seq_lens, torch::Tensor seq_ids, torch::Tensor query_starts,
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "paged_prefill_attention", [&] {
    if (q.size(2) == 64) {
      prefill_attention_impl<64, scalar_t>(out, q, kv_cache, block_tables, seq_lens, seq_ids, query_starts,
                                           query_lens, scale, window, softcap);
    } else if (q.size(2) == 256) {
      prefill_attention_impl<256, scalar_t>(out, q, kv_cache, block_tables, seq_lens, seq_ids, query_starts,
                                            query_lens, scale, window, softcap);
    } else {
      prefill_attention_impl<0, scalar_t>(out, q, kv_cache, block_tables, seq_lens, seq_ids, query_starts,
                                          query_lens, scale, window, softcap);
    }
  });
}

// act(gate) * up for x = [gate | up] of shape [T, 2 I]; act 0 = SiLU, 1 = tanh-approximated GELU.
torch::Tensor act_and_mul(torch::Tensor x, int64_t act) {
  check_fp32_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [T, 2 I] with contiguous rows");
  const int64_t T = x.size(0), I = x.size(1) / 2, stride = x.stride(0);
  auto out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = xp + t * stride;
      const float* up = gate + I;
      float* o = op + t * I;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("advise_huge_pages", &advise_huge_pages);
  m.def("rms_norm", &rms_norm);
  m.def("rope_qk_", &rope_qk_);
  m.def("write_kv_cache", &write_kv_cache);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("paged_prefill_attention", &paged_prefill_attention);
  m.def("act_and_mul", &act_and_mul);
}
