// The weight formats' tiles as the nibble and Q6_K kernels of quant_linear.cpp read them (the
// layouts block_repack.cpp and kvserve.quant.tile_nibbles write): Q4Tiles (Q4_1, Q4_0, Q4_K with
// fp32 scales), Q5Tiles (Q5_0), KQuantTiles (Q4_K, Q5_K in their own bits), Q6KTiles; each with
// its portable accessors and its AVX512 / AVX2 unpacking and scales. Also where the kernels'
// routes are chosen (KVSERVE_Q4_AVX512, KVSERVE_QUANT_AVX2). Only quant_linear.cpp includes it.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "fp16.h"
#include "nibble_tiles.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__BMI2__) && \
    defined(__F16C__)
// AVX512 with VNNI: Cascade Lake, Ice Lake, Sapphire Rapids and later, Zen 4. (No bf16 here: the
// Xeons with VNNI but not AVX512-BF16 took the AVX2 kernel before, ~2x the time of a 256-token
// prefill of Llama-3.2-1B's Q4_K layers.)
#include <immintrin.h>
#define KVSERVE_Q4_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Zen 2/3 and other CPUs without AVX512-VNNI: the nibble kernels on the AVX512 kernel's tiles in
// 8-lane halves (vpmaddubsw), the Q8 kernels in 8-lane fp32.
#include <immintrin.h>
#define KVSERVE_QUANT_AVX2 1
#endif

namespace {

inline float scale_value(uint16_t h) { return fp16_bits_to_float(h); }
inline float scale_value(float f) { return f; }

// The tiled nibble layout (nibble_tiles.h), which the AVX512 and AVX2 kernels read, as llama.cpp's
// repacked layouts do: the rows' scales are a plain vector load, and no row needs a horizontal
// sum, nor a row's last half-filled block of a wider unit (K = 576 is 18 groups). After the
// nibbles, per format:
//   Q4 (Q4_1, or Q4_K with fp32 scales): the 16 rows' d, then their m (fp16: 320 bytes a tile
//     group, as the row layout's 20 per 32 weights; fp32: 384);
//   Q5_0: 8 masks of the fifth bits (uint64; mask i < 4: bit 4 r + c is the fifth bit of the low
//     nibble of byte 64 i + 4 r + c, mask 4 + i of its high nibble), then the rows' d (fp16: 352).
// Rows past N (the last tile's) and groups past K are zeros.
// Row r's byte of tile-group p holding weight j (low nibble) and j + 16 (high nibble), j < 16.
inline uint8_t tile_byte(const uint8_t* p, int64_t r, int j) { return p[64 * (j / 4) + 4 * r + j % 4]; }

template <typename Scale>
struct Q4Tiles {
  static constexpr bool kOffset = true;
  static constexpr int64_t kGroupBytes = kTileNibbleBytes + 2 * kTileRows * sizeof(Scale);
  const uint8_t* packed;
  int64_t groups, chunks;  // chunks: the portable loop's 64-input units (groups / 2)

  const uint8_t* group(int64_t tile, int64_t g) const { return packed + (tile * groups + g) * kGroupBytes; }
  const Scale* scales(int64_t n, int64_t g) const {
    return reinterpret_cast<const Scale*>(group(n / kTileRows, g) + kTileNibbleBytes);
  }
  float portable_scale(int64_t n, int64_t c, int half) const { return scale_value(scales(n, 2 * c + half)[n % kTileRows]); }
  float portable_offset(int64_t n, int64_t c, int half) const {
    return scale_value(scales(n, 2 * c + half)[kTileRows + n % kTileRows]);
  }
  std::pair<int, int> portable_values(int64_t n, int64_t c, int half, int j) const {
    const uint8_t byte = tile_byte(group(n / kTileRows, 2 * c + half), n % kTileRows, j);
    return {byte & 15, byte >> 4};
  }
  static constexpr int kMaxValue = 15;  // the largest v
#ifdef KVSERVE_Q4_AVX512
  // A tile-group's values (w = d v + m) and its rows' d and m.
  static void values(const uint8_t*, __m512i (&)[4], __m512i (&)[4]) {}
  static void scales(const uint8_t* p, __m512& d, __m512& m);
#endif
#ifdef KVSERVE_QUANT_AVX2
  // The same for rows 8 h .. 8 h + 7.
  static void values(const uint8_t*, int, __m256i (&)[4], __m256i (&)[4]) {}
  static void scales(const uint8_t* p, int h, __m256& d, __m256& m);
#endif
};

struct Q5Tiles {
  static constexpr bool kOffset = false;
  static constexpr int kMaxValue = 31;
  static constexpr int64_t kGroupBytes = kTileNibbleBytes + 64 + kTileRows * 2;
  const uint8_t* packed;
  int64_t groups, chunks;

