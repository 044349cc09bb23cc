// A table of fp32 rows [rows, K] read a row at a time (the token embedding, the LM head's
// exact weights for rescoring) as it is stored: fp32, or the Q8_0 blocks it is made of
// (kvserve.row_table.Q8Table: int8 values q [rows, K], the fp16 bits of a scale d per 32 values
// [rows, K / 32]). GGUF files store both models' embeddings as Q8_0: each value d * q is a
// product exact in fp32, so a row read from the blocks has the bits of the fp32 table's row,
// in 0.27x its bytes (Gemma 3: 178 MB against 671 MB). Or a GGUF tensor's blocks as the file
// stores them, in place (the file's mapped pages): each row dequantized as it is read
// (ggml_rows.h), with the values kvserve.block_formats gives.
#pragma once

#include <torch/extension.h>

#include <cstdint>

#include "fp16.h"
#include "ggml_rows.h"

class RowTable {
 public:
  static constexpr int64_t kGroup = 32;

  // `values` fp32 [rows, K] with `scales` absent, or int8 [rows, K] with `scales` the int16
  // (fp16 bits) [rows, K / 32]; both with contiguous rows. `name` for the error messages.
  RowTable(const torch::Tensor& values, const c10::optional<torch::Tensor>& scales, const char* name) {
    TORCH_CHECK(values.device().is_cpu() && values.dim() == 2 && values.stride(1) == 1, name,
                " must be a CPU [rows, K] tensor with contiguous rows");
    rows_ = values.size(0);
    K_ = values.size(1);
    stride_ = values.stride(0);
    if (!scales.has_value()) {
      TORCH_CHECK(values.scalar_type() == torch::kFloat32, name, " must be float32, or int8 with its Q8_0 scales");
      f32_ = values.data_ptr<float>();
      return;
    }
    const torch::Tensor& d = *scales;
    if (d.scalar_type() == torch::kInt64) {  // GGUF blocks as stored (kvserve.row_table.GGUFRows)
      TORCH_CHECK(values.scalar_type() == torch::kUInt8 && d.numel() == 2, name,
                  ": GGUF rows are uint8 [rows, row bytes] with the int64 (GGML type, K)");
      const int64_t* format = d.data_ptr<int64_t>();
      ggml_type_ = format[0];
      K_ = format[1];
      TORCH_CHECK(ggml_row_bytes(ggml_type_, K_) == values.size(1), name, ": GGML type ", ggml_type_,
                  " with K = ", K_, " does not have rows of ", values.size(1), " bytes");
      raw_ = values.data_ptr<uint8_t>();
      return;
    }
    TORCH_CHECK(values.scalar_type() == torch::kInt8 && K_ % kGroup == 0 && values.is_contiguous(), name,
                "'s Q8_0 values must be a contiguous int8 [rows, K], K a multiple of 32");
    TORCH_CHECK(d.scalar_type() == torch::kInt16 && d.is_contiguous() && d.dim() == 2 && d.size(0) == rows_ &&
                    d.size(1) == K_ / kGroup,
                name, "'s Q8_0 scales must be the fp16 bits (int16) of a contiguous [rows, K / 32]");
    q_ = values.data_ptr<int8_t>();
    d_ = reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>());
  }

  int64_t rows() const { return rows_; }
  bool stored_as_fp32() const { return f32_ != nullptr; }
  int64_t width() const { return K_; }

  // Row r as fp32: the table's own memory, or `buf` (K floats) filled with d * q.
  const float* row(int64_t r, float* buf) const {
    if (f32_ != nullptr) return f32_ + r * stride_;
    if (raw_ != nullptr) {
      ggml_dequantize_row(ggml_type_, raw_ + r * stride_, K_, buf);
      return buf;
    }
    const int8_t* q = q_ + r * K_;
    const uint16_t* d = d_ + r * (K_ / kGroup);
    for (int64_t g = 0; g < K_ / kGroup; ++g) {
      const float scale = fp16_bits_to_float(d[g]);
#pragma omp simd
      for (int64_t j = 0; j < kGroup; ++j) buf[g * kGroup + j] = scale * static_cast<float>(q[g * kGroup + j]);
    }
    return buf;
  }

  // Starts fetching row r's bytes.
  void prefetch(int64_t r) const {
    const auto fetch = [](const void* p, int64_t bytes) {
      for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(static_cast<const char*>(p) + line);
    };
    if (f32_ != nullptr) return fetch(f32_ + r * stride_, K_ * static_cast<int64_t>(sizeof(float)));
    if (raw_ != nullptr) return fetch(raw_ + r * stride_, ggml_row_bytes(ggml_type_, K_));
    fetch(q_ + r * K_, K_);
    fetch(d_ + r * (K_ / kGroup), K_ / kGroup * static_cast<int64_t>(sizeof(uint16_t)));
  }

 private:
  int64_t rows_ = 0, K_ = 0, stride_ = 0;
  const float* f32_ = nullptr;
  const int8_t* q_ = nullptr;
  const uint16_t* d_ = nullptr;
  const uint8_t* raw_ = nullptr;
  int64_t ggml_type_ = -1;
};
