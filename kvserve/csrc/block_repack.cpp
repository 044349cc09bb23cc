// See block_repack.h. Values as kvserve.block_formats unpacks them (the tests compare the two).
#include "block_repack.h"

#include <ATen/Parallel.h>

#include <cstring>

#include "fp16.h"
#include "ggml_rows.h"

namespace {

constexpr int64_t kTileRows = 16;

void check_raw(const torch::Tensor& raw, int64_t type, int64_t K) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.stride(1) == 1,
              "raw must be a CPU uint8 [rows, row bytes] tensor with contiguous rows");
  TORCH_CHECK(ggml_row_bytes(type, K) == raw.size(1), "GGML type ", type, " with K = ", K, " does not have rows of ",
              raw.size(1), " bytes");
}

// A matrix's rows where the file stores them, in row-stacked parts (a fused projection's q, k and
// v tensors): the repacks read each row in place, where concatenating the parts first had copied
// every fused layer's bytes once more (0.8 s of a 1B model's 2.7 s load).
class StackedRows {
 public:
  StackedRows(const std::vector<torch::Tensor>& parts, int64_t type, int64_t K) {
    TORCH_CHECK(!parts.empty(), "a GGUF matrix needs at least one part");
    for (const auto& raw : parts) {
      check_raw(raw, type, K);
      const uint8_t* in = raw.data_ptr<uint8_t>();
      for (int64_t n = 0; n < raw.size(0); ++n) rows_.push_back(in + n * raw.stride(0));
    }
  }
  int64_t size() const { return static_cast<int64_t>(rows_.size()); }
  const uint8_t* operator[](int64_t n) const { return rows_[n]; }

 private:
  std::vector<const uint8_t*> rows_;
};

// Group g's 32 values (0..15) of a Q4_1 row (blocks of 20 bytes: d, m, qs) or a Q4_0 row (18:
// d, qs), and the fp16 bits of its d and m: Q4_0's w = d (q - 8) is d q + m with m = -8 d, exact
// in fp16 (a power of two times d).
void q4_group(const uint8_t* row, bool q4_0, int64_t g, uint8_t* values, uint16_t& d, uint16_t& m) {
  const uint8_t* block = row + g * (q4_0 ? 18 : 20);
  const uint8_t* qs = block + (q4_0 ? 2 : 4);
  for (int l = 0; l < 16; ++l) {
    values[l] = qs[l] & 0xF;
    values[l + 16] = qs[l] >> 4;
  }
  std::memcpy(&d, block, 2);
  if (!q4_0) {
    std::memcpy(&m, block + 2, 2);
    return;
  }
  const c10::Half offset = fp16_rne(-8.f * fp16_bits_to_float(d));
  std::memcpy(&m, &offset, 2);
}

}  // namespace