  const uint8_t* group(int64_t tile, int64_t g) const { return packed + (tile * groups + g) * kGroupBytes; }
  float portable_scale(int64_t n, int64_t c, int half) const {
    const uint16_t* d = reinterpret_cast<const uint16_t*>(group(n / kTileRows, 2 * c + half) + kTileNibbleBytes + 64);
    return fp16_bits_to_float(d[n % kTileRows]);
  }
  float portable_offset(int64_t, int64_t, int) const { return 0.f; }
  std::pair<int, int> portable_values(int64_t n, int64_t c, int half, int j) const {
    const uint8_t* p = group(n / kTileRows, 2 * c + half);
    const int64_t r = n % kTileRows;
    uint64_t low_mask, high_mask;
    std::memcpy(&low_mask, p + kTileNibbleBytes + 8 * (j / 4), 8);
    std::memcpy(&high_mask, p + kTileNibbleBytes + 8 * (4 + j / 4), 8);
    const int bit = 4 * r + j % 4, byte = tile_byte(p, r, j);
    return {static_cast<int>((byte & 15) | ((low_mask >> bit) & 1) << 4) - 16,
            static_cast<int>((byte >> 4) | ((high_mask >> bit) & 1) << 4) - 16};
  }
#ifdef KVSERVE_Q4_AVX512
  // v = q + 16 in 0..31 (w = d (v - 16)): the fifth bits add 16 to the bytes their masks name.
  static void values(const uint8_t* p, __m512i (&low)[4], __m512i (&high)[4]) {
    const __m512i sixteen = _mm512_set1_epi8(16);
    const uint64_t* masks = reinterpret_cast<const uint64_t*>(p + kTileNibbleBytes);
    for (int i = 0; i < 4; ++i) {
      low[i] = _mm512_mask_add_epi8(low[i], _cvtu64_mask64(masks[i]), low[i], sixteen);
      high[i] = _mm512_mask_add_epi8(high[i], _cvtu64_mask64(masks[4 + i]), high[i], sixteen);
    }
  }
  static void scales(const uint8_t* p, __m512& d, __m512& m) {
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kTileNibbleBytes + 64)));
    m = _mm512_mul_ps(_mm512_set1_ps(-16.f), d);
  }
#endif
#ifdef KVSERVE_QUANT_AVX2
  // Rows 8 h .. 8 h + 7: the 32 mask bits of their bytes (bits 32 h ..) spread one per byte
  // (vpshufb puts mask byte j / 8 in byte j, a compare with the byte's own bit keeps it).
  static void values(const uint8_t* p, int h, __m256i (&low)[4], __m256i (&high)[4]) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    const __m256i sixteen = _mm256_set1_epi8(16);
    const auto fifth_bits = [&](int mask) {
      int32_t word;
      std::memcpy(&word, p + kTileNibbleBytes + 8 * mask + 4 * h, sizeof(word));
      const __m256i bits = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(word), spread), bit);
      return _mm256_and_si256(_mm256_cmpeq_epi8(bits, bit), sixteen);
    };
    for (int i = 0; i < 4; ++i) {
      low[i] = _mm256_or_si256(low[i], fifth_bits(i));
      high[i] = _mm256_or_si256(high[i], fifth_bits(4 + i));
    }
  }
  static void scales(const uint8_t* p, int h, __m256& d, __m256& m) {
    d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kTileNibbleBytes + 64 + 16 * h)));
    m = _mm256_mul_ps(_mm256_set1_ps(-16.f), d);
  }
