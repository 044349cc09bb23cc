// The LM head's screen: approximate logits of the whole vocabulary from 4-bit weights and
// 8-bit activations, for steps that only need each row's argmax (kvserve.quant.RescoredLMHead:
// the best candidates of the screen get exact fp32 logits afterwards).
//
// A decode step at batch 1 reads the head once per token, and for a large vocabulary it is the
// step's biggest read (Gemma 3: 262k rows x 640, 178 MB as Q8_0, 55 % of an int4 step at this
// machine's read bandwidth). A ranking tolerates what the logits themselves would not, so this
// kernel takes the cheapest route to a number per row: weights w = d * q + m with q in 0..15 per
// group of 64 (asymmetric, d and m fp16: 0.5625 bytes a weight), activations rounded to int8 per
// group of 64 (scale amax / 127), integer dot products of each group (u8 x s8, vpdpbusd), and
//   y = sum_g (d_g * dx_g) * (q_g . x8_g) + m_g * sum(x_g).
// Groups of 64 rather than 32: per row and group the 16 vpdpbusd carry 4 other vector operations
// (cvt, mul, 2 FMAs), where two groups of 32 carried 10, and the bytes are 0.9x. The ranking
// holds: the fp32 argmax ranked at most 10th (SmolLM2) / 12th (Gemma 3) on the precision texts
// (benchmarks/screen_rank.py; 7th / 6th with groups of 32), and the head rescores the best 64.
//
// Layout, per tile of 16 output rows and group of 64 inputs (kTileBytes): two blocks of 256
// bytes of nibbles (inputs 0-31, 32-63), then the 16 rows' d (fp16), then their m (fp16). Byte
// 64 i + 4 r + c of a block holds row r's weight 4 i + c in its low nibble and weight
// 16 + 4 i + c in its high nibble, so that each 32-bit lane of a vector is one output row: one
// vpdpbusd adds four products to each of 16 rows against one broadcast word of activations, the
// scales are a plain vector load, and no row needs a horizontal sum (llama.cpp's interleaved
// "repacked" layouts do the same).
//
// The AVX512-VNNI kernel, the AVX2 one and the portable loop compute the same integer sums and the same two
// fused multiply-adds per group in the same order: their results are bit-identical, and every
// row's result is independent of the number of activation rows.
#include "screen_linear.h"
#include "step_team.h"
#include "linear_args.h"
#include "nibble_tiles.h"
#include "row_dispatch.h"
#include "fp16.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define KVSERVE_SCREEN_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVSERVE_SCREEN_AVX2 1
#endif

namespace {

constexpr int64_t kGroup = 64;
constexpr int64_t kBlock = 32;  // inputs per block of nibbles (nibble_tiles.h's 32-input layout)
constexpr int64_t kScaleOffset = 2 * kTileNibbleBytes;  // d, then m, after the two blocks
constexpr int64_t kTileBytes = kScaleOffset + 2 * kTileRows * 2;  // + d and m as fp16: 576
constexpr int64_t kStreamBytes = 2 << 20;
// Activation rows sharing one decode of a tile's nibbles: 8 in the VNNI kernel's 32 registers
// (its nibbles, 8 accumulators and the dot products' chains), 4 in AVX2's 16.
#ifdef KVSERVE_SCREEN_VNNI
constexpr int kInputRowBlock = 8;
#else
constexpr int kInputRowBlock = 4;
#endif

bool g_portable = false;

// One call's activations: per row and group, the int8 values, the scale and the fp32 sum.
struct Int8Activations {
  int64_t groups;
  int8_t* q;     // [M][groups][64]
  float* scale;  // [M][groups]
  float* sum;    // [M][groups]

  // In the calling thread's scratch memory (a decode step calls this once per token).
  Int8Activations(const float* x, int64_t x_stride, int64_t M, int64_t K) : groups(K / kGroup) {
    thread_local std::vector<int8_t> q_scratch;
    thread_local std::vector<float> scale_scratch, sum_scratch;
    if (static_cast<int64_t>(q_scratch.size()) < M * K) q_scratch.resize(M * K);
    if (static_cast<int64_t>(scale_scratch.size()) < M * groups) {
      scale_scratch.resize(M * groups);
      sum_scratch.resize(M * groups);
    }
    q = q_scratch.data();
    scale = scale_scratch.data();
    sum = sum_scratch.data();
    for (int64_t r = 0; r < M; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = x + r * x_stride + g * kGroup;
        float amax = 0.f, s = 0.f;
        for (int64_t j = 0; j < kGroup; ++j) {
          amax = std::max(amax, std::fabs(xg[j]));
          s += xg[j];
        }
        const float dx = amax / 127.f;
        const float inv = dx > 0.f ? 1.f / dx : 0.f;
        int8_t* qg = q + (r * groups + g) * kGroup;
        for (int64_t j = 0; j < kGroup; ++j) {  // (a NaN or inf input rounds to 0; its group's sum carries it)
          const float v = xg[j] * inv;
          qg[j] = std::isfinite(v) ? static_cast<int8_t>(std::clamp(std::nearbyint(v), -127.f, 127.f)) : 0;
        }
        scale[r * groups + g] = dx;
        sum[r * groups + g] = s;
      }
    }
  }
};

