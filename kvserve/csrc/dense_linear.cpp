// Batch-invariant linear layers for bf16 and fp32 weights (and the LM head's rescoring).
//
// BLAS libraries pick their kernels, tilings and K splits by the shape of the call: oneDNN's
// bf16 matmul and MKL's sgemm give a row different bits depending on how many rows share the
// call (measured: oneDNN differs from 32 rows up at K = 1536 or 2048, MKL at every M > 1).
// A request's tokens then depend on what else runs in its step, how its prompt was split and
// whether it hit the prefix cache. Here every output element is one accumulator that starts
// at zero and takes K in ascending order, then (once) the bias: register blocking over rows
// and columns and the split of columns over threads change which element is computed when,
// never how. The Q4_1 / Q8_0 kernels (quant_linear.cpp) are built the same way.
//
//   bf16: weights packed as [Np / 32, K / 2, 32, 2] (a panel of 32 output columns, then
//     pairs of K): one 512-bit load is 16 columns x 2 k, the activations' k pair is
//     broadcast, and vdpbf16ps adds both products into the column's fp32 lane.
//   fp32: W as nn.Linear stores it, [N, K]: a 16-lane dot product per output with FMAs in
//     ascending k, then the same horizontal sum (_mm512_reduce_add_ps) for every output.
//
// With AVX2 and FMA but no AVX512-BF16, the bf16 panels are widened to fp32 in registers
// (bf16_panels_avx2). Intel's cores with AVX512-BF16 (Sapphire Rapids, Emerald Rapids) run
// vdpbf16ps at a quarter of the rate of 16-lane FMAs (measured on a 2-core Xeon: 0.91 vs 0.22
// ns per instruction, 12 independent chains), half their multiply-adds per second: there the
// same widening runs in 16 lanes (bf16_panels_widened512, chosen at run time; the same bits as
// the AVX2 route). Without either, a portable loop computes each output in its own fixed
// order (not the same bits as the vector kernels, equally batch invariant).
#include "dense_linear.h"
#include "avx2_reduce.h"
#include "step_team.h"
#include "amx_linear.h"
#include "bf16.h"
#include "linear_args.h"
#include "row_dispatch.h"
#include "row_table.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVSERVE_DENSE_AVX512 1
#if defined(__AVX512BF16__)
#define KVSERVE_DENSE_BF16 1
#endif
#endif
// AVX2 + FMA without AVX512-BF16 (Zen 2/3, older Xeons): bf16 weights widened in registers.
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVSERVE_DENSE_BF16)
#include <immintrin.h>
#define KVSERVE_DENSE_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 32;  // output columns per packed bf16 panel (two 16-lane vectors)
constexpr int64_t kRowBlock = 96;  // activation rows kept in cache while a thread's panels pass over them
constexpr int64_t kSmallWork = 1 << 18;  // multiply-adds below which one thread does the whole call

bool g_portable = false;

#ifdef KVSERVE_DENSE_BF16
// Whether bf16 weights are widened to fp32 for 16-lane FMAs rather than multiplied with
// vdpbf16ps: on Intel's cores (see above). Fixed until set_bf16_kernel_route changes it, so every
// call on a machine takes the same route ("dot" | "widened" there override the CPU's default).
bool g_widen_bf16 = !bf16_dot_default();
#endif

// The tile route (amx_linear.cpp): 0 none, 1 the hardware's tiles, 2 their emulation (tests).
// By default decided at the first bf16 call (the hardware needs a self-test; ops.load_extension
// makes that call before any weights load) and then fixed like the vector route until
// set_bf16_kernel_route changes it: on a machine with AMX every bf16 call whose K is a multiple
// of 32 takes it, decode rows and prompt rows alike, so a row's bits never depend on the call.
// set_bf16_kernel_route("dot" | "widened") keeps the vector routes there; "amx" demands the tiles
// (and raises where they cannot run).
std::atomic<int> g_amx{0};
std::once_flag g_amx_resolved;  // the default decided, or a route set

int amx_mode() {
  std::call_once(g_amx_resolved, [] { g_amx.store(amx_bf16_available() ? 1 : 0, std::memory_order_relaxed); });
  return g_amx.load(std::memory_order_relaxed);
}

int64_t threads_for(int64_t work) { return work < kSmallWork ? 1 : at::get_num_threads(); }

// Columns [0, n) split into `threads` contiguous ranges (in units of `unit`), one per thread.
template <typename Range>
void over_column_ranges(int64_t units, int64_t threads, const Range& range) {
  kvserve::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t begin = units * t / threads, end = units * (t + 1) / threads;
      if (begin < end) range(begin, end);
    }
  });
}

// ------------------------------------------------------------------------------ bf16

// The activations rounded to bf16, as k pairs: [M][Kh] words, word kk = x[2kk] | x[2kk + 1] << 16.
// In the calling thread's scratch memory (every word written), valid until its next call: a
// decode step makes hundreds of calls, each with a fresh zero-filled vector before.
// `rows` >= M words rows are provided, those past M zero (the tile route reads whole tiles).
const uint32_t* bf16_pairs(const float* x, int64_t stride, int64_t M, int64_t K, int64_t Kh, int64_t rows) {
  thread_local std::vector<uint32_t> pairs;
  if (static_cast<int64_t>(pairs.size()) < rows * Kh) pairs.resize(rows * Kh);
  uint32_t* const words = pairs.data();  // the caller's buffer (inside the workers `pairs` is theirs)
  std::fill(words + M * Kh, words + rows * Kh, 0u);
  kvserve::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * stride;
      uint32_t* dst = words + m * Kh;
      const int64_t full = K / 2;
#pragma omp simd
      for (int64_t kk = 0; kk < full; ++kk) dst[kk] = bf16_bits_rne(xr[2 * kk]) | (bf16_bits_rne(xr[2 * kk + 1]) << 16);
      if (full < Kh) dst[full] = bf16_bits_rne(xr[K - 1]);  // odd K: the padded weight is zero
    }
  });
  return words;
}

