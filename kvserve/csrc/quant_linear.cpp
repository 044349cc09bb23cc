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
//   Q4_K (Gemma 3's file): super-blocks of 256 with 6-bit sub-scales, w = d * sc * q - dmin * mn
//     per group of 32. Loaded into the Q4_1 layout with the group's d * sc and -dmin * mn as
//     fp32 (both exact in fp32, not in fp16): the same kernel with fp32 scales.
//   Q5_0 (Gemma 3's file): groups of 32, w = d * (q - 16), q in 0..31: the 4 low bits as in
//     Q4_1, the fifth in a 32-bit word per group (GGUF's qh). Same bf16 products as Q4_1.
//   Q8_0 (the int4 mode's LM head, as llama.cpp stores it): groups of 32, w = d * q,
//     q in -127..127. fp32 products. Q6_K (Gemma 3's file): groups of 16, w = d * sc * (q - 32),
//     loaded as int8 q - 32 with the group's d * sc in fp32 (exact): the Q8_0 kernel with
//     fine-grained fp32 scales.
//
// Every output row is computed in the same order whatever the number of activation rows, so
// results do not depend on batch composition. Without AVX512-BF16 a portable loop computes
// the same sums (in another order).
#include "quant_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
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

// Per-group scales as a format stores them: fp16 bits (GGUF's own) or fp32 (scales that are
// products of two stored numbers, exact only in fp32).
inline float scale_value(uint16_t h) { return half_to_float(h); }
inline float scale_value(float f) { return f; }

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

// The nibble formats (Q4_1, Q4_K loaded as Q4_1 with fp32 scales, Q5_0) per 64-weight chunk of
// an output row: two 32-word bf16 vectors of weight values (lo pairs with the activations'
// low-nibble words, hi with the high-nibble ones, see Q4Activations), the scale of each lane's
// group and, for the formats with a minimum, its offset (lanes 0-7: the chunk's first group,
// 8-15: its second).
template <typename Scale>
struct Q4Format {
  static constexpr bool kOffset = true;
  const uint8_t* qs;
  const Scale* dm;  // (d, d', m, m') per chunk
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
#ifdef KVSERVE_Q4_AVX512
  static float table_value(int i) { return static_cast<float>(i & 15); }
  __m512 load_scales(int64_t n, int64_t c) const;
  void load(int64_t n, int64_t c, const __m512i table, __m512bh& lo, __m512bh& hi, __m512& d, __m512& m) const {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (n * chunks + c) * 32)));
    lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x0F)), table);
    hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
    const __m512 dm4 = load_scales(n, c);
    d = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), dm4);
    m = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2), dm4);
  }
#endif
};

#ifdef KVSERVE_Q4_AVX512
template <>
inline __m512 Q4Format<uint16_t>::load_scales(int64_t n, int64_t c) const {
  return _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dm + (n * chunks + c) * 4))));
}
template <>
inline __m512 Q4Format<float>::load_scales(int64_t n, int64_t c) const {
  return _mm512_castps128_ps512(_mm_loadu_ps(dm + (n * chunks + c) * 4));
}
#endif

struct Q5Format {
  static constexpr bool kOffset = false;
  const uint8_t* qs;   // as Q4_1's
  const uint32_t* qh;  // per group: bit j = fifth bit of weight j
  const uint16_t* d;   // per group, fp16
  int64_t chunks;

  float portable_scale(int64_t n, int64_t c, int half) const { return half_to_float(d[(n * chunks + c) * 2 + half]); }
  float portable_offset(int64_t, int64_t, int) const { return 0.f; }
  std::pair<int, int> portable_values(int64_t n, int64_t c, int half, int j) const {
    const uint8_t byte = qs[(n * chunks + c) * 32 + half * 16 + j];
    const uint32_t h = qh[(n * chunks + c) * 2 + half];
    return {static_cast<int>((byte & 15) | (((h >> j) & 1) << 4)) - 16,
            static_cast<int>((byte >> 4) | (((h >> (j + 16)) & 1) << 4)) - 16};
  }
#ifdef KVSERVE_Q4_AVX512
  static float table_value(int i) { return static_cast<float>(i - 16); }
  void load(int64_t n, int64_t c, const __m512i table, __m512bh& lo, __m512bh& hi, __m512& dv, __m512&) const {
    const int64_t g = (n * chunks + c) * 2;
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + g * 16)));
    const uint32_t h0 = qh[g], h1 = qh[g + 1];
    // word i of lo is weight i of the first group (i < 16) or i - 16 of the second; of hi, the
    // same plus 16: their fifth bits are the low / high halves of the two qh words.
    const __mmask32 lo_bits = (h0 & 0xFFFFu) | (h1 << 16), hi_bits = (h0 >> 16) | (h1 & 0xFFFF0000u);
    const __m512i sixteen = _mm512_set1_epi16(16);
    const __m512i lo_idx = _mm512_and_si512(w, _mm512_set1_epi16(0x0F)), hi_idx = _mm512_srli_epi16(w, 4);
    lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_mask_add_epi16(lo_idx, lo_bits, lo_idx, sixteen), table);
    hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_mask_add_epi16(hi_idx, hi_bits, hi_idx, sixteen), table);
    uint32_t two;
    std::memcpy(&two, d + g, sizeof(two));
    dv = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                               _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(two)))));
  }