#ifdef KVSERVE_SCREEN_VNNI
// Tiles [t0, t1) for activation rows r0 .. r0 + MR - 1; `stream`: whole 16-column stores to
// aligned addresses non-temporal (the caller fences).
template <int MR>
void screen_tiles_vnni(const uint8_t* packed, int64_t t0, int64_t t1, int64_t N, const Int8Activations& act,
                       int64_t r0, float* out, int64_t out_stride, bool stream) {
  const int64_t groups = act.groups;
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* tile = packed + t * groups * kTileBytes;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = tile + g * kTileBytes;
      // Dependency chains of vpdpbusd: with 8 rows one per row through both blocks (they
      // interleave; more would not fit the registers), with 3-4 rows two per row (low and high
      // nibbles), with 1-2 rows four (each block's low and high nibbles): a lone row's one
      // 16-deep chain bounded SmolLM2's screen at one row by its latency (0.47 against 0.41 ms
      // with groups of 32). The same integers. Each word of activations is broadcast by the
      // load itself (vpbroadcastd from memory): through a general register (one 32-byte copy,
      // then shifts) the broadcasts took vector-ALU slots.
      constexpr int kChains = MR <= 2 ? 4 : MR <= 4 ? 2 : 1;
      __m512i s[MR][kChains];
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < kChains; ++c) s[r][c] = _mm512_setzero_si512();
      for (int b = 0; b < kGroup / kBlock; ++b) {
        __m512i lo[4], hi[4];
        load_tile_nibbles(p + b * kTileNibbleBytes, b == 0 ? kTileBytes : 0, lo, hi);  // (the group fetched once)
        const int low = (2 * b) % kChains, high = (2 * b + 1) % kChains;
        for (int r = 0; r < MR; ++r) {
          const int8_t* xq = act.q + ((r0 + r) * groups + g) * kGroup + b * kBlock;
          for (int i = 0; i < 4; ++i) {
            s[r][low] = _mm512_dpbusd_epi32(s[r][low], lo[i], _mm512_broadcastd_epi32(_mm_loadu_si32(xq + 4 * i)));
            s[r][high] = _mm512_dpbusd_epi32(s[r][high], hi[i], _mm512_broadcastd_epi32(_mm_loadu_si32(xq + 16 + 4 * i)));
          }
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kScaleOffset)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kScaleOffset + 32)));
      for (int r = 0; r < MR; ++r) {
        const int64_t ag = (r0 + r) * groups + g;
        __m512i dot = s[r][0];
        for (int c = 1; c < kChains; ++c) dot = _mm512_add_epi32(dot, s[r][c]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(act.scale[ag])), acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(act.sum[ag]), acc[r]);
      }
    }
    const int64_t n0 = t * kTileRows;
    const __mmask16 keep = n0 + kTileRows <= N ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
    for (int r = 0; r < MR; ++r) {
      float* o = out + (r0 + r) * out_stride + n0;
      if (stream && keep == 0xFFFF && (reinterpret_cast<uintptr_t>(o) & 63) == 0) _mm512_stream_ps(o, acc[r]);
      else _mm512_mask_storeu_ps(o, keep, acc[r]);
    }
  }
}
#endif