struct Bf16Call {
  const uint32_t* x;  // [M][Kh]
  const uint16_t* w;  // [P][Kh][32][2]
  int64_t Kh, N;
  float* out;
  int64_t out_stride;
  const float* bias;
};

// Writes 16 sums (columns col..col+15, those < N) of one row, plus the bias.
inline void store_columns(const Bf16Call& c, float* o, int64_t col, const float* sums) {
  const int64_t n = std::min<int64_t>(16, c.N - col);
  for (int64_t i = 0; i < n; ++i) o[col + i] = sums[i] + (c.bias ? c.bias[col + i] : 0.f);
}

#ifdef KVSERVE_DENSE_BF16
// MR activation rows x NP panels (2 NP vectors of 16 columns): MR * 2 NP accumulators.
template <int MR, int NP>
void bf16_tile(const Bf16Call& c, int64_t m0, int64_t p0) {
  constexpr int NB = 2 * NP;
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* w[NP];
  for (int p = 0; p < NP; ++p) w[p] = c.w + (p0 + p) * c.Kh * 2 * kPanel;
  const uint32_t* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = c.x + (m0 + r) * c.Kh;
  for (int64_t kk = 0; kk < c.Kh; ++kk) {
    __m512bh b[NB];
    for (int p = 0; p < NP; ++p) {
      b[2 * p] = (__m512bh)_mm512_loadu_si512(w[p] + kk * 2 * kPanel);
      b[2 * p + 1] = (__m512bh)_mm512_loadu_si512(w[p] + kk * 2 * kPanel + kPanel);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r][kk]));
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* o = c.out + (m0 + r) * c.out_stride;
    for (int j = 0; j < NB; ++j) {
      const int64_t col = (p0 + j / 2) * kPanel + (j % 2) * 16;
      if (col >= c.N) continue;
      if (col + 16 <= c.N) {
        __m512 v = acc[r][j];
        if (c.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(c.bias + col));
        _mm512_storeu_ps(o + col, v);
      } else {
        alignas(64) float sums[16];
        _mm512_store_ps(sums, acc[r][j]);
        store_columns(c, o, col, sums);
      }
    }
  }
}

template <int MR>
void bf16_tile_np(const Bf16Call& c, int64_t m0, int64_t p0, int64_t np) {
  if constexpr (MR <= 2) {  // up to four panels: 2 x 8 accumulators + 8 weight vectors fit the 32 registers
    switch (np) {
      case 1: bf16_tile<MR, 1>(c, m0, p0); break;
      case 2: bf16_tile<MR, 2>(c, m0, p0); break;
      case 3: bf16_tile<MR, 3>(c, m0, p0); break;
      default: bf16_tile<MR, 4>(c, m0, p0); break;
    }
  } else {
    if (np == 1) bf16_tile<MR, 1>(c, m0, p0);
    else bf16_tile<MR, 2>(c, m0, p0);
  }
}

void bf16_rows(const Bf16Call& c, int64_t m0, int64_t rows, int64_t p0, int64_t np) {
  dispatch_rows<6>(rows, [&](auto mr) { bf16_tile_np<decltype(mr)::value>(c, m0, p0, np); });
}

// Panels [pb, pe) for all M rows: one or two rows (decode) take four panels per pass (eight
// independent accumulator chains, four weight streams); more rows go six at a time over two
// panels, in blocks of kRowBlock rows so that a block's activations stay in cache.
void bf16_panels_avx512(const Bf16Call& c, int64_t M, int64_t pb, int64_t pe) {
  const int64_t panels_per_pass = M <= 2 ? 4 : 2;
  for (int64_t mb = 0; mb < M; mb += kRowBlock) {
    const int64_t me = std::min(M, mb + kRowBlock);
    for (int64_t p = pb; p < pe; p += panels_per_pass) {
      const int64_t np = std::min(panels_per_pass, pe - p);
      for (int64_t m = mb; m < me; m += 6) bf16_rows(c, m, std::min<int64_t>(6, me - m), p, np);
    }
  }
}
#endif

#if defined(KVSERVE_DENSE_AVX2) || defined(KVSERVE_DENSE_BF16)
// The widened routes (no bf16 dot product, or a slow one): each 32-bit word of a panel (one
// column's k pair) becomes two fp32 weights in registers, the first by shifting it left 16
// bits, the second by clearing its low half, and each takes one FMA against its broadcast
// input, first then second: every output is one accumulator over ascending k, whatever the
// tile shape (batch invariant), in 8 lanes or 16 alike. The inputs are the bf16-rounded
// activations as fp32 (bf16_pairs' words, widened once per call).
const float* widened_pairs(const uint32_t* pairs, int64_t M, int64_t Kh) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < M * Kh * 2) scratch.resize(M * Kh * 2);
  float* const xf = scratch.data();
  for (int64_t i = 0; i < M * Kh; ++i) {
    xf[2 * i] = bf16_value(pairs[i] & 0xFFFF);
    xf[2 * i + 1] = bf16_value(pairs[i] >> 16);
  }
  return xf;
}
#endif