#endif
};

#ifdef KVSERVE_Q4_AVX512
template <typename Format>
__m512i value_table() {
  alignas(64) uint16_t words[32];
  for (int i = 0; i < 32; ++i) words[i] = float_to_bf16_rne(Format::table_value(i));
  return _mm512_load_si512(words);
}

// One chunk's contribution to an output: the bf16 products summed per lane in fp32, times the
// group's scale, plus its offset times the group's activation sum.
template <typename Format>
inline __m512 chunk_term(__m512bh lo, __m512bh hi, __m512 d, __m512 m, const uint16_t* x, const float* sums) {
  __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(x));
  t = _mm512_dpbf16_ps(t, hi, (__m512bh)_mm512_loadu_si512(x + 32));
  if constexpr (Format::kOffset) return _mm512_fmadd_ps(t, d, _mm512_mul_ps(m, _mm512_loadu_ps(sums)));
  return _mm512_mul_ps(t, d);
}

template <typename Format, int MR>
void nibble_rows_avx512(const Format& f, int64_t n_begin, int64_t n_end, const Q4Activations& act, int64_t r0,
                        float* out, int64_t out_stride, const float* bias) {
  const int64_t chunks = f.chunks;
  const __m512i table = value_table<Format>();
  const uint16_t* xb[MR];
  const float* gs[MR];
  for (int r = 0; r < MR; ++r) {
    xb[r] = act.xb.data() + (r0 + r) * chunks * kChunk;
    gs[r] = act.group_sums.data() + (r0 + r) * chunks * 16;
  }
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m512bh lo, hi;
      __m512 d, m;
      f.load(n, c, table, lo, hi, d, m);
      for (int r = 0; r < MR; ++r)
        acc[r][c & 1] = _mm512_add_ps(acc[r][c & 1], chunk_term<Format>(lo, hi, d, m, xb[r] + c * kChunk, gs[r] + c * 16));
    }
    for (int r = 0; r < MR; ++r)
      out[(r0 + r) * out_stride + n] =
          _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + (bias ? bias[n] : 0.f);
  }
}

// One activation row (decode): two output rows per pass give the core two independent chains
// of dot products. Same sums, in the same order, as nibble_rows_avx512<Format, 1>.
template <typename Format>
void nibble_row_pairs_avx512(const Format& f, int64_t n_begin, int64_t n_end, const Q4Activations& act, int64_t r0,
                             float* out, const float* bias) {
  const int64_t chunks = f.chunks;
  const __m512i table = value_table<Format>();
  const uint16_t* xb = act.xb.data() + r0 * chunks * kChunk;
  const float* gs = act.group_sums.data() + r0 * chunks * 16;
  int64_t n = n_begin;
  for (; n + 1 < n_end; n += 2) {
    __m512 acc[2][2] = {{_mm512_setzero_ps(), _mm512_setzero_ps()}, {_mm512_setzero_ps(), _mm512_setzero_ps()}};
    for (int64_t c = 0; c < chunks; ++c) {
      for (int j = 0; j < 2; ++j) {
        __m512bh lo, hi;
        __m512 d, m;
        f.load(n + j, c, table, lo, hi, d, m);
        acc[j][c & 1] = _mm512_add_ps(acc[j][c & 1], chunk_term<Format>(lo, hi, d, m, xb + c * kChunk, gs + c * 16));
      }
    }
    for (int j = 0; j < 2; ++j)
      out[n + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1])) + (bias ? bias[n + j] : 0.f);
  }
  if (n < n_end) nibble_rows_avx512<Format, 1>(f, n, n_end, act, r0, out, 0, bias);
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

// y = x @ W^T + bias for a nibble format: the activations laid out once, then every block of
// output rows with every block of input rows.
template <typename Format>
void nibble_linear_out(const Format& f, torch::Tensor& out, const torch::Tensor& x, int64_t N,
                       const c10::optional<torch::Tensor>& bias) {
  const int64_t Kp = f.chunks * kChunk, M = x.size(0), K = x.size(1);
  const Q4Activations act(x.data_ptr<float>(), x.stride(0), M, K, Kp);
  float* o = out.data_ptr<float>();
  const int64_t o_stride = out.stride(0);
  const float* b = bias_ptr(bias, N);
  over_row_blocks(N, M, M * N * Kp, [&](int64_t n0, int64_t n1, int64_t r0, int64_t rows) {
#ifdef KVSERVE_Q4_AVX512
    if (!g_portable) {
      switch (rows) {
        case 1: nibble_row_pairs_avx512(f, n0, n1, act, r0, o + r0 * o_stride, b); break;
        case 2: nibble_rows_avx512<Format, 2>(f, n0, n1, act, r0, o, o_stride, b); break;
        case 3: nibble_rows_avx512<Format, 3>(f, n0, n1, act, r0, o, o_stride, b); break;
        default: nibble_rows_avx512<Format, 4>(f, n0, n1, act, r0, o, o_stride, b); break;
      }
      return;
    }
#endif
    nibble_rows_portable(f, n0, n1, act, r0, rows, o, o_stride, b);
  });
}

}  // namespace