#ifdef KVSERVE_SCREEN_AVX2
// The same tiles in two 8-lane halves (rows 0-7, 8-15), as the nibble kernels read them on AVX2:
// each 32-input block's integer sums per row (nibble_tiles.h's dot_bytes, vpmaddubsw summed in 16
// bits and widened), the group's two blocks added in 32 bits: the same integer as vpdpbusd's.
template <int MR>
void screen_tiles_avx2(const uint8_t* packed, int64_t t0, int64_t t1, int64_t N, const Int8Activations& act,
                       int64_t r0, float* out, int64_t out_stride) {
  const int64_t groups = act.groups;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t t = t0; t < t1; ++t) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint8_t* tile = packed + t * groups * kTileBytes;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = tile + g * kTileBytes;
      for (int64_t line = 0; line < kTileBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p) + kTilePrefetchBytes + line, _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {  // rows 8 h .. 8 h + 7
        __m256i s32[MR];
        for (int r = 0; r < MR; ++r) s32[r] = _mm256_setzero_si256();
        for (int b = 0; b < kGroup / kBlock; ++b) {  // each block's sums widened to 32 bits (64 inputs would overflow 16)
          __m256i lo[4], hi[4];
          load_tile_half_nibbles(p + b * kTileNibbleBytes, h, lo, hi);
          for (int r = 0; r < MR; ++r)
            s32[r] = _mm256_add_epi32(
                s32[r], dot_bytes<15>(lo, hi, act.q + ((r0 + r) * groups + g) * kGroup + b * kBlock, ones));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kScaleOffset + 16 * h)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kScaleOffset + 32 + 16 * h)));
        for (int r = 0; r < MR; ++r) {
          const int64_t ag = (r0 + r) * groups + g;
          const __m256 dot = _mm256_cvtepi32_ps(s32[r]);
          acc[r][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(act.scale[ag])), acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(act.sum[ag]), acc[r][h]);
        }
      }
    }
    const int64_t n0 = t * kTileRows;
    for (int r = 0; r < MR; ++r) {
      float* o = out + (r0 + r) * out_stride + n0;
      if (n0 + kTileRows <= N) {
        _mm256_storeu_ps(o, acc[r][0]);
        _mm256_storeu_ps(o + 8, acc[r][1]);
      } else {
        alignas(32) float lanes[kTileRows];
        _mm256_store_ps(lanes, acc[r][0]);
        _mm256_store_ps(lanes + 8, acc[r][1]);
        std::memcpy(o, lanes, (N - n0) * sizeof(float));
      }
    }
  }
}
#endif

void screen_tiles_portable(const uint8_t* packed, int64_t t0, int64_t t1, int64_t N, const Int8Activations& act,
                           int64_t r0, int64_t rows, float* out, int64_t out_stride) {
  const int64_t groups = act.groups;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t lane = 0; lane < kTileRows && t * kTileRows + lane < N; ++lane) {
      for (int64_t r = r0; r < r0 + rows; ++r) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* p = packed + (t * groups + g) * kTileBytes;
          const int8_t* xq = act.q + (r * groups + g) * kGroup;
          int32_t dot = 0;
          for (int b = 0; b < kGroup / kBlock; ++b) {
            for (int i = 0; i < 4; ++i) {
              for (int c = 0; c < 4; ++c) {
                const uint8_t byte = p[b * kTileNibbleBytes + 64 * i + 4 * lane + c];
                dot += (byte & 15) * xq[b * kBlock + 4 * i + c] + (byte >> 4) * xq[b * kBlock + 16 + 4 * i + c];
              }
            }
          }
          uint16_t dh, mh;
          std::memcpy(&dh, p + kScaleOffset + 2 * lane, 2);
          std::memcpy(&mh, p + kScaleOffset + 32 + 2 * lane, 2);
          const float scale = fp16_bits_to_float(dh) * act.scale[r * groups + g];
          acc = std::fma(static_cast<float>(dot), scale, acc);
          acc = std::fma(fp16_bits_to_float(mh), act.sum[r * groups + g], acc);
        }
        out[r * out_stride + t * kTileRows + lane] = acc;
      }
    }
  }
}

void tiles_for_rows(const uint8_t* packed, int64_t t0, int64_t t1, int64_t N, const Int8Activations& act,
                    int64_t r0, int64_t rows, float* out, int64_t out_stride, bool stream) {
#ifdef KVSERVE_SCREEN_VNNI
  if (!g_portable) {
    return dispatch_rows<kInputRowBlock>(rows, [&](auto mr) { screen_tiles_vnni<decltype(mr)::value>(packed, t0, t1, N, act, r0, out, out_stride, stream); });
  }
#endif
#ifdef KVSERVE_SCREEN_AVX2
  if (!g_portable) {
    return dispatch_rows<kInputRowBlock>(rows, [&](auto mr) { screen_tiles_avx2<decltype(mr)::value>(packed, t0, t1, N, act, r0, out, out_stride); });
  }
#endif
  screen_tiles_portable(packed, t0, t1, N, act, r0, rows, out, out_stride);
}

}  // namespace

void set_portable_screen_kernel(bool portable) { g_portable = portable; }