#ifdef KVSERVE_DENSE_AVX2
// Writes 8 sums (columns col..col+7, those < N) of one output row, plus the bias: masked
// stores, no array on the stack (through one, GCC kept a tile's accumulators in memory and
// stored every one of them at every k of the loop).
__attribute__((always_inline)) inline void store8(const Bf16Call& c, float* o, int64_t col, __m256 sum) {
  if (col >= c.N) return;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(8, c.N - col))), lanes);
  if (c.bias) sum = _mm256_add_ps(sum, _mm256_maskload_ps(c.bias + col, keep));
  _mm256_maskstore_ps(o + col, keep, sum);
}

// Every output is one FMA chain over ascending k (the pair's first weight, then its second)
// from zero, then the bias: the same arithmetic in both routes below, so a row's result does
// not depend on how many rows share the call.
//
// Few rows (decode): MR rows x NV vectors of 8 columns from col0 (a multiple of 8; the vectors
// may run into the next panel), the weights widened as they are read.
template <int MR, int NV>
void bf16_tile_avx2(const Bf16Call& c, const float* xf, int64_t m0, int64_t col0) {
  __m256 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  const uint16_t* w[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t col = col0 + 8 * v;
    w[v] = c.w + (col / kPanel) * c.Kh * 2 * kPanel + (col % kPanel) * 2;
  }
  const float* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = xf + (m0 + r) * c.Kh * 2;
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kk = 0; kk < c.Kh; ++kk) {
    for (int v = 0; v < NV; ++v) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[v] + kk * 2 * kPanel));
      const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
      const __m256 second = _mm256_castsi256_ps(_mm256_and_si256(words, high_half));
      for (int r = 0; r < MR; ++r) {
        acc[r][v] = _mm256_fmadd_ps(first, _mm256_broadcast_ss(x[r] + 2 * kk), acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(second, _mm256_broadcast_ss(x[r] + 2 * kk + 1), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) store8(c, c.out + (m0 + r) * c.out_stride, col0 + 8 * v, acc[r][v]);
}

// Many rows (prefill): a panel is widened once into fp32 [2][K][16] (thread scratch, L2-sized for
// these models' K) and MR rows x 16 columns at a time run over it: 2 MR chains, no widening in
// the inner loop.
template <int MR>
void widened_tile_avx2(const Bf16Call& c, const float* panel, int64_t K2, const float* xf, int64_t m0, int64_t col0) {
  // Two arrays of MR, not one of 2 MR: GCC keeps a 12-vector array in memory (a store per
  // vector per k), two 6-vector ones in registers.
  __m256 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  const float* __restrict w = panel + (col0 % kPanel) / 16 * K2 * 16;  // this half of the panel, [K2][16]
  const float* __restrict x = xf + m0 * K2;
  for (int64_t k = 0; k < K2; ++k) {
    const __m256 w0 = _mm256_load_ps(w + k * 16), w1 = _mm256_load_ps(w + k * 16 + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K2 + k);
      acc0[r] = _mm256_fmadd_ps(w0, xv, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w1, xv, acc1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    store8(c, c.out + (m0 + r) * c.out_stride, col0, acc0[r]);
    store8(c, c.out + (m0 + r) * c.out_stride, col0 + 8, acc1[r]);
  }
}

// Four or six rows, the accumulators spelt out: as arrays GCC kept them in memory (a store per
// vector per k: widened_tile_avx2<4> took about as long as a tile of 9 rows would); named, they
// stay in registers (up to 12 of the 16, with the broadcast and the FMAs' weights read from
// memory). The same arithmetic as widened_tile_avx2.
template <int MR>
void widened_tile_named_avx2(const Bf16Call& c, const float* panel, int64_t K2, const float* xf, int64_t m0,
                             int64_t col0) {
  static_assert(MR == 4 || MR == 6, "four or six rows");
  const float* __restrict w = panel + (col0 % kPanel) / 16 * K2 * 16;
  const float* __restrict x = xf + m0 * K2;
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int64_t k = 0; k < K2; ++k) {
    const float* wk = w + k * 16;
#define KVSERVE_ROW(r, lo, hi)                                  \
  {                                                             \
    const __m256 xv = _mm256_broadcast_ss(x + (r) * K2 + k);    \
    lo = _mm256_fmadd_ps(_mm256_load_ps(wk), xv, lo);           \
    hi = _mm256_fmadd_ps(_mm256_load_ps(wk + 8), xv, hi);       \
  }
    KVSERVE_ROW(0, a00, a01)
    KVSERVE_ROW(1, a10, a11)
    KVSERVE_ROW(2, a20, a21)
    KVSERVE_ROW(3, a30, a31)
    if constexpr (MR == 6) {
      KVSERVE_ROW(4, a40, a41)
      KVSERVE_ROW(5, a50, a51)
    }
#undef KVSERVE_ROW
  }
  const __m256 sums[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < MR; ++r) {
    store8(c, c.out + (m0 + r) * c.out_stride, col0, sums[r][0]);
    store8(c, c.out + (m0 + r) * c.out_stride, col0 + 8, sums[r][1]);
  }
}

// The next tile's rows, `left` (> 4 at a call's start) still to do: six at a time (12 FMA chains),
// then what is left, but 5 as 3 + 2 (6 + 4 chains), not 4 + 1 (8 + 2): a lone row's two chains
// wait on the FMA's latency. Measured on Zen 3, SmolLM2's four decoder GEMMs at 5 and 11 rows:
// 0.58 -> 0.53 and 0.81 -> 0.75 ms (6 + 1 rows stay so: 4 + 3 took 0.61 against 0.57 ms, and
// 4 + 4 0.67 against 6 + 2's 0.58). A row's arithmetic is the same in every tile: no bits change.
inline int64_t widened_tile_rows_avx2(int64_t left) { return left == 5 ? 3 : std::min<int64_t>(6, left); }

// Panels [pb, pe) for all M rows: up to kDirectRowsAvx2 rows read the bf16 panels directly
// (one row 64 columns per pass, two rows 32, more 16); more rows widen each panel once and go
// over it in tiles of widened_tile_rows_avx2.
constexpr int64_t kDirectRowsAvx2 = 4;
void bf16_panels_avx2(const Bf16Call& c, const float* xf, int64_t M, int64_t pb, int64_t pe) {
  const int64_t end = pe * kPanel;
  if (M <= kDirectRowsAvx2) {
    const int64_t cols = M == 1 ? 64 : M == 2 ? 32 : 16;
    for (int64_t col = pb * kPanel; col < end; col += cols) {
      const int64_t span = std::min(cols, end - col);  // 64, 32 or 16 (panels hold 32 columns)
      if (M == 1 && span == 64) bf16_tile_avx2<1, 8>(c, xf, 0, col);
      else if (M == 1) bf16_tile_avx2<1, 4>(c, xf, 0, col);
      else if (M == 2) bf16_tile_avx2<2, 4>(c, xf, 0, col);
      else if (M == 3) bf16_tile_avx2<3, 2>(c, xf, 0, col);
      else bf16_tile_avx2<4, 2>(c, xf, 0, col);
    }
    return;
  }
  const int64_t K2 = c.Kh * 2;
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < K2 * kPanel + 8) scratch.resize(K2 * kPanel + 8);
  float* const panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~uintptr_t{31});
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = pb; p < pe; ++p) {
    const uint16_t* w = c.w + p * c.Kh * 2 * kPanel;
    for (int64_t kk = 0; kk < c.Kh; ++kk) {
      for (int v = 0; v < 4; ++v) {  // columns 8 v .. 8 v + 7: half v / 2, lanes 8 (v % 2) on
        const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kk * 2 * kPanel + 16 * v));
        float* dst = panel + (v / 2) * K2 * 16 + 2 * kk * 16 + 8 * (v % 2);
        _mm256_store_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)));
        _mm256_store_ps(dst + 16, _mm256_castsi256_ps(_mm256_and_si256(words, high_half)));
      }
    }
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t col = p * kPanel + 16 * half;
      if (col >= c.N) break;
      for (int64_t m = 0, rows; m < M; m += rows) {
        rows = widened_tile_rows_avx2(M - m);
        switch (rows) {
          case 1: widened_tile_avx2<1>(c, panel, K2, xf, m, col); break;
          case 2: widened_tile_avx2<2>(c, panel, K2, xf, m, col); break;
          case 3: widened_tile_avx2<3>(c, panel, K2, xf, m, col); break;
          case 4: widened_tile_named_avx2<4>(c, panel, K2, xf, m, col); break;
          default: widened_tile_named_avx2<6>(c, panel, K2, xf, m, col); break;
        }
      }
    }
  }
}
#endif