void set_portable_quant_kernels(bool portable) { g_portable = portable; }

void q4_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor dm,
                   c10::optional<torch::Tensor> bias) {
  const int64_t N = qs.size(0), Kp = qs.size(1) * 2, K = x.size(1);
  check_weight_rows(x, out, N);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && Kp % kChunk == 0 && K <= Kp &&
                  Kp - K < kChunk,
              "qs must be uint8 [N, ceil(K / 64) * 32]");
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
  const int64_t N = qs.size(0), Kp = qs.size(1) * 2, K = x.size(1);
  check_weight_rows(x, out, N);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && Kp % kChunk == 0 && K <= Kp &&
                  Kp - K < kChunk,
              "qs must be uint8 [N, ceil(K / 64) * 32]");
  TORCH_CHECK(qh.scalar_type() == torch::kInt32 && qh.is_contiguous() && qh.numel() == N * (Kp / kGroup),
              "qh must be int32 [N, Kp / 32]");
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

// Q8 scales: fp16 per group of 32 (Q8_0 as stored) or fp32 per group of 16 (Q6_K's d * sc).
template <typename Scale>
struct Q8Scales {
  static constexpr int64_t kPerGroup = std::is_same_v<Scale, float> ? 16 : 32;
  const Scale* s;
  int64_t groups_per_row;  // of kPerGroup weights
  float operator()(int64_t n, int64_t g) const { return scale_value(s[n * groups_per_row + g]); }
};

#ifdef KVSERVE_Q4_AVX512
template <typename Scale, int MR>
void q8_rows_avx512(const int8_t* qs, const Q8Scales<Scale>& scales, int64_t n_begin, int64_t n_end, int64_t groups,
                    const float* x, int64_t x_stride, int64_t r0, float* out, int64_t out_stride, const float* bias) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* q = qs + n * groups * kGroup;
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m128i* p = reinterpret_cast<const __m128i*>(q + g * kGroup);
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
      const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
      if constexpr (Q8Scales<Scale>::kPerGroup == 32) {
        const __m512 scale = _mm512_set1_ps(scales(n, g));
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + (r0 + r) * x_stride + g * kGroup;
          const __m512 t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xr)));
          acc[r][g & 1] = _mm512_fmadd_ps(t, scale, acc[r][g & 1]);
        }
      } else {
        const __m512 s0 = _mm512_set1_ps(scales(n, 2 * g)), s1 = _mm512_set1_ps(scales(n, 2 * g + 1));
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + (r0 + r) * x_stride + g * kGroup;
          acc[r][0] = _mm512_fmadd_ps(_mm512_mul_ps(w0, _mm512_loadu_ps(xr)), s0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(_mm512_mul_ps(w1, _mm512_loadu_ps(xr + 16)), s1, acc[r][1]);
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      out[(r0 + r) * out_stride + n] =
          _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + (bias ? bias[n] : 0.f);
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
  const float* b = bias_ptr(bias, N);
  over_row_blocks(N, M, M * N * K, [&](int64_t n0, int64_t n1, int64_t r0, int64_t rows) {
#ifdef KVSERVE_Q4_AVX512
    if (!g_portable) {
      switch (rows) {
        case 1: q8_rows_avx512<Scale, 1>(q, scales, n0, n1, groups, xp, x_stride, r0, o, o_stride, b); break;
        case 2: q8_rows_avx512<Scale, 2>(q, scales, n0, n1, groups, xp, x_stride, r0, o, o_stride, b); break;
        case 3: q8_rows_avx512<Scale, 3>(q, scales, n0, n1, groups, xp, x_stride, r0, o, o_stride, b); break;
        default: q8_rows_avx512<Scale, 4>(q, scales, n0, n1, groups, xp, x_stride, r0, o, o_stride, b); break;
      }
      return;
    }
#endif
    q8_rows_portable(q, scales, n0, n1, K, xp, x_stride, r0, rows, o, o_stride, b);
  });
}

}  // namespace

void q8_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor d,
                   c10::optional<torch::Tensor> bias) {
  const int64_t N = qs.size(0), K = qs.size(1);
  check_weight_rows(x, out, N);
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

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> bias) {
  auto out = torch::empty({x.size(0), qs.size(0)}, x.options());
  q8_linear_out(out, x, qs, d, bias);
  return out;
}

