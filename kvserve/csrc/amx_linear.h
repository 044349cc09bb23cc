#pragma once

// The bf16 kernel's route through Intel's matrix unit (AMX: eight tile registers of up to
// 16 rows x 64 bytes, and TDPBF16PS, a 16 x 16 block of fp32 sums over 32 bf16 products per
// instruction), for the same packed panels as dense_linear.cpp. See amx_linear.cpp.

#include <cstdint>
#include <functional>
#include <string>

struct AmxBf16Call {
  const uint32_t* x;  // activations as bf16 k pairs, [rows rounded up to kAmxRows][Kh] words
  const uint16_t* w;  // kvserve.quant.pack_bf16_weight's panels [P][Kh][32][2]
  int64_t Kh, N;
  float* out;
  int64_t out_stride;
  const float* bias;  // or nullptr
};

// Activation rows a tile holds: a call's rows are read in whole tiles, so the activation
// buffer must hold M rounded up to this many rows (the padding's sums are never stored).
constexpr int64_t kAmxRows = 16;
// Inputs (k) a tile step takes: calls whose K is not a multiple stay on the vector route.
constexpr int64_t kAmxDepth = 32;

// Whether this process may run the tile route: the CPU has AMX-TILE and AMX-BF16, the OS
// saves tile state (XCR0) and grants this process the tile data (arch_prctl), and a self-test
// in a forked child (so that a fault cannot take this process down) agrees with the emulation.
// Decided once per process.
bool amx_bf16_available();
// "available", or why not (the CPU, the OS, the kernel's permission, the self-test's verdict).
std::string amx_bf16_status();
// Tests, on any Linux x86-64 machine: the self-test's fork, comparison and wait, with the
// child running the emulation (true: they agree, as they must).
bool amx_self_test_machinery();

// Panels [pb, pe) of all M rows (M >= 1; Kh a multiple of kAmxDepth / 2). `emulated`: the same
// tile program on a C++ model of the tile unit (any CPU; tests), else the hardware's.
void amx_bf16_panels(const AmxBf16Call& call, int64_t M, int64_t pb, int64_t pe, bool emulated);

// Runs `agrees` in a forked child, so that a fault there (a tile program's on hardware it has
// never met) cannot take this process down; waits at most 10 s. "" where it returned true, else
// why not. Everything `agrees` touches must be allocated before the call: a child of a threaded
// process must not allocate. (The self-tests of amx_bf16_available and of the attention route.)
std::string forked_check(const std::function<bool()>& agrees);
