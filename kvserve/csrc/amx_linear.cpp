// bf16 linear layers on Intel's matrix unit (AMX), batch invariant like every kvserve kernel.
//
// A TDPBF16PS multiplies an A tile (16 activation rows x 16 k pairs) by a B tile (16 k pairs x
// 16 output columns, each column's pair side by side: exactly a half of one of
// pack_bf16_weight's 32-column panels, read with a 128-byte row stride) into a C tile of 16 x 16
// fp32 sums. Each output starts at zero and takes its K in tiles of 32 inputs in ascending
// order, row by row independently of the tile's other rows, so a row gets the same bits in
// any call, wherever it sits and however many rows share the call (the padding rows of a
// partial tile are computed and dropped). The hardware's rounding inside one instruction is
// its own, so this route's bits differ from the vector routes': like them it is fixed for
// the process (dense_linear.cpp picks one route at start-up).
//
// Blocking: 2 x 2 C tiles (32 rows x one 32-column panel), A tiles in tmm4-5, B in tmm6-7; for
// each thread's panels, row blocks of kRowBlock rows so that the block's activations stay in
// L2 while the panels pass over them (a panel is Kh x 128 bytes: 36 KB at K = 576).
//
// This file was written on machines without AMX: the tile program runs here on
// EmulatedTiles (the instruction set reference's pseudo-code), which the tests check against
// the portable loop, and on an AMX machine only once a forked self-test has compared the
// hardware with the emulation (amx_bf16_available).
#include "amx_linear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define KVSERVE_AMX_HW 1
#include <cpuid.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kRowBlock = 128;

struct alignas(64) TileConfig {  // ldtilecfg's 64 bytes, palette 1
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tmm0..7 (8..15 reserved, zero)
  uint8_t rows[16] = {};    // rows of tmm0..7
};

// C tiles 0-3 and A tiles 4-5 hold `rows` rows (min(M, 16), so that a small call computes no
// padding), B tiles 6-7 sixteen k pairs; every row is 64 bytes.
TileConfig tile_config(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t >= 6 ? 16 : static_cast<uint8_t>(rows);
  }
  return cfg;
}

float bf16_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

// The tile unit as the instruction set reference describes it: each C row takes, for each
// k pair in order, its column's first product and then its second.
class EmulatedTiles {
 public:
  void configure(const TileConfig& cfg) {
    std::memcpy(rows_, cfg.rows, sizeof(rows_));
    std::memset(data_, 0, sizeof(data_));
  }
  void release() {}
  template <int T>
  void zero() {
    std::memset(data_[T], 0, sizeof(data_[T]));
  }
  template <int T>
  void load(const void* base, int64_t stride) {
    for (int r = 0; r < rows_[T]; ++r) std::memcpy(data_[T][r], static_cast<const char*>(base) + r * stride, 64);
  }
  template <int T>
  void store(void* base, int64_t stride) const {
    for (int r = 0; r < rows_[T]; ++r) std::memcpy(static_cast<char*>(base) + r * stride, data_[T][r], 64);
  }
  template <int C, int A, int B>
  void dot() {
    for (int m = 0; m < rows_[C]; ++m) {
      float acc[16];
      std::memcpy(acc, data_[C][m], sizeof(acc));
      for (int k = 0; k < rows_[B]; ++k) {
        uint16_t a[2], b[32];
        std::memcpy(a, data_[A][m] + 4 * k, sizeof(a));
        std::memcpy(b, data_[B][k], sizeof(b));
        const float a0 = bf16_float(a[0]), a1 = bf16_float(a[1]);
        for (int n = 0; n < 16; ++n) {
          acc[n] = std::fma(a0, bf16_float(b[2 * n]), acc[n]);
          acc[n] = std::fma(a1, bf16_float(b[2 * n + 1]), acc[n]);
        }
      }
      std::memcpy(data_[C][m], acc, sizeof(acc));
    }
  }

 private:
  uint8_t rows_[16] = {};
  alignas(64) uint8_t data_[8][16][64];
};

