// Linear layers on block-quantized weights for a few activation rows, the shape of decode.
//
// A decode step reads every weight once per token, so its speed is the speed at which
// weights stream from memory: the kernels below read GGUF's 4- and 8-bit blocks as stored
// and do the arithmetic as they go, one pass over the weights for all rows of the step.
//
//   Q4_1 (kvserve int4): groups of 32 weights w = d * q + m, q in 0..15, d and m fp16.
//     y = sum_g d_g * (q_g . x_g) + m_g * sum(x_g). The q . x products run in bf16 with fp32
//     sums (vdpbf16ps: q is exact in bf16, x is rounded to bf16 once, as every bf16 matmul
//     does); sum(x_g) is taken in fp32.
//   Q8_0 (the int4 mode's LM head, as llama.cpp stores it): groups of 32, w = d * q,
//     q in -127..127. fp32 products.
//
// Every output row is computed in the same order whatever the number of activation rows, so
// results do not depend on batch composition. Without AVX512-BF16 a portable loop computes
// the same sums (in another order).
#include "quant_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__)
#include <immintrin.h>
#define KVSERVE_Q4_AVX512 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kChunk = 64;        // two groups: one 512-bit vector of bf16 weights
constexpr int64_t kRowsPerTask = 16;  // output rows per task: their weights stay in cache while every input row uses them
constexpr int64_t kInputRowBlock = 4;  // input rows sharing one decode of the weights

bool g_portable = false;

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

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

// The activations of one Q4_1 call, laid out for the kernel: per 64-input chunk, the bf16
// inputs paired with the low nibbles (inputs 0-15 and 32-47) then with the high nibbles
// (16-31 and 48-63), and each group's fp32 sum divided by 8 (exact) in the 8 lanes whose
// products belong to that group.
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
#ifdef KVSERVE_Q4_AVX512
        if ((c + 1) * kChunk <= K) {
          const float* xc = xr + c * kChunk;
          const __m512 a0 = _mm512_loadu_ps(xc), a1 = _mm512_loadu_ps(xc + 16);
          const __m512 b0 = _mm512_loadu_ps(xc + 32), b1 = _mm512_loadu_ps(xc + 48);
          // round to nearest even, as torch's fp32 -> bf16 conversion
          _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b0, a0));
          _mm512_storeu_si512(dst + 32, (__m512i)_mm512_cvtne2ps_pbh(b1, a1));
          const float sum_a = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) * 0.125f;
          const float sum_b = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1)) * 0.125f;
          _mm512_storeu_ps(sums, _mm512_insertf32x8(_mm512_set1_ps(sum_a), _mm256_set1_ps(sum_b), 1));
          continue;
        }
#endif
        for (int64_t half = 0; half < 2; ++half) {  // group 2c, then 2c + 1
          const int64_t base = c * kChunk + half * kGroup;
          float sum = 0.f;
          for (int64_t j = 0; j < kGroup; ++j) {
            const float v = base + j < K ? xr[base + j] : 0.f;
            sum += v;
            // nibble j < 16 (low) pairs with word half * 16 + j of the low vector
            dst[(j < 16 ? 0 : 32) + half * 16 + (j & 15)] = float_to_bf16_rne(v);
          }
          for (int64_t l = 0; l < 8; ++l) sums[half * 8 + l] = sum * 0.125f;
        }
      }
    }
  }
};