#ifdef KVSERVE_DENSE_BF16
// The widened route in 16 lanes (the AVX2 route's arithmetic, see widened_pairs).
__attribute__((always_inline)) inline void store16(const Bf16Call& c, float* o, int64_t col, __m512 sum) {
  if (col >= c.N) return;
  const __mmask16 keep = col + 16 <= c.N ? 0xFFFF : static_cast<__mmask16>((1u << (c.N - col)) - 1);
  if (c.bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(keep, c.bias + col));
  _mm512_mask_storeu_ps(o + col, keep, sum);
}

// Few rows (decode): MR rows x NV vectors of 16 columns from col0 (a multiple of 16; the
// vectors may run into the next panel), the weights widened as they are read.
template <int MR, int NV>
void widening_tile512(const Bf16Call& c, const float* xf, int64_t m0, int64_t col0) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const uint16_t* w[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t col = col0 + 16 * v;
    w[v] = c.w + (col / kPanel) * c.Kh * 2 * kPanel + (col % kPanel) * 2;
  }
  const float* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = xf + (m0 + r) * c.Kh * 2;
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kk = 0; kk < c.Kh; ++kk) {
    for (int v = 0; v < NV; ++v) {
      const __m512i words = _mm512_loadu_si512(w[v] + kk * 2 * kPanel);
      const __m512 first = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
      const __m512 second = _mm512_castsi512_ps(_mm512_and_si512(words, high_half));
      for (int r = 0; r < MR; ++r) {
        acc[r][v] = _mm512_fmadd_ps(first, _mm512_set1_ps(x[r][2 * kk]), acc[r][v]);
        acc[r][v] = _mm512_fmadd_ps(second, _mm512_set1_ps(x[r][2 * kk + 1]), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) store16(c, c.out + (m0 + r) * c.out_stride, col0 + 16 * v, acc[r][v]);
}

// Many rows (prefill): a panel widened once into fp32 [K2][32] (thread scratch) and MR rows x
// its 32 columns at a time over it: 2 MR chains, weights and broadcasts from L1/L2.
template <int MR>
void widened_tile512(const Bf16Call& c, const float* panel, int64_t K2, const float* xf, int64_t m0, int64_t col0) {
  __m512 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const float* __restrict x = xf + m0 * K2;
  for (int64_t k = 0; k < K2; ++k) {
    const __m512 w0 = _mm512_load_ps(panel + k * kPanel), w1 = _mm512_load_ps(panel + k * kPanel + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K2 + k]);
      acc0[r] = _mm512_fmadd_ps(w0, xv, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(w1, xv, acc1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    store16(c, c.out + (m0 + r) * c.out_stride, col0, acc0[r]);
    store16(c, c.out + (m0 + r) * c.out_stride, col0 + 16, acc1[r]);
  }
}

// Two panels (64 columns) at a time: MR rows x 4 vectors, 4 weight loads and MR broadcasts
// per k for 4 MR FMAs (a single panel's tile needs 2 + MR loads for 2 MR).
template <int MR>
void widened_pair_tile512(const Bf16Call& c, const float* panels, int64_t K2, const float* xf, int64_t m0,
                          int64_t col0) {
  __m512 acc0[MR], acc1[MR], acc2[MR], acc3[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = acc2[r] = acc3[r] = _mm512_setzero_ps();
  const float* __restrict x = xf + m0 * K2;
  const float* __restrict second = panels + K2 * kPanel;
  for (int64_t k = 0; k < K2; ++k) {
    const __m512 w0 = _mm512_load_ps(panels + k * kPanel), w1 = _mm512_load_ps(panels + k * kPanel + 16);
    const __m512 w2 = _mm512_load_ps(second + k * kPanel), w3 = _mm512_load_ps(second + k * kPanel + 16);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K2 + k]);
      acc0[r] = _mm512_fmadd_ps(w0, xv, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(w1, xv, acc1[r]);
      acc2[r] = _mm512_fmadd_ps(w2, xv, acc2[r]);
      acc3[r] = _mm512_fmadd_ps(w3, xv, acc3[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* o = c.out + (m0 + r) * c.out_stride;
    store16(c, o, col0, acc0[r]);
    store16(c, o, col0 + 16, acc1[r]);
    store16(c, o, col0 + 32, acc2[r]);
    store16(c, o, col0 + 48, acc3[r]);
  }
}

constexpr int64_t kDirectRows512 = 4;
constexpr int64_t kPairRows512 = 6;  // 24 accumulators
constexpr int64_t kWidenedRows512 = 12;  // 24 accumulators, 2 weight vectors and a broadcast of the 32 registers
void bf16_panels_widened512(const Bf16Call& c, const float* xf, int64_t M, int64_t pb, int64_t pe) {
  const int64_t end = pe * kPanel;
  if (M <= kDirectRows512) {
    const int64_t cols = M == 1 ? 128 : M == 2 ? 64 : 32;
    for (int64_t col = pb * kPanel; col < end; col += cols) {
      const int64_t vectors = std::min(cols, end - col) / 16;  // whole panels: 2, 4, 6 or 8
      if (M == 1) {
        switch (vectors) {
          case 8: widening_tile512<1, 8>(c, xf, 0, col); break;
          case 6: widening_tile512<1, 6>(c, xf, 0, col); break;
          case 4: widening_tile512<1, 4>(c, xf, 0, col); break;
          default: widening_tile512<1, 2>(c, xf, 0, col); break;
        }
      } else if (M == 2) {
        if (vectors == 4) widening_tile512<2, 4>(c, xf, 0, col);
        else widening_tile512<2, 2>(c, xf, 0, col);
      } else if (M == 3) {
        widening_tile512<3, 2>(c, xf, 0, col);
      } else {
        widening_tile512<4, 2>(c, xf, 0, col);
      }
    }
    return;
  }
  const int64_t K2 = c.Kh * 2;
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < 2 * K2 * kPanel + 16) scratch.resize(2 * K2 * kPanel + 16);
  float* const panels = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = pb; p < pe; p += 2) {
    const int64_t np = std::min<int64_t>(2, pe - p);
    for (int64_t i = 0; i < np; ++i) {  // panel p + i into [K2][32] at panels + i K2 32
      const uint16_t* w = c.w + (p + i) * c.Kh * 2 * kPanel;
      float* panel = panels + i * K2 * kPanel;
      for (int64_t kk = 0; kk < c.Kh; ++kk) {
        for (int v = 0; v < 2; ++v) {  // columns 16 v .. 16 v + 15
          const __m512i words = _mm512_loadu_si512(w + kk * 2 * kPanel + 32 * v);
          float* dst = panel + 2 * kk * kPanel + 16 * v;
          _mm512_store_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)));
          _mm512_store_ps(dst + kPanel, _mm512_castsi512_ps(_mm512_and_si512(words, high_half)));
        }
      }
    }
    const int64_t col = p * kPanel;
    if (np == 2) {
      for (int64_t m = 0; m < M; m += kPairRows512) {
        const int64_t rows = std::min(kPairRows512, M - m);
        dispatch_rows<kPairRows512>(rows, [&](auto mr) { widened_pair_tile512<decltype(mr)::value>(c, panels, K2, xf, m, col); });
      }
    } else {
      for (int64_t m = 0; m < M; m += kWidenedRows512) {
        const int64_t rows = std::min(kWidenedRows512, M - m);
        dispatch_rows<kWidenedRows512>(rows, [&](auto mr) { widened_tile512<decltype(mr)::value>(c, panels, K2, xf, m, col); });
      }
    }
  }
}
#endif