void q4_screen_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor packed) {
  RECORD_FUNCTION("kvserve::q4_screen_linear", std::vector<c10::IValue>());
  check_activation_rows(x);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == kTileBytes,
              "packed must be uint8 [ceil(N / 16), K / 64, 576] (kvserve.quant.Q4Screen)");
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = out.size(1);
  TORCH_CHECK(K == packed.size(1) * kGroup, "x has ", K, " features, the weights ", packed.size(1) * kGroup);
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 &&
                  N > (tiles - 1) * kTileRows && N <= tiles * kTileRows,
              "out must be float32 [M, N] with contiguous rows, N the weights' row count");
  if (M == 0) return;
  const Int8Activations act(x.data_ptr<float>(), x.stride(0), M, K);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t o_stride = out.stride(0);
  // A call too small to be worth waking the other threads stays on this one.
  const int64_t grain = M * N * K < (1 << 18) ? tiles : 1;
  // Logits past L2 (a batched greedy step's: 32 rows of Gemma 3's 262k are 33.5 MB) go out with
  // non-temporal stores: no read for ownership of lines about to be overwritten whole, and the
  // weights' tiles stay in cache. Screen and top-64 of 32 rows, in one process against plain
  // stores: Gemma 3 0.87x, SmolLM2 0.80x; a single row's logits (1 MB at most) stay in cache for
  // the top-k that reads them next. The same values either way.
  const bool stream = M * N * 4 >= kStreamBytes;
  kvserve::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    if (M <= kInputRowBlock) {
      tiles_for_rows(w, t0, t1, N, act, 0, M, o, o_stride, stream);
    } else {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t r0 = 0; r0 < M; r0 += kInputRowBlock)
          tiles_for_rows(w, t, t + 1, N, act, r0, std::min<int64_t>(kInputRowBlock, M - r0), o, o_stride, stream);
    }
#ifdef KVSERVE_SCREEN_VNNI
    if (stream) _mm_sfence();  // this worker's streamed lines visible before the call returns
#endif
  });
}

// kvserve.quant.Q4Screen.from_float's arithmetic, in one pass over the weights: per row and
// group of 64, d = fp16(max((hi - lo) / 15, 1e-6)), m = fp16(lo), q = rint((w - m) / d) in 0..15
// (fp32 throughout: the same operations as quantize_min_max, so the same bytes for finite
// weights, but for the sign of a zero m), written in the tiled layout. Its torch version
// passes over Gemma 3's 262k x 640 head eight times: 1.6 s of every engine start.
torch::Tensor q4_screen_pack(torch::Tensor weight) {
  check_fp32_weight(weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % kGroup == 0, "the 4-bit screen needs in_features divisible by ", kGroup, ", got ", K);
  const int64_t tiles = (N + kTileRows - 1) / kTileRows, groups = K / kGroup;
  auto packed = torch::zeros({tiles, groups, kTileBytes}, weight.options().dtype(torch::kUInt8));
  const float* w = weight.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    uint8_t q[kTileRows][kGroup];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rows = std::min(kTileRows, N - t * kTileRows);
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* tile = out + (t * groups + g) * kTileBytes;
        std::memset(q, 0, sizeof q);  // rows past N: zero values and scales
        for (int64_t r = 0; r < rows; ++r) {
          const float* x = w + (t * kTileRows + r) * K + g * kGroup;
          float lo = x[0], hi = x[0];
          for (int64_t j = 1; j < kGroup; ++j) {
            lo = std::min(lo, x[j]);
            hi = std::max(hi, x[j]);
          }
          const c10::Half d16 = fp16_rne(std::max((hi - lo) / 15.0f, 1e-6f)), m16 = fp16_rne(lo);
          const float d = d16, m = m16;
          for (int64_t j = 0; j < kGroup; ++j)
            q[r][j] = static_cast<uint8_t>(std::min(std::max(std::nearbyint((x[j] - m) / d), 0.0f), 15.0f));
          std::memcpy(tile + kScaleOffset + 2 * r, &d16.x, 2);
          std::memcpy(tile + kScaleOffset + 2 * kTileRows + 2 * r, &m16.x, 2);
        }
        // Block h holds inputs 32 h .. 32 h + 31: byte 64 i + 4 r + c has row r's input 4 i + c in
        // its low nibble and 16 + 4 i + c in its high one.
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t i = 0; i < 4; ++i)
            for (int64_t r = 0; r < kTileRows; ++r)
              for (int64_t c = 0; c < 4; ++c) {
                const int64_t j = kBlock * h + 4 * i + c;
                tile[kTileNibbleBytes * h + 64 * i + 4 * r + c] = q[r][j] | (q[r][j + 16] << 4);
              }
      }
    }
  });
  return packed;
}

torch::Tensor q4_screen_linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  auto out = torch::empty({x.size(0), N}, x.options());
  q4_screen_linear_out(out, x, packed);
  return out;
}
