#pragma once

// fp16 rounding for the load-time packers (screen_linear.cpp, quant_linear.cpp), and fp16 bits
// read as fp32.

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#if defined(__F16C__)
#include <immintrin.h>
#endif

// f's nearest fp16 (ties to even), as torch's .half(). A magnitude that rounds past fp16's largest
// value (65504) becomes an infinity before the conversion: without F16C (the x86-64-v2 build) c10
// converts in software, relying on a float product overflowing, and the extension's
// -fassociative-math folds that product away (7e4 came out as a NaN).
inline c10::Half fp16_rne(float f) {
  return c10::Half(std::fabs(f) >= 65520.0f ? std::copysign(INFINITY, f) : f);
}

// The fp16 value with bits h as fp32 (exact): one vcvtph2ps with F16C, c10's bit manipulation
// otherwise.
inline float fp16_bits_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}