#ifdef KVSERVE_Q4_AVX512
template <int MR>
void q4_rows_avx512(const uint8_t* qs, const uint16_t* dm, int64_t n_begin, int64_t n_end, int64_t chunks,
                    const Q4Activations& act, int64_t r0, float* out, int64_t out_stride, const float* bias) {
  alignas(64) uint16_t table_words[32];
  for (int i = 0; i < 32; ++i) table_words[i] = float_to_bf16_rne(static_cast<float>(i & 15));
  const __m512i table = _mm512_load_si512(table_words);
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  const __m512i idx_d = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i idx_m = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  const uint16_t* xb[MR];
  const float* gs[MR];
  for (int r = 0; r < MR; ++r) {
    xb[r] = act.xb.data() + (r0 + r) * chunks * kChunk;
    gs[r] = act.group_sums.data() + (r0 + r) * chunks * 16;
  }
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* q = qs + n * chunks * 32;
    const uint16_t* s = dm + n * chunks * 4;
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32)));
      const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, low_nibble), table);
      const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
      const __m512 dm4 = _mm512_castps128_ps512(
          _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + c * 4))));
      const __m512 dv = _mm512_permutexvar_ps(idx_d, dm4);
      const __m512 mv = _mm512_permutexvar_ps(idx_m, dm4);
      for (int r = 0; r < MR; ++r) {
        const uint16_t* x = xb[r] + c * kChunk;
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(x));
        t = _mm512_dpbf16_ps(t, hi, (__m512bh)_mm512_loadu_si512(x + 32));
        const __m512 term = _mm512_fmadd_ps(t, dv, _mm512_mul_ps(mv, _mm512_loadu_ps(gs[r] + c * 16)));
        acc[r][c & 1] = _mm512_add_ps(acc[r][c & 1], term);
      }
    }
    for (int r = 0; r < MR; ++r)
      out[(r0 + r) * out_stride + n] =
          _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + (bias ? bias[n] : 0.f);
  }
}

// One activation row (decode): two output rows per pass share the activation loads and give
// the core two independent chains of dot products.
void q4_row_pairs_avx512(const uint8_t* qs, const uint16_t* dm, int64_t n_begin, int64_t n_end, int64_t chunks,
                         const Q4Activations& act, int64_t r0, float* out, const float* bias) {
  alignas(64) uint16_t table_words[32];
  for (int i = 0; i < 32; ++i) table_words[i] = float_to_bf16_rne(static_cast<float>(i & 15));
  const __m512i table = _mm512_load_si512(table_words);
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  const __m512i idx_d = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i idx_m = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  const uint16_t* xb = act.xb.data() + r0 * chunks * kChunk;
  const float* gs = act.group_sums.data() + r0 * chunks * 16;
  int64_t n = n_begin;
  for (; n + 1 < n_end; n += 2) {
    __m512 acc[2][2] = {{_mm512_setzero_ps(), _mm512_setzero_ps()}, {_mm512_setzero_ps(), _mm512_setzero_ps()}};
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512bh x_lo = (__m512bh)_mm512_loadu_si512(xb + c * kChunk);
      const __m512bh x_hi = (__m512bh)_mm512_loadu_si512(xb + c * kChunk + 32);
      const __m512 g = _mm512_loadu_ps(gs + c * 16);
      for (int j = 0; j < 2; ++j) {
        const uint8_t* q = qs + (n + j) * chunks * 32;
        const uint16_t* s = dm + (n + j) * chunks * 4;
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, low_nibble), table);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
        const __m512 dm4 = _mm512_castps128_ps512(
            _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + c * 4))));
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, x_lo);
        t = _mm512_dpbf16_ps(t, hi, x_hi);
        const __m512 term = _mm512_fmadd_ps(t, _mm512_permutexvar_ps(idx_d, dm4),
                                            _mm512_mul_ps(_mm512_permutexvar_ps(idx_m, dm4), g));
        acc[j][c & 1] = _mm512_add_ps(acc[j][c & 1], term);
      }
    }
    for (int j = 0; j < 2; ++j)
      out[n + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1])) + (bias ? bias[n + j] : 0.f);
  }
  if (n < n_end) q4_rows_avx512<1>(qs, dm, n, n_end, chunks, act, r0, out, 0, bias);
}
#endif