// The portable loop: per output, k pairs in ascending order, each pair's two products added
// one after the other.
void bf16_panels_portable(const Bf16Call& c, int64_t M, int64_t pb, int64_t pe) {
  for (int64_t m = 0; m < M; ++m) {
    const uint32_t* x = c.x + m * c.Kh;
    float* o = c.out + m * c.out_stride;
    for (int64_t col = pb * kPanel; col < std::min(c.N, pe * kPanel); ++col) {
      const uint16_t* w = c.w + (col / kPanel) * c.Kh * 2 * kPanel + (col % kPanel) * 2;
      float acc = 0.f;
      for (int64_t kk = 0; kk < c.Kh; ++kk) {
        acc += bf16_value(x[kk] & 0xFFFF) * bf16_value(w[kk * 2 * kPanel]);
        acc += bf16_value(x[kk] >> 16) * bf16_value(w[kk * 2 * kPanel + 1]);
      }
      o[col] = acc + (c.bias ? c.bias[col] : 0.f);
    }
  }
}

// ------------------------------------------------------------------------------ fp32

#ifdef KVSERVE_DENSE_AVX512
// res[r][j] = x[r] . w[j] over K: one 16-lane FMA chain per pair in ascending k (a masked
// tail), then the fixed horizontal sum.
template <int MR, int NR>
inline void dot_tile(const float* const* x, const float* const* w, int64_t K, float (*res)[8]) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w[j] + k);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_loadu_ps(x[r] + k);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_maskz_loadu_ps(mask, w[j] + k);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x[r] + k);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) res[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}
#endif