#endif
};

// Q4_K in its own bits: 4.625 per weight against the file's 4.5 (the fp32-scale tiles above
// take 6). Per tile of 16 rows and super-block of 256 inputs: its 8 groups, each 256 bytes of
// nibbles then the rows' 6-bit scales sc (16 bytes) and mins mn (16 bytes), then the rows' d
// and dmin (fp16, 32 bytes each): 2368 bytes. The kernels form each group's d * sc and
// -(dmin * mn) in fp32, exact, the very values the fp32-scale tiles store: the same outputs,
// bit for bit, from 0.77x the bytes.
// Q5_K (kFifthBits) likewise, 5.625 bits per weight against the file's 5.5: after each group's
// nibbles, the values' fifth bits as Q5Tiles' 8 masks (64 bytes), then sc and mn: 2880 bytes.
template <bool kFifthBits>
struct KQuantTiles {
  static constexpr bool kOffset = true;
  static constexpr int kMaxValue = kFifthBits ? 31 : 15;
  static constexpr int64_t kMaskBytes = kFifthBits ? 64 : 0;
  static constexpr int64_t kScaleOffset = kTileNibbleBytes + kMaskBytes;  // a group's sc, then mn
  static constexpr int64_t kGroupBytes = kScaleOffset + 2 * kTileRows;
  static constexpr int64_t kSuperBytes = 8 * kGroupBytes + 2 * kTileRows * 2;
  const uint8_t* packed;
  int64_t groups, chunks;

  const uint8_t* super_block(int64_t tile, int64_t g) const { return packed + (tile * (groups / 8) + g / 8) * kSuperBytes; }
  const uint8_t* group(int64_t tile, int64_t g) const { return super_block(tile, g) + (g % 8) * kGroupBytes; }
  // Row r's d (half 0) or dmin (half 1) of the super-block holding group g.
  float super_scale(int64_t tile, int64_t g, int64_t r, int half) const {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(super_block(tile, g) + 8 * kGroupBytes) + half * kTileRows;
    return fp16_bits_to_float(h[r]);
  }
  float portable_scale(int64_t n, int64_t c, int half) const {
    const int64_t t = n / kTileRows, r = n % kTileRows, g = 2 * c + half;
    return super_scale(t, g, r, 0) * static_cast<float>(group(t, g)[kScaleOffset + r]);
  }
  float portable_offset(int64_t n, int64_t c, int half) const {
    const int64_t t = n / kTileRows, r = n % kTileRows, g = 2 * c + half;
    return -(super_scale(t, g, r, 1) * static_cast<float>(group(t, g)[kScaleOffset + kTileRows + r]));
  }
  std::pair<int, int> portable_values(int64_t n, int64_t c, int half, int j) const {
    const uint8_t* p = group(n / kTileRows, 2 * c + half);
    const uint8_t byte = tile_byte(p, n % kTileRows, j);
    if (!kFifthBits) return {byte & 15, byte >> 4};
    uint64_t low_mask, high_mask;  // (Q5Tiles' masks)
    std::memcpy(&low_mask, p + kTileNibbleBytes + 8 * (j / 4), 8);
    std::memcpy(&high_mask, p + kTileNibbleBytes + 8 * (4 + j / 4), 8);
    const int bit = 4 * static_cast<int>(n % kTileRows) + j % 4;
    return {static_cast<int>((byte & 15) | ((low_mask >> bit) & 1) << 4),
            static_cast<int>((byte >> 4) | ((high_mask >> bit) & 1) << 4)};
  }
#ifdef KVSERVE_Q4_AVX512
  static void values(const uint8_t* p, __m512i (&low)[4], __m512i (&high)[4]) {
    if constexpr (kFifthBits) Q5Tiles::values(p, low, high);
  }
  void scales(const uint8_t* p, int64_t t, int64_t g, __m512& d, __m512& m) const {
    const uint8_t* s = super_block(t, g) + 8 * kGroupBytes;
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kScaleOffset))));
    const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kScaleOffset + 16))));
    d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))), sc);
    const __m512 dmin_mn = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32))), mn);
    m = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dmin_mn), _mm512_set1_epi32(INT32_MIN)));
    // The products stand as computed: the extension's -fassociative-math would otherwise fold
    // d * sc into the kernel's later d * s (a different rounding than the stored fp32 scales').
    asm("" : "+v"(d), "+v"(m));
  }
