#pragma once

// bf16 bits and values, and which way this CPU should multiply bf16: shared by the dense bf16
// kernel (dense_linear.cpp) and attention over a bf16 cache (attention.cpp).

#include <cstdint>
#include <cstring>

// f's nearest bf16 (ties to even, as torch's .to(bfloat16)), as its 16 bits; f finite.
inline uint32_t bf16_bits_rne(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
}

inline float bf16_value(uint32_t b) {
  const uint32_t bits = b << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Whether a kernel with a bf16 dot-product route and a widened one (bf16 widened to fp32 for
// FMAs) takes the dot route here by default: yes where vdpbf16ps runs at the FMA's rate (AMD's
// Zen 4), no on Intel's cores, which run it at a quarter of that rate. Each kernel's route setter
// (set_bf16_kernel_route, set_attention_kernel_route: "dot" | "widened") overrides it; the route
// is fixed between its calls, so that every call computes a row the same way.
inline bool bf16_dot_default() { return __builtin_cpu_is("intel") == 0; }