#if defined(KVSERVE_DENSE_AVX2) && !defined(KVSERVE_DENSE_AVX512)
#define KVSERVE_DOT_AVX2 1
// The fp32 tile in 8 lanes (AVX2 CPUs): one FMA chain per output in ascending k (a masked
// tail), then a fixed horizontal sum.
template <int MR, int NR>
inline void dot_tile(const float* const* x, const float* const* w, int64_t K, float (*res)[8]) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t k = 0;
  auto step = [&](auto load) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load(w[j] + k);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = load(x[r] + k);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  };
  for (; k + 8 <= K; k += 8) step([](const float* p) { return _mm256_loadu_ps(p); });
  if (k < K) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(K - k)), lanes);
    step([&](const float* p) { return _mm256_maskload_ps(p, mask); });
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NR; ++j) {
      res[r][j] = horizontal_sum(acc[r][j]);
    }
  }
}
#endif

inline float dot_portable(const float* x, const float* w, int64_t K) {
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc += x[k] * w[k];
  return acc;
}

// Outputs (m, n) for m in [0, M), n in [nb, ne): dot(x row m, w row n) + bias[n].
void fp32_block(const float* x, int64_t x_stride, const float* w, int64_t w_stride, int64_t K, int64_t M,
                int64_t nb, int64_t ne, float* out, int64_t o_stride, const float* bias) {
#if defined(KVSERVE_DENSE_AVX512) || defined(KVSERVE_DOT_AVX2)
  if (!g_portable) {
    float res[4][8];
    const float* xr[4];
    const float* wr[8];
    auto put = [&](int64_t m, int64_t rows, int64_t n, int64_t cols) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) out[(m + r) * o_stride + n + j] = res[r][j] + (bias ? bias[n + j] : 0.f);
    };
    for (int64_t mb = 0; mb < M; mb += kRowBlock) {
      const int64_t me = std::min(M, mb + kRowBlock);
#ifdef KVSERVE_DOT_AVX2
      const int64_t cols_per_pass = 4, row_step = 2;  // 16 ymm registers: 2 x 4 accumulators and 4 weights
#else
      const int64_t cols_per_pass = me - mb <= 2 ? 8 : 4, row_step = me - mb <= 2 ? 2 : 4;
#endif
      for (int64_t n = nb; n < ne; n += cols_per_pass) {
        const int64_t cols = std::min(cols_per_pass, ne - n);
        for (int64_t j = 0; j < cols; ++j) wr[j] = w + (n + j) * w_stride;
        for (int64_t m = mb; m < me;) {
          const int64_t rows = cols == cols_per_pass ? std::min<int64_t>(me - m, row_step) : 1;
          for (int64_t r = 0; r < rows; ++r) xr[r] = x + (m + r) * x_stride;
          if (cols == 8 && rows == 2) dot_tile<2, 8>(xr, wr, K, res);
          else if (cols == 8) dot_tile<1, 8>(xr, wr, K, res);
          else if (cols == 4 && rows == 4) dot_tile<4, 4>(xr, wr, K, res);
          else if (cols == 4 && rows == 3) dot_tile<3, 4>(xr, wr, K, res);
          else if (cols == 4 && rows == 2) dot_tile<2, 4>(xr, wr, K, res);
          else if (cols == 4) dot_tile<1, 4>(xr, wr, K, res);
          else {
            for (int64_t j = 0; j < cols; ++j) {  // a ragged end of the range: one output at a time
              dot_tile<1, 1>(xr, wr + j, K, reinterpret_cast<float(*)[8]>(&res[0][j]));
            }
          }
          put(m, rows, n, cols);
          m += rows;
        }
      }
    }
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = nb; n < ne; ++n)
      out[m * o_stride + n] = dot_portable(x + m * x_stride, w + n * w_stride, K) + (bias ? bias[n] : 0.f);
}

