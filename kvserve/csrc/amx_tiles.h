#pragma once

// Intel's matrix unit (AMX) as the kernels use it: the tile configuration, the hardware's tile
// instructions, and a C++ model of them (the instruction set reference's pseudo-code) that runs
// the same tile program on any CPU. One program shape serves the bf16 GEMM (amx_linear.cpp)
// and attention over a bf16 cache (attention.cpp): C tiles 0-3 (fp32 sums), A tiles 4-5, B tiles
// 6-7, and the products C0 = A4 B6, C1 = A4 B7, C2 = A5 B6, C3 = A5 B7.

#include "bf16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define KVSERVE_AMX_HW 1
#endif

namespace kvserve_amx {

struct alignas(64) TileConfig {  // ldtilecfg's 64 bytes, palette 1
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tmm0..7 (8..15 reserved, zero)
  uint8_t rows[16] = {};    // rows of tmm0..7
};

// C tiles 0-3 and A tiles 4-5 hold `rows` rows (min(M, 16), so that a small call computes no
// padding), B tiles 6-7 sixteen k pairs; every row is 64 bytes.
inline TileConfig tile_config(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t >= 6 ? 16 : static_cast<uint8_t>(rows);
  }
  return cfg;
}

// The tile unit as the instruction set reference describes it: each C row takes, for each
// k pair in order, its column's first product and then its second. It accepts the same tile
// numbers as HardwareTiles and checks the shape rules whose breach would fault there
// (LDTILECFG: at most 16 rows of at most 64 bytes; TDPBF16PS: C and A rows equal, A's k pairs
// are B's rows, C and B rows equally wide), so that the tests catch what the hardware would.
// What it does not model: the hardware's own order of a TDPBF16PS's sums (here sequential, so
// exact zeros in any grouping leave a sum's bits alone; a program must group its operands the
// same way wherever a row's bits must not change), its flushing of denormal inputs and outputs
// (DAZ, FTZ), and a load's bounds (a read past a buffer's end goes unnoticed here). The forked
// self-tests run each tile program on the hardware against this model before it is used.
class EmulatedTiles {
 public:
  void configure(const TileConfig& cfg) {
    require(cfg.palette == 1 && cfg.start_row == 0, "palette 1, start row 0");
    for (int t = 0; t < 8; ++t) require(cfg.rows[t] <= 16 && cfg.colsb[t] <= 64, "at most 16 rows of 64 bytes");
    std::memcpy(rows_, cfg.rows, sizeof(rows_));
    std::memcpy(colsb_, cfg.colsb, sizeof(colsb_));
    std::memset(data_, 0, sizeof(data_));
  }
  void release() {}
  template <int T>
  void zero() {
    static_assert(T >= 0 && T < 4, "the program zeroes C tiles 0-3");
    std::memset(data_[T], 0, sizeof(data_[T]));
  }
  template <int T>
  void load(const void* base, int64_t stride) {
    static_assert(T >= 4 && T < 8, "the program loads A tiles 4-5 and B tiles 6-7");
    for (int r = 0; r < rows_[T]; ++r) std::memcpy(data_[T][r], static_cast<const char*>(base) + r * stride, colsb_[T]);
  }
  template <int T>
  void store(void* base, int64_t stride) const {
    static_assert(T >= 0 && T < 4, "the program stores C tiles 0-3");
    for (int r = 0; r < rows_[T]; ++r) std::memcpy(static_cast<char*>(base) + r * stride, data_[T][r], colsb_[T]);
  }
  template <int C, int A, int B>
  void dot() {
    static_assert((C == 0 && A == 4 && B == 6) || (C == 1 && A == 4 && B == 7) || (C == 2 && A == 5 && B == 6) ||
                      (C == 3 && A == 5 && B == 7),
                  "the program's products are C0 = A4 B6, C1 = A4 B7, C2 = A5 B6, C3 = A5 B7");
    require(rows_[C] == rows_[A] && colsb_[A] / 4 == rows_[B] && colsb_[C] == colsb_[B] && colsb_[C] % 4 == 0,
            "TDPBF16PS tile shapes");
    for (int m = 0; m < rows_[C]; ++m) {
      float acc[16];
      std::memcpy(acc, data_[C][m], sizeof(acc));
      for (int k = 0; k < rows_[B]; ++k) {
        uint16_t a[2], b[32];
        std::memcpy(a, data_[A][m] + 4 * k, sizeof(a));
        std::memcpy(b, data_[B][k], sizeof(b));
        const float a0 = bf16_value(a[0]), a1 = bf16_value(a[1]);
        for (int n = 0; n < colsb_[C] / 4; ++n) {
          acc[n] = std::fma(a0, bf16_value(b[2 * n]), acc[n]);
          acc[n] = std::fma(a1, bf16_value(b[2 * n + 1]), acc[n]);
        }
      }
      std::memcpy(data_[C][m], acc, sizeof(acc));
    }
  }

