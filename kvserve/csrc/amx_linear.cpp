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
// each thread's panels, row blocks of about 1 MB of activations (kRowBlockBytes) so that they
// stay in L2 while the panels pass over them (a panel is Kh x 128 bytes: 36 KB at K = 576).
// Whole blocks of tiles are stored straight into the output, partial ones through a buffer.
//
// This file was written on machines without AMX: the tile program runs here on
// EmulatedTiles (the instruction set reference's pseudo-code), which the tests check against
// the portable loop, and on an AMX machine only once a forked self-test has compared the
// hardware with the emulation (amx_bf16_available).
#include "amx_linear.h"
#include "amx_tiles.h"
#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef KVSERVE_AMX_HW
#include <cpuid.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#endif

namespace {

using kvserve_amx::EmulatedTiles;
#ifdef KVSERVE_AMX_HW
using kvserve_amx::HardwareTiles;
#endif
using kvserve_amx::tile_config;

// Activation bytes a thread keeps in cache while its panels pass over them (L2 is 1-2 MB on
// the AMX cores): each row block reads the thread's panels once more.
constexpr int64_t kRowBlockBytes = 1 << 20;

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
  const int64_t col0 = p * 32, cols = std::min<int64_t>(32, c.N - col0);
  float* o = c.out + m0 * c.out_stride + col0;
  if (rows == (two ? 2 : 1) * tile_rows && cols == 32) {  // whole tiles: stored in place
    const int64_t o_bytes = c.out_stride * 4;
    tiles.template store<0>(o, o_bytes);
    tiles.template store<1>(o + 16, o_bytes);
    if (two) {
      tiles.template store<2>(o + tile_rows * c.out_stride, o_bytes);
      tiles.template store<3>(o + tile_rows * c.out_stride + 16, o_bytes);
    }
    if (c.bias)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < 32; ++j) o[r * c.out_stride + j] += c.bias[col0 + j];
    return;
  }
  alignas(64) float sums[32][32];
  tiles.template store<0>(&sums[0][0], sizeof(sums[0]));
  tiles.template store<1>(&sums[0][16], sizeof(sums[0]));
  if (two) {
    tiles.template store<2>(&sums[tile_rows][0], sizeof(sums[0]));
    tiles.template store<3>(&sums[tile_rows][16], sizeof(sums[0]));
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) o[r * c.out_stride + j] = sums[r][j] + (c.bias ? c.bias[col0 + j] : 0.f);
}

template <class Tiles>
void tile_panels(const AmxBf16Call& c, int64_t M, int64_t pb, int64_t pe) {
  Tiles tiles;
  const int64_t tile_rows = std::min(M, kAmxRows);
  tiles.configure(tile_config(static_cast<int>(tile_rows)));
  const int64_t row_block = std::max<int64_t>(32, kRowBlockBytes / (c.Kh * 4) / 32 * 32);
  for (int64_t mb = 0; mb < M; mb += row_block) {
    const int64_t me = std::min(M, mb + row_block);
    for (int64_t p = pb; p < pe; ++p)
      for (int64_t m = mb; m < me; m += 2 * tile_rows) panel_block(tiles, c, m, std::min(2 * tile_rows, me - m), tile_rows, p);
  }
  tiles.release();
}

#ifdef KVSERVE_AMX_HW
// Why the hardware route may not run here, or "" where it may (so far: the self-test is next).
std::string cpu_and_os_refusal() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1))
    return "the CPU has no AMX-BF16 / AMX-TILE";
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return "the OS has not enabled XSAVE";
  uint32_t xcr0_low, xcr0_high;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if (((xcr0_low >> 17) & 3) != 3) return "the OS does not save tile state (XCR0 bits 17-18)";
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // Linux >= 5.16
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
    return "the kernel refused the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, errno " + std::to_string(errno) + ")";
  return "";
}