// Q4_K's and Q5_K's own tiles (quant_linear.cpp's KQuantTiles): per tile and super-block, 8 groups
// of [256 bytes of nibbles, (Q5_K) 8 masks of the fifth bits, sc[16], mn[16]], then d[16] and
// dmin[16] as stored (fp16).
static torch::Tensor k_quant_tiles(const StackedRows& rows, int64_t K, bool five) {
  const int64_t mask_bytes = five ? 64 : 0, kGroupBytes = 256 + mask_bytes + 32, kSuperBytes = 8 * kGroupBytes + 64;
  const int64_t block_bytes = five ? 176 : 144;
  const int64_t N = rows.size(), tiles = (N + kTileRows - 1) / kTileRows, supers = K / 256;
  auto packed = torch::zeros({tiles, supers, kSuperBytes}, torch::kUInt8);
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < kTileRows && t * kTileRows + r < N; ++r) {
        const uint8_t* row = rows[t * kTileRows + r];
        for (int64_t b = 0; b < supers; ++b) {
          const uint8_t* block = row + block_bytes * b;
          uint8_t* super = out + (t * supers + b) * kSuperBytes;
          const uint8_t* qh = block + 16;  // (Q5_K: value l of group j has its fifth bit at bit j of qh[l])
          for (int j = 0; j < 8; ++j) {
            int sc, mn;
            ggml_rows_detail::scale_min_k4(j, block + 4, sc, mn);
            const uint8_t* qs = block + (five ? 48 : 16) + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            uint8_t* p = super + j * kGroupBytes;
            for (int i = 0; i < 4; ++i)
              for (int c = 0; c < 4; ++c) {
                const int lo = 4 * i + c, hi = 16 + 4 * i + c, bit = static_cast<int>(4 * r + c);
                p[64 * i + 4 * r + c] = ((qs[lo] >> shift) & 0xF) | (((qs[hi] >> shift) & 0xF) << 4);
                if (five) {  // masks i (the low nibbles' values) and 4 + i (the high ones'), as Q6_K's
                  p[256 + 8 * i + bit / 8] |= ((qh[lo] >> j) & 1) << (bit % 8);
                  p[256 + 8 * (4 + i) + bit / 8] |= ((qh[hi] >> j) & 1) << (bit % 8);
                }
              }
            p[256 + mask_bytes + r] = static_cast<uint8_t>(sc);
            p[256 + mask_bytes + 16 + r] = static_cast<uint8_t>(mn);
          }
          std::memcpy(super + 8 * kGroupBytes + 2 * r, block, 2);       // d
          std::memcpy(super + 8 * kGroupBytes + 32 + 2 * r, block + 2, 2);  // dmin
        }
      }
    }
  });
  return packed;
}

torch::Tensor gguf_nibble_tiles(std::vector<torch::Tensor> parts, int64_t type, int64_t K) {
  TORCH_CHECK(type == kGgmlQ4_K || type == kGgmlQ5_K || type == kGgmlQ4_1 || type == kGgmlQ4_0,
              "gguf_nibble_tiles reads Q4_K, Q5_K, Q4_1 and Q4_0");
  const StackedRows rows(parts, type, K);
  if (type == kGgmlQ4_K || type == kGgmlQ5_K) return k_quant_tiles(rows, K, type == kGgmlQ5_K);
  const int64_t N = rows.size(), tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t groups = (K + 63) / 64 * 2, stored_groups = K / 32;
  const int64_t group_bytes = 256 + 2 * kTileRows * 2;  // the nibbles, the rows' fp16 d and m
  auto packed = torch::zeros({tiles, groups, group_bytes}, torch::kUInt8);
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    uint8_t values[32];
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < kTileRows && t * kTileRows + r < N; ++r) {
        const uint8_t* row = rows[t * kTileRows + r];
        for (int64_t g = 0; g < stored_groups; ++g) {
          uint16_t d, m;
          q4_group(row, type == kGgmlQ4_0, g, values, d, m);
          uint8_t* p = out + (t * groups + g) * group_bytes;
          for (int i = 0; i < 4; ++i)
            for (int c = 0; c < 4; ++c) p[64 * i + 4 * r + c] = values[4 * i + c] | (values[16 + 4 * i + c] << 4);
          std::memcpy(p + 256 + 2 * r, &d, 2);  // the rows' fp16 d, then m
          std::memcpy(p + 256 + 32 + 2 * r, &m, 2);
        }
      }
    }
  });
  return packed;
}

