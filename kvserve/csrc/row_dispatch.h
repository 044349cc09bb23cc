// Row-count dispatch for the kernels that are templates over how many activation rows they
// compute together (their accumulators live in registers, so the count must be a constant).
#pragma once

#include <cstdint>
#include <type_traits>

// Calls kernel(std::integral_constant<int, R>{}) with R = min(rows, kMax), for rows >= 1.
template <int kMax, typename Kernel>
inline void dispatch_rows(int64_t rows, Kernel&& kernel) {
  if constexpr (kMax > 1) {
    if (rows < kMax) return dispatch_rows<kMax - 1>(rows, kernel);
  }
  kernel(std::integral_constant<int, kMax>{});
}
