// The paged KV-cache write (fp32, bf16, fp16 caches, and the int8 cache with its scales) and the
// huge-page advice for the KV pool.
#include <torch/extension.h>

#include "cpu_ops.h"
#include "cpu_kernels.h"
#include "int8_kv.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// One head vector x[0..D) of a token as int8: y = H x, then per group of int8_group_size(D)
// dims s = fp16(max|y| / 127), q[d] = round(y[d] / s) clamped to +-127; scale g goes to
// scales[g * scale_stride]. The same fp32 operations as kvserve.kv_cache's quantize_int8
// (round half to even), so the two agree bit for bit.
inline void quantize_int8_head(const float* x, int64_t D, float* y, int8_t* q, c10::Half* scales,
                               int64_t scale_stride) {
  std::copy(x, x + D, y);
  hadamard_(y, D);
  const int64_t group = int8_group_size(D);
  for (int64_t g = 0; g * group < D; ++g) {
    const float* yg = y + g * group;
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t d = 0; d < group; ++d) amax = std::max(amax, std::fabs(yg[d]));
    const c10::Half s_half(amax / 127.f);
    scales[g * scale_stride] = s_half;
    const float s = static_cast<float>(s_half);
    for (int64_t d = 0; d < group; ++d)
      q[g * group + d] =
          static_cast<int8_t>(s > 0.f ? std::min(std::max(std::nearbyint(yg[d] / s), -127.f), 127.f) : 0.f);
  }
}


// Scales [2, KVH, NB, groups, BS]: head h's scales of block b start at ((h * NB) + b) * groups * BS.
void write_kv_int8(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kv_cache, torch::Tensor& scales,
                   const torch::Tensor& slot_mapping) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t BS = kv_cache.size(3), NB = kv_cache.size(2), head_elems = NB * BS * D;
  const int64_t groups = scales.size(3);
  int8_t* keys = kv_cache.data_ptr<int8_t>();
  int8_t* values = keys + KVH * head_elems;
  c10::Half* key_scales = scales.data_ptr<c10::Half>();
  c10::Half* value_scales = key_scales + KVH * NB * groups * BS;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  std::vector<int8_t> q(D);
  std::vector<float> rotated(D);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = slots[t] / BS, offset = slots[t] % BS;
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t scale_at = (h * NB + block) * groups * BS + offset;
      int8_t* kdst = keys + h * head_elems + block * BS * D;
      quantize_int8_head(k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1), D, rotated.data(), q.data(),
                         key_scales + scale_at, BS);
      for (int64_t d = 0; d < D; ++d) kdst[int8_key_index(d, offset, BS)] = q[d];
      int8_t* vdst = values + h * head_elems + block * BS * D;
      quantize_int8_head(v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1), D, rotated.data(), q.data(),
                         value_scales + scale_at, BS);
      for (int64_t d = 0; d < D; ++d) vdst[int8_value_index(offset, d, D)] = q[d];
    }
  }
}

template <typename cache_t>
void write_kv_impl(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kv_cache,
                   const torch::Tensor& slot_mapping) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t BS = kv_cache.size(3), head_elems = kv_cache.size(2) * BS * D;
  cache_t* keys = kv_cache.data_ptr<cache_t>();
  cache_t* values = keys + KVH * head_elems;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = slots[t] / BS, offset = slots[t] % BS;
    for (int64_t h = 0; h < KVH; ++h) {
      const float* kx = k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1);
      const float* vx = v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1);
      // Keys: column `offset` of the block's [D, BS] matrix. Values: row `offset` of [BS, D].
      cache_t* kdst = keys + h * head_elems + block * D * BS + offset;
      for (int64_t d = 0; d < D; ++d) kdst[d * BS] = from_float<cache_t>(kx[d]);
      cache_t* vdst = values + h * head_elems + (block * BS + offset) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) vdst[d] = from_float<cache_t>(vx[d]);
    }
  }
}

}  // namespace

// Store k, v [T, KVH, D] (fp32, any row/head strides, contiguous head_dim) at their flat slots
// of kv_cache [2, KVH, num_blocks, block_size, D], converting to the cache's dtype, or, with
// kv_scales [2, KVH, num_blocks, block_size] (fp16), quantizing to the int8 cache. Keys are
// stored transposed per block, [D, block_size] (see kvserve/kv_cache.py).
void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache, c10::optional<torch::Tensor> kv_scales,
                    torch::Tensor slot_mapping) {
  check_fp32_cpu(k, "k");
  check_fp32_cpu(v, "v");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k/v head_dim must be contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be a contiguous [2, KVH, NB, BS, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  auto slots = slot_mapping.contiguous();
  if (kv_scales) {
    check_int8_cache(kv_cache, *kv_scales);
    write_kv_int8(k, v, kv_cache, *kv_scales, slots);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "write_kv_cache", [&] {
    write_kv_impl<scalar_t>(k, v, kv_cache, slots);
  });
}


// Ask the kernel for transparent huge pages under a large tensor (call before first touch).
// Paged attention reads blocks scattered over the KV pool: with 4 KB pages nearly every
// block read is a TLB miss. Returns whether the advice was taken (Linux only).
bool advise_huge_pages(torch::Tensor t) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = 2 << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = start + t.numel() * t.element_size();
  const uintptr_t aligned_start = (start + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t aligned_end = end & ~(kHuge - 1);
  if (aligned_end <= aligned_start) return false;
  return madvise(reinterpret_cast<void*>(aligned_start), aligned_end - aligned_start, MADV_HUGEPAGE) == 0;
#else
  return false;
#endif
}