torch::Tensor gguf_q6_k_tiles(std::vector<torch::Tensor> parts, int64_t K) {
  const StackedRows rows(parts, kGgmlQ6_K, K);
  constexpr int64_t kGroupBytes = 256 + 128 + 32, kSuperBytes = 8 * kGroupBytes + 32;
  const int64_t N = rows.size(), tiles = (N + kTileRows - 1) / kTileRows, supers = K / 256;
  auto packed = torch::zeros({tiles, supers, kSuperBytes}, torch::kUInt8);
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    uint8_t v[256];
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < kTileRows && t * kTileRows + r < N; ++r) {
        const uint8_t* row = rows[t * kTileRows + r];
        for (int64_t b = 0; b < supers; ++b) {
          const uint8_t* block = row + 210 * b;
          const uint8_t* ql = block;
          const uint8_t* qh = block + 128;
          for (int half = 0; half < 2; ++half, ql += 64, qh += 32) {  // the block's values, 0..63
            uint8_t* y = v + 128 * half;
            for (int l = 0; l < 32; ++l) {
              y[l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
              y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
              y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
              y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
          }
          uint8_t* super = out + (t * supers + b) * kSuperBytes;
          for (int j = 0; j < 8; ++j) {
            const uint8_t* g = v + 32 * j;
            uint8_t* p = super + j * kGroupBytes;
            for (int i = 0; i < 4; ++i)
              for (int c = 0; c < 4; ++c) {
                const int lo = g[4 * i + c], hi = g[16 + 4 * i + c], bit = static_cast<int>(4 * r + c);
                p[64 * i + 4 * r + c] = (lo & 15) | ((hi & 15) << 4);
                // masks i (low nibbles' values) and 4 + i (high): fifth bits, then sixth
                p[256 + 8 * i + bit / 8] |= ((lo >> 4) & 1) << (bit % 8);
                p[256 + 8 * (4 + i) + bit / 8] |= ((hi >> 4) & 1) << (bit % 8);
                p[320 + 8 * i + bit / 8] |= ((lo >> 5) & 1) << (bit % 8);
                p[320 + 8 * (4 + i) + bit / 8] |= ((hi >> 5) & 1) << (bit % 8);
              }
            p[384 + r] = block[192 + 2 * j];      // the sub-scale of inputs 0-15
            p[400 + r] = block[192 + 2 * j + 1];  // and of 16-31
          }
          std::memcpy(super + 8 * kGroupBytes + 2 * r, block + 208, 2);  // d
        }
      }
    }
  });
  return packed;
}

std::vector<torch::Tensor> gguf_byte_blocks(std::vector<torch::Tensor> parts, int64_t type, int64_t K) {
  TORCH_CHECK(type == kGgmlQ8_0 || type == kGgmlQ6_K, "gguf_byte_blocks reads Q8_0 and Q6_K");
  const StackedRows rows(parts, type, K);
  const int64_t N = rows.size();
  const bool q6 = type == kGgmlQ6_K;
  auto qs = torch::empty({N, K}, torch::kInt8);
  auto d = q6 ? torch::empty({N, K / 16}, torch::kFloat32) : torch::empty({N, K / 32}, torch::kInt16);
  int8_t* q = qs.data_ptr<int8_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = rows[n];
      int8_t* qrow = q + n * K;
      if (!q6) {
        int16_t* drow = d.data_ptr<int16_t>() + n * (K / 32);
        for (int64_t b = 0; b < K / 32; ++b) {
          std::memcpy(drow + b, row + 34 * b, 2);
          std::memcpy(qrow + 32 * b, row + 34 * b + 2, 32);
        }
        continue;
      }
      float* drow = d.data_ptr<float>() + n * (K / 16);
      for (int64_t b = 0; b < K / 256; ++b) {
        const uint8_t* block = row + 210 * b;
        const uint8_t* ql = block;
        const uint8_t* qh = block + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
        const float super = fp16_bits_to_float(static_cast<uint16_t>(block[208] | block[209] << 8));
        for (int s = 0; s < 16; ++s) drow[16 * b + s] = super * static_cast<float>(sc[s]);
        int8_t* y = qrow + 256 * b;
        for (int half = 0; half < 2; ++half, ql += 64, qh += 32, y += 128) {
          for (int l = 0; l < 32; ++l) {
            y[l] = static_cast<int8_t>(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
            y[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
            y[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            y[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
          }
        }
      }
    }
  });
  return {qs, d};
}