#ifdef KVSERVE_AMX_HW
// The hardware's tiles. Inline assembly with memory clobbers (GCC's _tile_* macros have none,
// so the compiler could keep a tile's source in registers or read a stored tile's memory
// before the store); the register numbers must be literals, hence one statement per tile.
class HardwareTiles {
 public:
  void configure(const TileConfig& cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory"); }
  void release() { __asm__ volatile("tilerelease" ::: "memory"); }
  template <int T>
  void zero() {
#define KVSERVE_TILE_ZERO(n) \
  if constexpr (T == n) __asm__ volatile("tilezero %%tmm" #n ::: "memory");
    KVSERVE_TILE_ZERO(0) KVSERVE_TILE_ZERO(1) KVSERVE_TILE_ZERO(2) KVSERVE_TILE_ZERO(3)
#undef KVSERVE_TILE_ZERO
  }
  template <int T>
  void load(const void* base, int64_t stride) {
#define KVSERVE_TILE_LOAD(n) \
  if constexpr (T == n) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #n ::"r"(base), "r"(stride) : "memory");
    KVSERVE_TILE_LOAD(4) KVSERVE_TILE_LOAD(5) KVSERVE_TILE_LOAD(6) KVSERVE_TILE_LOAD(7)
#undef KVSERVE_TILE_LOAD
  }
  template <int T>
  void store(void* base, int64_t stride) const {
#define KVSERVE_TILE_STORE(n) \
  if constexpr (T == n) __asm__ volatile("tilestored %%tmm" #n ", (%0,%1,1)" ::"r"(base), "r"(stride) : "memory");
    KVSERVE_TILE_STORE(0) KVSERVE_TILE_STORE(1) KVSERVE_TILE_STORE(2) KVSERVE_TILE_STORE(3)
#undef KVSERVE_TILE_STORE
  }
  template <int C, int A, int B>
  void dot() {  // AT&T order: B, A, C
#define KVSERVE_TILE_DOT(c, a, b)                   \
  if constexpr (C == c && A == a && B == b)         \
    __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory");
    KVSERVE_TILE_DOT(0, 4, 6) KVSERVE_TILE_DOT(1, 4, 7) KVSERVE_TILE_DOT(2, 5, 6) KVSERVE_TILE_DOT(3, 5, 7)
#undef KVSERVE_TILE_DOT
  }
};
#endif

// Up to 2 x 16 rows from m0 (`rows` valid) x the 32 columns of panel p: sums from zero over
// every k in tiles of 16 pairs, then the bias, stored where the row and column exist.
template <class Tiles>
void panel_block(Tiles& tiles, const AmxBf16Call& c, int64_t m0, int64_t rows, int64_t tile_rows, int64_t p) {
  const bool two = rows > tile_rows;
  const int64_t x_stride = c.Kh * 4;
  const uint32_t* x0 = c.x + m0 * c.Kh;
  const uint32_t* x1 = x0 + tile_rows * c.Kh;
  const uint16_t* w = c.w + p * c.Kh * 64;
  tiles.template zero<0>();
  tiles.template zero<1>();
  if (two) {
    tiles.template zero<2>();
    tiles.template zero<3>();
  }
  for (int64_t kk = 0; kk < c.Kh; kk += 16) {
    tiles.template load<4>(x0 + kk, x_stride);
    tiles.template load<6>(w + kk * 64, 128);
    tiles.template load<7>(w + kk * 64 + 32, 128);
    tiles.template dot<0, 4, 6>();
    tiles.template dot<1, 4, 7>();
    if (two) {
      tiles.template load<5>(x1 + kk, x_stride);
      tiles.template dot<2, 5, 6>();
      tiles.template dot<3, 5, 7>();
    }
  }
  alignas(64) float sums[32][32];
  tiles.template store<0>(&sums[0][0], sizeof(sums[0]));
  tiles.template store<1>(&sums[0][16], sizeof(sums[0]));
  if (two) {
    tiles.template store<2>(&sums[tile_rows][0], sizeof(sums[0]));
    tiles.template store<3>(&sums[tile_rows][16], sizeof(sums[0]));
  }
  const int64_t col0 = p * 32, cols = std::min<int64_t>(32, c.N - col0);
  for (int64_t r = 0; r < rows; ++r) {
    float* o = c.out + (m0 + r) * c.out_stride + col0;
    for (int64_t j = 0; j < cols; ++j) o[j] = sums[r][j] + (c.bias ? c.bias[col0 + j] : 0.f);
  }
}

template <class Tiles>
void tile_panels(const AmxBf16Call& c, int64_t M, int64_t pb, int64_t pe) {
  Tiles tiles;
  const int64_t tile_rows = std::min(M, kAmxRows);
  tiles.configure(tile_config(static_cast<int>(tile_rows)));
  for (int64_t mb = 0; mb < M; mb += kRowBlock) {
    const int64_t me = std::min(M, mb + kRowBlock);
    for (int64_t p = pb; p < pe; ++p)
      for (int64_t m = mb; m < me; m += 2 * tile_rows) panel_block(tiles, c, m, std::min(2 * tile_rows, me - m), tile_rows, p);
  }
  tiles.release();
}

#ifdef KVSERVE_AMX_HW
bool cpu_and_os_have_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
  if (!amx_bf16 || !amx_tile) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE: xgetbv exists
  uint32_t xcr0_low, xcr0_high;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if (((xcr0_low >> 17) & 3) != 3) return false;  // XTILECFG and XTILEDATA state enabled by the OS
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // Linux >= 5.16
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// A forked child runs the tiles (the hardware's, or for the tests of this machinery the
// emulation again) on two small problems (a partial tile of rows and one of several row blocks,
// a ragged last panel, a bias) and compares each output with the emulation's, within fp32
// rounding of the sum of |products|; everything it touches is allocated before the fork.
// Exit 0: agreement.
bool forked_tiles_match_emulation(bool hardware) {
  struct Case {
    int64_t M, K, N;
  };
  const Case cases[] = {{37, 64, 80}, {3, 96, 40}};
  std::vector<std::vector<uint32_t>> xs;
  std::vector<std::vector<uint16_t>> ws;
  std::vector<std::vector<float>> want, got, bound;
  std::vector<float> bias(96);
  uint32_t seed = 12345;
  auto next_bf16 = [&]() {  // small normal bf16 values, never denormal
    seed = seed * 1664525u + 1013904223u;
    const float v = (static_cast<float>((seed >> 9) & 0x3FFF) / 8192.f - 1.f) * 0.5f;
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    return static_cast<uint16_t>(v == 0.f ? 0x3F80 : bits >> 16);
  };
  for (auto& b : bias) b = bf16_float(next_bf16());
  for (const Case& t : cases) {
    const int64_t Kh = t.K / 2, P = (t.N + 31) / 32, rows = (t.M + kAmxRows - 1) / kAmxRows * kAmxRows;
    xs.emplace_back(rows * Kh);
    ws.emplace_back(P * Kh * 64);
    for (auto& v : xs.back()) v = next_bf16() | (static_cast<uint32_t>(next_bf16()) << 16);
    for (auto& v : ws.back()) v = next_bf16();
    want.emplace_back(t.M * t.N);
    got.emplace_back(t.M * t.N, std::nanf(""));
    bound.emplace_back(t.M * t.N, 0.f);
    const AmxBf16Call call{xs.back().data(), ws.back().data(), Kh, t.N, want.back().data(), t.N, bias.data()};
    tile_panels<EmulatedTiles>(call, t.M, 0, P);
    for (int64_t m = 0; m < t.M; ++m)
      for (int64_t n = 0; n < t.N; ++n) {
        float s = std::fabs(bias[n]);
        for (int64_t k = 0; k < t.K; ++k) {
          const uint32_t word = xs.back()[m * Kh + k / 2];
          const float a = bf16_float(static_cast<uint16_t>(k % 2 ? word >> 16 : word & 0xFFFF));
          s += std::fabs(a * bf16_float(ws.back()[((n / 32) * Kh + k / 2) * 64 + (n % 32) * 2 + k % 2]));
        }
        bound.back()[m * t.N + n] = 1e-5f * s + 1e-30f;
      }
  }
  const pid_t child = fork();
  if (child < 0) return false;
  if (child == 0) {
    int status = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); ++i) {
      const Case& t = cases[i];
      const AmxBf16Call call{xs[i].data(), ws[i].data(), t.K / 2, t.N, got[i].data(), t.N, bias.data()};
      if (hardware) tile_panels<HardwareTiles>(call, t.M, 0, (t.N + 31) / 32);
      else tile_panels<EmulatedTiles>(call, t.M, 0, (t.N + 31) / 32);
      for (int64_t j = 0; j < t.M * t.N; ++j)
        if (!(std::fabs(got[i][j] - want[i][j]) <= bound[i][j])) status = 3;
    }
    _exit(status);
  }
  int status = 0;
  for (int waited_ms = 0;; ++waited_ms) {
    const pid_t done = waitpid(child, &status, WNOHANG);
    if (done == child) break;
    if (done < 0 || waited_ms > 5000) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      return false;
    }
    const timespec ms{0, 1000000};
    nanosleep(&ms, nullptr);
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}
#endif

}  // namespace

bool amx_bf16_available() {
#ifdef KVSERVE_AMX_HW
  static const bool available = cpu_and_os_have_amx_bf16() && forked_tiles_match_emulation(true);
  return available;
#else
  return false;
#endif
}

bool amx_self_test_machinery() {
#ifdef KVSERVE_AMX_HW
  return forked_tiles_match_emulation(false);
#else
  return false;
#endif
}

void amx_bf16_panels(const AmxBf16Call& call, int64_t M, int64_t pb, int64_t pe, bool emulated) {
#ifdef KVSERVE_AMX_HW
  if (!emulated) return tile_panels<HardwareTiles>(call, M, pb, pe);
#endif
  tile_panels<EmulatedTiles>(call, M, pb, pe);
}
