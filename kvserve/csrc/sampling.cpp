// The sampler's and the LM head's row kernels: top-k, the screened LM head's logits and argmax,
// random sampling, top-p, log-sum-exp, and structured outputs' token bitmask.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_ops.h"
#include "cpu_kernels.h"
#include "dense_linear.h"
#include "screen_linear.h"
#include "step_team.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

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