// The build's vector route for bf16 weights (bf16_kernel_route's names).
const char* vector_bf16_route() {
#if defined(KVSERVE_DENSE_BF16)
  return g_widen_bf16 ? "widened512" : "dot";
#elif defined(KVSERVE_DENSE_AVX2)
  return "widened256";
#else
  return "portable";
#endif
}

}  // namespace

void set_portable_dense_kernels(bool portable) { g_portable = portable; }

std::string bf16_kernel_route() {
  if (const int amx = amx_mode()) return amx == 1 ? "amx" : "amx-emulated";
  return vector_bf16_route();
}

void set_bf16_kernel_route(const std::string& route) {
  const bool tiles = route == "amx" || route == "amx-emulated";
  // A route this machine or build cannot take raises, and the route in force stays.
  TORCH_CHECK(route != "amx" || amx_bf16_available(), "bf16_route=amx, but the AMX tiles cannot run here: ",
              amx_bf16_status());
#if defined(KVSERVE_DENSE_BF16)
  TORCH_CHECK(tiles || route == "auto" || route == "dot" || route == "widened" || route == "widened512",
              "bf16 route must be auto, dot, widened (widened512), amx or amx-emulated here");
#else
  const std::string vector_route = vector_bf16_route();
  TORCH_CHECK(tiles || route == "auto" || route == vector_route || (route == "widened" && vector_route == "widened256"),
              "this build has only the ", vector_route, " bf16 route");
#endif
  std::call_once(g_amx_resolved, [] {});  // (a set route replaces the default, undecided or not)
  if (route == "auto") {
    g_amx.store(amx_bf16_available() ? 1 : 0, std::memory_order_relaxed);
#if defined(KVSERVE_DENSE_BF16)
    g_widen_bf16 = !bf16_dot_default();
#endif
    return;
  }
  if (tiles) {
    g_amx.store(route == "amx" ? 1 : 2, std::memory_order_relaxed);
    return;
  }
  g_amx.store(0, std::memory_order_relaxed);
#if defined(KVSERVE_DENSE_BF16)
  g_widen_bf16 = route != "dot";
#endif
}

void bf16_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias) {
  RECORD_FUNCTION("kvserve::bf16_linear", std::vector<c10::IValue>());  // kvserve profile's label, every caller
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  check_linear_rows(x, out, N);
  TORCH_CHECK(wp.scalar_type() == torch::kInt16 && wp.is_contiguous() && wp.dim() == 4 && wp.size(2) == kPanel &&
                  wp.size(3) == 2,
              "wp must be int16 [Np / 32, Kp / 2, 32, 2] (kvserve.quant.pack_bf16_weight)");
  const int64_t P = wp.size(0), Kh = wp.size(1);
  TORCH_CHECK(Kh == (K + 1) / 2 && P == (N + kPanel - 1) / kPanel, "wp does not match x [M, K] and N");
  if (M == 0) return;
  const int route_amx = amx_mode();
  const int amx = g_portable || Kh % (kAmxDepth / 2) ? 0 : route_amx;
  const int64_t rows = amx ? (M + kAmxRows - 1) / kAmxRows * kAmxRows : M;
  const uint32_t* pairs = bf16_pairs(x.data_ptr<float>(), x.stride(0), M, K, Kh, rows);
  const Bf16Call call{pairs, reinterpret_cast<const uint16_t*>(wp.data_ptr<int16_t>()), Kh, N,
                      out.data_ptr<float>(), out.stride(0), optional_bias(bias, N)};
  if (amx) {
    const AmxBf16Call tiles{pairs, call.w, Kh, N, call.out, call.out_stride, call.bias};
    over_column_ranges(P, std::min(P, threads_for(M * N * K)),
                       [&](int64_t pb, int64_t pe) { amx_bf16_panels(tiles, M, pb, pe, amx == 2); });
    return;
  }
#ifdef KVSERVE_DENSE_AVX2
  const float* xf = widened_pairs(pairs, M, Kh);  // the caller's scratch, read by every worker
#elif defined(KVSERVE_DENSE_BF16)
  const float* xf = g_widen_bf16 ? widened_pairs(pairs, M, Kh) : nullptr;
#endif
  over_column_ranges(P, std::min(P, threads_for(M * N * K)), [&](int64_t pb, int64_t pe) {
#ifdef KVSERVE_DENSE_BF16
    if (!g_portable) {
      if (g_widen_bf16) bf16_panels_widened512(call, xf, M, pb, pe);
      else bf16_panels_avx512(call, M, pb, pe);
      return;
    }
#endif
#ifdef KVSERVE_DENSE_AVX2
    if (!g_portable) {
      bf16_panels_avx2(call, xf, M, pb, pe);
      return;
    }
#endif
    bf16_panels_portable(call, M, pb, pe);
  });
}