void q4_rows_portable(const uint8_t* qs, const uint16_t* dm, int64_t n_begin, int64_t n_end, int64_t chunks,
                      const Q4Activations& act, int64_t r0, int64_t rows, float* out, int64_t out_stride,
                      const float* bias) {
  for (int64_t r = r0; r < r0 + rows; ++r) {
    for (int64_t n = n_begin; n < n_end; ++n) {
      float acc = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* q = qs + (n * chunks + c) * 32;
        const uint16_t* s = dm + (n * chunks + c) * 4;
        const uint16_t* x = act.xb.data() + (r * chunks + c) * kChunk;
        const float* sums = act.group_sums.data() + (r * chunks + c) * 16;
        for (int half = 0; half < 2; ++half) {
          float dot = 0.f;
          for (int j = 0; j < 16; ++j) {
            const uint8_t byte = q[half * 16 + j];
            dot += static_cast<float>(byte & 15) * bf16_to_float(x[half * 16 + j]) +
                   static_cast<float>(byte >> 4) * bf16_to_float(x[32 + half * 16 + j]);
          }
          acc += half_to_float(s[half]) * dot + half_to_float(s[2 + half]) * sums[half * 8] * 8.f;
        }
      }
      out[r * out_stride + n] = acc + (bias ? bias[n] : 0.f);
    }
  }
}

void check_weight_rows(const torch::Tensor& x, const torch::Tensor& out, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a float32 CPU [M, K] tensor with contiguous rows");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == N && out.stride(1) == 1,
              "out must be float32 [M, N] with contiguous rows");
}

// Output rows in tasks of kRowsPerTask spread over the threads (one thread for a call too small
// to be worth waking the others), input rows in blocks of kInputRowBlock within each task:
// calls block(first output row, end output row, first input row, input rows).
template <typename Block>
void over_row_blocks(int64_t N, int64_t M, int64_t work, const Block& block) {
  const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t grain = work < (1 << 18) ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * kRowsPerTask, n1 = std::min(N, t1 * kRowsPerTask);
    for (int64_t r0 = 0; r0 < M; r0 += kInputRowBlock) block(n0, n1, r0, std::min(kInputRowBlock, M - r0));
  });
}

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
              "bias must be a contiguous float32 [N]");
  return bias->data_ptr<float>();
}

}  // namespace

void set_portable_quant_kernels(bool portable) { g_portable = portable; }

void q4_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor dm,
                   c10::optional<torch::Tensor> bias) {
  const int64_t N = qs.size(0), Kp = qs.size(1) * 2, M = x.size(0), K = x.size(1);
  check_weight_rows(x, out, N);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && Kp % kChunk == 0 && K <= Kp &&
                  Kp - K < kChunk,
              "qs must be uint8 [N, ceil(K / 64) * 32]");
  TORCH_CHECK(dm.scalar_type() == torch::kInt16 && dm.is_contiguous() && dm.numel() == N * (Kp / kChunk) * 4,
              "dm must be the fp16 bits (int16) of [N, K / 64, 4] = (d, d, m, m) per chunk");
  const int64_t chunks = Kp / kChunk;
  const Q4Activations act(x.data_ptr<float>(), x.stride(0), M, K, Kp);
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>());
  float* o = out.data_ptr<float>();
  const int64_t o_stride = out.stride(0);
  const float* b = bias_ptr(bias, N);
  over_row_blocks(N, M, M * N * Kp, [&](int64_t n0, int64_t n1, int64_t r0, int64_t rows) {
#ifdef KVSERVE_Q4_AVX512
    if (!g_portable) {
      switch (rows) {
        case 1: q4_row_pairs_avx512(q, s, n0, n1, chunks, act, r0, o + r0 * o_stride, b); break;
        case 2: q4_rows_avx512<2>(q, s, n0, n1, chunks, act, r0, o, o_stride, b); break;
        case 3: q4_rows_avx512<3>(q, s, n0, n1, chunks, act, r0, o, o_stride, b); break;
        default: q4_rows_avx512<4>(q, s, n0, n1, chunks, act, r0, o, o_stride, b); break;
      }
      return;
    }
#endif
    q4_rows_portable(q, s, n0, n1, chunks, act, r0, rows, o, o_stride, b);
  });
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm, c10::optional<torch::Tensor> bias) {
  auto out = torch::empty({x.size(0), qs.size(0)}, x.options());
  q4_linear_out(out, x, qs, dm, bias);
  return out;
}