#endif
#ifdef KVSERVE_QUANT_AVX2
  static void values(const uint8_t* p, int h, __m256i (&low)[4], __m256i (&high)[4]) {
    if constexpr (kFifthBits) Q5Tiles::values(p, h, low, high);
  }
  void scales(const uint8_t* p, int64_t t, int64_t g, int h, __m256& d, __m256& m) const {
    const uint8_t* s = super_block(t, g) + 8 * kGroupBytes;
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kScaleOffset + 8 * h))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kScaleOffset + 16 + 8 * h))));
    d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * h))), sc);
    const __m256 dmin_mn = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32 + 16 * h))), mn);
    m = _mm256_xor_ps(dmin_mn, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN)));
    asm("" : "+x"(d), "+x"(m));  // (as the AVX512 scales: no reassociation past this point)
  }
#endif
};
using Q4KTiles = KQuantTiles<false>;
using Q5KTiles = KQuantTiles<true>;

// Q6_K in its own bits (6.5625 per weight, as the file; the 8-bit codes and fp32 scales of
// Q8Linear take 10): per tile of 16 rows and super-block of 256 inputs, its 8 groups, each 256
// bytes of the values' low nibbles (the nibble tiles' order), 8 masks of their fifth bits and 8
// of their sixth (uint64, as Q5Tiles'), the rows' int8 sub-scales of inputs 0-15 then 16-31
// (32 bytes), then the rows' d (fp16, 32 bytes): 3360 bytes. w = d * sc * (v - 32), v in
// 0..63: each half-group's dot product and its sub-scale d * sc (fp32, exact) apart. AVX512
// (VNNI) and the portable loop read it; other CPUs keep Q6_K as 8-bit codes.
struct Q6KTiles {
  static constexpr int64_t kGroupBytes = kTileNibbleBytes + 128 + 2 * kTileRows;
  static constexpr int64_t kSuperBytes = 8 * kGroupBytes + 2 * kTileRows;
  const uint8_t* packed;
  int64_t groups;

  const uint8_t* super_block(int64_t tile, int64_t g) const { return packed + (tile * (groups / 8) + g / 8) * kSuperBytes; }
  const uint8_t* group(int64_t tile, int64_t g) const { return super_block(tile, g) + (g % 8) * kGroupBytes; }
  float d(int64_t tile, int64_t g, int64_t r) const {
    return fp16_bits_to_float(reinterpret_cast<const uint16_t*>(super_block(tile, g) + 8 * kGroupBytes)[r]);
  }
  // Row r's value j (0..31) of group g and its sub-scale d * sc.
  int value(int64_t tile, int64_t g, int64_t r, int j) const {
    const uint8_t* p = group(tile, g);
    const int low = j % 16, high = j / 16;  // (the low nibbles hold values 0-15, the high 16-31)
    const uint8_t byte = tile_byte(p, r, low);
    const int bit = 4 * static_cast<int>(r) + low % 4, mask = 4 * high + low / 4;
    uint64_t fifth, sixth;
    std::memcpy(&fifth, p + kTileNibbleBytes + 8 * mask, 8);
    std::memcpy(&sixth, p + kTileNibbleBytes + 64 + 8 * mask, 8);
    return ((high ? byte >> 4 : byte & 15) | ((fifth >> bit) & 1) << 4 | ((sixth >> bit) & 1) << 5);
  }
  float sub_scale(int64_t tile, int64_t g, int64_t r, int half) const {
    const int8_t* sc = reinterpret_cast<const int8_t*>(group(tile, g) + kTileNibbleBytes + 128);
    return d(tile, g, r) * static_cast<float>(sc[half * kTileRows + r]);
  }
#ifdef KVSERVE_Q4_AVX512
  // v in 0..63: the fifth and sixth bits add 16 and 32 to the bytes their masks name.
  static void values(const uint8_t* p, __m512i (&low)[4], __m512i (&high)[4]) {
    const __m512i sixteen = _mm512_set1_epi8(16), thirty_two = _mm512_set1_epi8(32);
    const uint64_t* fifth = reinterpret_cast<const uint64_t*>(p + kTileNibbleBytes);
    const uint64_t* sixth = reinterpret_cast<const uint64_t*>(p + kTileNibbleBytes + 64);
    for (int i = 0; i < 4; ++i) {
      low[i] = _mm512_mask_add_epi8(low[i], _cvtu64_mask64(fifth[i]), low[i], sixteen);
      low[i] = _mm512_mask_add_epi8(low[i], _cvtu64_mask64(sixth[i]), low[i], thirty_two);
      high[i] = _mm512_mask_add_epi8(high[i], _cvtu64_mask64(fifth[4 + i]), high[i], sixteen);
      high[i] = _mm512_mask_add_epi8(high[i], _cvtu64_mask64(sixth[4 + i]), high[i], thirty_two);
    }
  }
  // The rows' sub-scales d * sc of inputs 0-15 (s0) and 16-31 (s1).
  void scales(const uint8_t* p, int64_t t, int64_t g, __m512& s0, __m512& s1) const {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(super_block(t, g) + 8 * kGroupBytes)));
    const __m128i* sc = reinterpret_cast<const __m128i*>(p + kTileNibbleBytes + 128);
    s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sc))));
    s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sc + 1))));
    asm("" : "+v"(s0), "+v"(s1));  // (no reassociation with the activations' scale: see Q4KTiles)
  }