// kvserve.quant.pack_bf16_weight in one pass: each weight rounded to bf16 as torch rounds it
// (c10::BFloat16: to nearest even, NaN kept a NaN) and written to its panel's place, zeros in
// the padding. The torch version's four passes were ~0.5 s of every SmolLM2 engine start.
torch::Tensor pack_bf16_weight(torch::Tensor weight) {
  check_fp32_weight(weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t P = (N + kPanel - 1) / kPanel, Kh = (K + 1) / 2;
  auto packed = torch::empty({P, Kh, kPanel, 2}, weight.options().dtype(torch::kInt16));
  const float* w = weight.data_ptr<float>();
  c10::BFloat16* out = reinterpret_cast<c10::BFloat16*>(packed.data_ptr<int16_t>());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t col = 0; col < kPanel; ++col) {
        const int64_t n = p * kPanel + col;
        const float* row = n < N ? w + n * K : nullptr;
        c10::BFloat16* dst = out + (p * Kh * kPanel + col) * 2;
        for (int64_t kk = 0; kk < Kh; ++kk, dst += 2 * kPanel) {
          const int64_t k = 2 * kk;
          dst[0] = c10::BFloat16(row != nullptr ? row[k] : 0.0f);
          dst[1] = c10::BFloat16(row != nullptr && k + 1 < K ? row[k + 1] : 0.0f);
        }
      }
  });
  return packed;
}

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor wp, int64_t n, c10::optional<torch::Tensor> bias) {
  auto out = torch::empty({x.size(0), n}, x.options());
  bf16_linear_out(out, x, wp, bias);
  return out;
}

void fp32_linear_out(torch::Tensor out, torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  RECORD_FUNCTION("kvserve::fp32_linear", std::vector<c10::IValue>());  // kvserve profile's label, every caller
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_linear_rows(x, out, N);
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 2 && w.stride(1) == 1 && w.size(1) == K,
              "w must be float32 [N, K] with contiguous rows");
  if (M == 0) return;
  const float* b = optional_bias(bias, N);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* o = out.data_ptr<float>();
  over_column_ranges(N, std::min(N, threads_for(M * N * K)), [&](int64_t nb, int64_t ne) {
    fp32_block(xp, x.stride(0), wp, w.stride(0), K, M, nb, ne, o, out.stride(0), b);
  });
}

torch::Tensor fp32_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
  fp32_linear_out(out, x, w, bias);
  return out;
}

torch::Tensor table_rows(torch::Tensor w, c10::optional<torch::Tensor> w_scales, torch::Tensor ids) {
  const RowTable table(w, w_scales, "w");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(), "ids must be int64 [n]");
  const int64_t n = ids.size(0), K = table.width(), V = table.rows();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < V, "id ", ip[i], " out of range");
  auto out = torch::empty({n, K}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  kvserve::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* row = table.row(ip[i], o + i * K);
      if (row != o + i * K) std::memcpy(o + i * K, row, K * sizeof(float));
    }
  });
  return out;
}

torch::Tensor gathered_rows_dot(torch::Tensor x, torch::Tensor w, torch::Tensor idx,
                                c10::optional<torch::Tensor> w_scales) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a float32 CPU [S, K] tensor with contiguous rows");
  const RowTable table(w, w_scales, "w");
  TORCH_CHECK(table.width() == x.size(1), "w has rows of ", table.width(), ", x of ", x.size(1));
  TORCH_CHECK(idx.scalar_type() == torch::kInt64 && idx.dim() == 2 && idx.is_contiguous() && idx.size(0) == x.size(0),
              "idx must be int64 [S, k]");
  const int64_t S = x.size(0), C = idx.size(1), K = x.size(1), V = table.rows();
  auto out = torch::empty({S, C}, x.options());
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < S * C; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < V, "idx out of range");
  const float* xp = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // Each (row, candidate) pair alone: a decode step's 64 candidates are rows scattered over a
  // table the step's weights have evicted (SmolLM2: 64 x 2.3 KB of 113 MB), so the pairs are
  // shared by the threads and each fetches the rows kRowsAhead on while it sums the current one:
  // one row at a time its misses came one after another (~0.9 us a row on a Zen 3). A pair's
  // sum does not depend on the thread, nor on the table's storage (RowTable: the same row).
  constexpr int64_t kRowsAhead = 4;
  kvserve::parallel_for(0, S * C, 8, [&](int64_t p0, int64_t p1) {
    std::vector<float> buf(table.stored_as_fp32() ? 0 : K);  // a row of Q8_0 blocks, read out
    for (int64_t p = p0; p < std::min(p1, p0 + kRowsAhead); ++p) table.prefetch(ip[p]);
    for (int64_t p = p0; p < p1; ++p) {
      if (p + kRowsAhead < p1) table.prefetch(ip[p + kRowsAhead]);
      const float* xr[1] = {xp + (p / C) * x.stride(0)};
      const float* wr[1] = {table.row(ip[p], buf.data())};
#if defined(KVSERVE_DENSE_AVX512) || defined(KVSERVE_DOT_AVX2)
      if (!g_portable) {
        float res[1][8];
        dot_tile<1, 1>(xr, wr, K, res);
        o[p] = res[0][0];
        continue;
      }
#endif
      o[p] = dot_portable(xr[0], wr[0], K);
    }
  });
  return out;
}