namespace {

#ifdef KVSERVE_Q4_AVX512
template <int MR>
void q8_rows_avx512(const int8_t* qs, const uint16_t* d, int64_t n_begin, int64_t n_end, int64_t groups,
                    const float* x, int64_t x_stride, int64_t r0, float* out, int64_t out_stride, const float* bias) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* q = qs + n * groups * kGroup;
    const uint16_t* s = d + n * groups;
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m128i* p = reinterpret_cast<const __m128i*>(q + g * kGroup);
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
      const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
      const __m512 scale = _mm512_set1_ps(half_to_float(s[g]));
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + (r0 + r) * x_stride + g * kGroup;
        const __m512 t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xr)));
        acc[r][g & 1] = _mm512_fmadd_ps(t, scale, acc[r][g & 1]);
      }
    }
    for (int r = 0; r < MR; ++r)
      out[(r0 + r) * out_stride + n] =
          _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + (bias ? bias[n] : 0.f);
  }
}
#endif

void q8_rows_portable(const int8_t* qs, const uint16_t* d, int64_t n_begin, int64_t n_end, int64_t groups,
                      const float* x, int64_t x_stride, int64_t r0, int64_t rows, float* out, int64_t out_stride,
                      const float* bias) {
  for (int64_t r = r0; r < r0 + rows; ++r) {
    for (int64_t n = n_begin; n < n_end; ++n) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* q = qs + (n * groups + g) * kGroup;
        const float* xr = x + r * x_stride + g * kGroup;
        float dot = 0.f;
        for (int64_t j = 0; j < kGroup; ++j) dot += static_cast<float>(q[j]) * xr[j];
        acc += half_to_float(d[n * groups + g]) * dot;
      }
      out[r * out_stride + n] = acc + (bias ? bias[n] : 0.f);
    }
  }
}

}  // namespace

void q8_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor d,
                   c10::optional<torch::Tensor> bias) {
  const int64_t N = qs.size(0), K = qs.size(1), M = x.size(0);
  check_weight_rows(x, out, N);
  TORCH_CHECK(qs.scalar_type() == torch::kInt8 && qs.is_contiguous() && K % kGroup == 0 && x.size(1) == K,
              "qs must be int8 [N, K] with K a multiple of 32");
  TORCH_CHECK(d.scalar_type() == torch::kInt16 && d.is_contiguous() && d.numel() == N * (K / kGroup),
              "d must be the fp16 bits (int16) of [N, K / 32]");
  const int64_t groups = K / kGroup;
  const int8_t* q = qs.data_ptr<int8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>());
  const float* xp = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  float* o = out.data_ptr<float>();
  const int64_t o_stride = out.stride(0);
  const float* b = bias_ptr(bias, N);
  over_row_blocks(N, M, M * N * K, [&](int64_t n0, int64_t n1, int64_t r0, int64_t rows) {
#ifdef KVSERVE_Q4_AVX512
    if (!g_portable) {
      switch (rows) {
        case 1: q8_rows_avx512<1>(q, s, n0, n1, groups, xp, x_stride, r0, o, o_stride, b); break;
        case 2: q8_rows_avx512<2>(q, s, n0, n1, groups, xp, x_stride, r0, o, o_stride, b); break;
        case 3: q8_rows_avx512<3>(q, s, n0, n1, groups, xp, x_stride, r0, o, o_stride, b); break;
        default: q8_rows_avx512<4>(q, s, n0, n1, groups, xp, x_stride, r0, o, o_stride, b); break;
      }
      return;
    }
#endif
    q8_rows_portable(q, s, n0, n1, groups, xp, x_stride, r0, rows, o, o_stride, b);
  });
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> bias) {
  auto out = torch::empty({x.size(0), qs.size(0)}, x.options());
  q8_linear_out(out, x, qs, d, bias);
  return out;
}