 private:
  static void require(bool ok, const char* rule) {
    if (!ok) throw std::logic_error(std::string("AMX tile program breaks a rule: ") + rule);
  }
  uint8_t rows_[16] = {};
  uint16_t colsb_[16] = {};
  alignas(64) uint8_t data_[8][16][64];
};

#ifdef KVSERVE_AMX_HW
template <int>
constexpr bool kNoSuchTile = false;

// The hardware's tiles, as fixed encodings (the base address in rax, the row stride in rdx)
// rather than mnemonics, which need binutils >= 2.36: with an older assembler the whole
// extension would fail to build, on every CPU. Memory clobbers throughout (GCC's _tile_*
// macros have none, so the compiler could keep a tile's source in registers or read a stored
// tile's memory before the store). The tile numbers are part of the encodings, hence one
// statement per tile, and a call this program does not make fails to compile.
class HardwareTiles {
 public:
  void configure(const TileConfig& cfg) {  // ldtilecfg (%rax)
    __asm__ volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0x00" ::"a"(&cfg) : "memory");
  }
  void release() { __asm__ volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0xc0" ::: "memory"); }  // tilerelease
  template <int T>
  void zero() {  // tilezero %tmmT
    if constexpr (T == 0) __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x49, 0xc0" ::: "memory");
    else if constexpr (T == 1) __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x49, 0xc8" ::: "memory");
    else if constexpr (T == 2) __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x49, 0xd0" ::: "memory");
    else if constexpr (T == 3) __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x49, 0xd8" ::: "memory");
    else static_assert(kNoSuchTile<T>, "the program zeroes C tiles 0-3");
  }
  template <int T>
  void load(const void* base, int64_t stride) {  // tileloadd (%rax,%rdx,1), %tmmT
    if constexpr (T == 4) __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x4b, 0x24, 0x10" ::"a"(base), "d"(stride) : "memory");
    else if constexpr (T == 5) __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x4b, 0x2c, 0x10" ::"a"(base), "d"(stride) : "memory");
    else if constexpr (T == 6) __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x4b, 0x34, 0x10" ::"a"(base), "d"(stride) : "memory");
    else if constexpr (T == 7) __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x4b, 0x3c, 0x10" ::"a"(base), "d"(stride) : "memory");
    else static_assert(kNoSuchTile<T>, "the program loads A tiles 4-5 and B tiles 6-7");
  }
  template <int T>
  void store(void* base, int64_t stride) const {  // tilestored %tmmT, (%rax,%rdx,1)
    if constexpr (T == 0) __asm__ volatile(".byte 0xc4, 0xe2, 0x7a, 0x4b, 0x04, 0x10" ::"a"(base), "d"(stride) : "memory");
    else if constexpr (T == 1) __asm__ volatile(".byte 0xc4, 0xe2, 0x7a, 0x4b, 0x0c, 0x10" ::"a"(base), "d"(stride) : "memory");
    else if constexpr (T == 2) __asm__ volatile(".byte 0xc4, 0xe2, 0x7a, 0x4b, 0x14, 0x10" ::"a"(base), "d"(stride) : "memory");
    else if constexpr (T == 3) __asm__ volatile(".byte 0xc4, 0xe2, 0x7a, 0x4b, 0x1c, 0x10" ::"a"(base), "d"(stride) : "memory");
    else static_assert(kNoSuchTile<T>, "the program stores C tiles 0-3");
  }
  template <int C, int A, int B>
  void dot() {  // tdpbf16ps %tmmB, %tmmA, %tmmC: C += A . B
    if constexpr (C == 0 && A == 4 && B == 6) __asm__ volatile(".byte 0xc4, 0xe2, 0x4a, 0x5c, 0xc4" ::: "memory");
    else if constexpr (C == 1 && A == 4 && B == 7) __asm__ volatile(".byte 0xc4, 0xe2, 0x42, 0x5c, 0xcc" ::: "memory");
    else if constexpr (C == 2 && A == 5 && B == 6) __asm__ volatile(".byte 0xc4, 0xe2, 0x4a, 0x5c, 0xd5" ::: "memory");
    else if constexpr (C == 3 && A == 5 && B == 7) __asm__ volatile(".byte 0xc4, 0xe2, 0x42, 0x5c, 0xdd" ::: "memory");
    else static_assert(kNoSuchTile<C>, "the program's products are C0 = A4 B6, C1 = A4 B7, C2 = A5 B6, C3 = A5 B7");
  }
};
#endif

}  // namespace kvserve_amx