// The GEMM's self-test: two small problems (a partial tile of rows and two whole ones, a ragged
// last panel, a bias) on the tiles (the hardware's, or for the tests of this machinery the
// emulation again), each output compared with the emulation's within fp32 rounding of the sum of
// |products| (a wrong operand, layout or stride is off by orders of magnitude more).
std::string forked_tiles_disagreement(bool hardware) {
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
  for (auto& b : bias) b = bf16_value(next_bf16());
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
          const float a = bf16_value(static_cast<uint16_t>(k % 2 ? word >> 16 : word & 0xFFFF));
          s += std::fabs(a * bf16_value(ws.back()[((n / 32) * Kh + k / 2) * 64 + (n % 32) * 2 + k % 2]));
        }
        bound.back()[m * t.N + n] = 1e-5f * s + 1e-30f;
      }
  }
  return forked_check([&] {
    bool agree = true;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); ++i) {
      const Case& t = cases[i];
      const AmxBf16Call call{xs[i].data(), ws[i].data(), t.K / 2, t.N, got[i].data(), t.N, bias.data()};
      if (hardware) tile_panels<HardwareTiles>(call, t.M, 0, (t.N + 31) / 32);
      else tile_panels<EmulatedTiles>(call, t.M, 0, (t.N + 31) / 32);
      for (int64_t j = 0; j < t.M * t.N; ++j)
        if (!(std::fabs(got[i][j] - want[i][j]) <= bound[i][j])) agree = false;
    }
    return agree;
  });
}
#endif

// "" where the hardware route may run, else why not; decided once per process.
const std::string& refusal() {
#ifdef KVSERVE_AMX_HW
  static const std::string why = [] {
    std::string r = cpu_and_os_refusal();
    return r.empty() ? forked_tiles_disagreement(true) : r;
  }();
#else
  static const std::string why = "not an x86-64 Linux build";
#endif
  return why;
}

}  // namespace

// The child's verdict comes back as one byte on a pipe.
std::string forked_check(const std::function<bool()>& agrees) {
#ifndef KVSERVE_AMX_HW
  (void)agrees;
  return "not an x86-64 Linux build";
#else
  int verdict_pipe[2];
  if (pipe(verdict_pipe) != 0) return "self-test: no pipe (errno " + std::to_string(errno) + ")";
  const pid_t child = fork();
  if (child < 0) {
    close(verdict_pipe[0]);
    close(verdict_pipe[1]);
    return "self-test: fork failed (errno " + std::to_string(errno) + ")";
  }
  if (child == 0) {
    // A fault here must end this child quietly: not through the parent's handlers (Python's
    // faulthandler would print the parent's traceback) and without a core dump of the whole
    // (model-sized) process.
    struct sigaction default_action {};
    default_action.sa_handler = SIG_DFL;
    for (int sig : {SIGILL, SIGSEGV, SIGBUS, SIGFPE, SIGTRAP, SIGABRT}) sigaction(sig, &default_action, nullptr);
    const rlimit no_core{0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    close(verdict_pipe[0]);
    const char verdict = agrees() ? 'y' : 'n';
    ssize_t written;
    do written = write(verdict_pipe[1], &verdict, 1);
    while (written < 0 && errno == EINTR);
    _exit(0);
  }
  close(verdict_pipe[1]);
  timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  char verdict = 0;
  bool answered = false, timed_out = false;
  for (;;) {
    clock_gettime(CLOCK_MONOTONIC, &now);
    const int64_t left_ms = 10000 - ((now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000);
    if (left_ms <= 0) {
      timed_out = true;
      break;
    }
    pollfd fd{verdict_pipe[0], POLLIN, 0};
    const int ready = poll(&fd, 1, static_cast<int>(left_ms));
    if (ready < 0 && errno == EINTR) continue;
    if (ready > 0) answered = read(verdict_pipe[0], &verdict, 1) == 1;  // 0 bytes: the child died first
    break;
  }
  close(verdict_pipe[0]);
  if (timed_out) kill(child, SIGKILL);  // still ours: not reaped yet
  int status = 0;
  pid_t reaped;
  do reaped = waitpid(child, &status, 0);
  while (reaped < 0 && errno == EINTR);  // ECHILD (SIGCHLD ignored: reaped already) is no verdict
  if (timed_out) return "self-test: the child gave no answer in 10 s";
  if (!answered) {
    if (reaped == child && WIFSIGNALED(status))
      return "self-test: the child died of signal " + std::to_string(WTERMSIG(status));
    return "self-test: the child died without an answer";
  }
  return verdict == 'y' ? "" : "self-test: the hardware's tiles disagree with the emulation";
#endif
}

bool amx_bf16_available() { return refusal().empty(); }

std::string amx_bf16_status() { return refusal().empty() ? "available" : refusal(); }

bool amx_self_test_machinery() {
#ifdef KVSERVE_AMX_HW
  return forked_tiles_disagreement(false).empty();
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