#endif
};

// The tile group's rows' scales and offsets: per group's own bytes (Q4Tiles, Q5Tiles), or with
// its super-block's (Q4KTiles, Q5KTiles).
#ifdef KVSERVE_Q4_AVX512
template <typename Tiles>
inline void tile_scales(const Tiles&, const uint8_t* p, int64_t, int64_t, __m512& d, __m512& m) { Tiles::scales(p, d, m); }
template <bool kFifthBits>
inline void tile_scales(const KQuantTiles<kFifthBits>& w, const uint8_t* p, int64_t t, int64_t g, __m512& d, __m512& m) {
  w.scales(p, t, g, d, m);
}
#endif
#ifdef KVSERVE_QUANT_AVX2
template <typename Tiles>
inline void tile_scales(const Tiles&, const uint8_t* p, int64_t, int64_t, int h, __m256& d, __m256& m) {
  Tiles::scales(p, h, d, m);
}
template <bool kFifthBits>
inline void tile_scales(const KQuantTiles<kFifthBits>& w, const uint8_t* p, int64_t t, int64_t g, int h, __m256& d,
                        __m256& m) {
  w.scales(p, t, g, h, d, m);
}
#endif

#ifdef KVSERVE_Q4_AVX512
template <>
inline void Q4Tiles<uint16_t>::scales(const uint8_t* p, __m512& d, __m512& m) {
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kTileNibbleBytes)));
  m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kTileNibbleBytes + 32)));
}
template <>
inline void Q4Tiles<float>::scales(const uint8_t* p, __m512& d, __m512& m) {
  d = _mm512_loadu_ps(p + kTileNibbleBytes);
  m = _mm512_loadu_ps(p + kTileNibbleBytes + 64);
}
#endif
#ifdef KVSERVE_QUANT_AVX2
template <>
inline void Q4Tiles<uint16_t>::scales(const uint8_t* p, int h, __m256& d, __m256& m) {
  d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kTileNibbleBytes + 16 * h)));
  m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kTileNibbleBytes + 32 + 16 * h)));
}
template <>
inline void Q4Tiles<float>::scales(const uint8_t* p, int h, __m256& d, __m256& m) {
  d = _mm256_loadu_ps(reinterpret_cast<const float*>(p + kTileNibbleBytes) + 8 * h);
  m = _mm256_loadu_ps(reinterpret_cast<const float*>(p + kTileNibbleBytes + 64) + 8 * h);
}
#endif  // KVSERVE_QUANT_AVX2

}  // namespace
