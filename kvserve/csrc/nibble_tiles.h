// The tiled nibble layout read by the AVX512 and AVX2 4/5-bit kernels (quant_linear.cpp) and the LM-head
// screen (screen_linear.cpp), written by kvserve.quant.tile_nibbles: per tile of 16 output rows
// and group of 32 inputs, 256 bytes of nibbles, byte 64 i + 4 r + c holding row r's weight
// 4 i + c in its low nibble and 16 + 4 i + c in its high nibble, then each format's scales (the
// screen's groups of 64: two such blocks of nibbles, then its scales). Each
// 32-bit lane of a 64-byte vector is one output row: one vpdpbusd adds four products to each of
// 16 rows against one broadcast word of activations, and no row needs a horizontal sum.
#pragma once

#include <cstdint>
#include <cstring>

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(__AVX2__)
#include <immintrin.h>
#endif

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileNibbleBytes = 256;
// How far ahead the tile stream is fetched. 8 KiB took 13-25 % off a SmolLM2 step's 120 4-bit
// calls on one thread of a 2-core Xeon (weights from memory; 1-3 % on two; 16 and 32 KiB no
// more), and the screen of SmolLM2's head from evicted cache to 0.53 ms (median of 15, 2
// threads) against 0.66 with 2 KiB.
constexpr int64_t kTilePrefetchBytes = 8192;

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The tile group at p (group_bytes long, scales included): the one kTilePrefetchBytes ahead
// fetched, and its nibbles as bytes: low[i] the low nibbles of bytes 64 i .. 64 i + 63 (each
// row's weights 4 i .. 4 i + 3), high[i] their high nibbles (weights 16 + 4 i ..).
inline void load_tile_nibbles(const uint8_t* p, int64_t group_bytes, __m512i (&low)[4], __m512i (&high)[4]) {
  for (int64_t line = 0; line < group_bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + kTilePrefetchBytes + line, _MM_HINT_T0);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i v = _mm512_loadu_si512(p + 64 * i);
    low[i] = _mm512_and_si512(v, nibble);
    high[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  }
}
#endif

#if defined(__AVX2__)
// AVX2 reads a tile group in two 8-lane halves: rows 8 h .. 8 h + 7 of the 32-input block of
// nibbles at p, as load_tile_nibbles' vectors (low[i]: weights 4 i .. 4 i + 3 of each row,
// high[i]: 16 + 4 i ..).
inline void load_tile_half_nibbles(const uint8_t* p, int h, __m256i (&low)[4], __m256i (&high)[4]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * i + 32 * h));
    low[i] = _mm256_and_si256(v, nibble);
    high[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  }
}

// Per row of such a half, the sum over the block's 32 inputs of the weights' values (at most
// kMaxValue) times the signed activation bytes x, times `factor`, in 32 bits: what vpdpbusd gives.
// vpmaddubsw adds pairs of u8 x s8 products into 16 bits; sums of those stay in 16 bits while
// they cannot overflow (values to 15: eight vectors, at most 8 * 2 * 15 * 128 = 30,720; to 31:
// four), and vpmaddwd widens them. Integer sums: the order does not change the result.
template <int kMaxValue>
inline __m256i dot_bytes(const __m256i (&low)[4], const __m256i (&high)[4], const int8_t* x, __m256i factor) {
  const auto word = [x](int i) {
    int32_t w;
    std::memcpy(&w, x + 4 * i, sizeof(w));
    return _mm256_set1_epi32(w);
  };
  __m256i low_sum = _mm256_maddubs_epi16(low[0], word(0)), high_sum = _mm256_maddubs_epi16(high[0], word(4));
  for (int i = 1; i < 4; ++i) {
    low_sum = _mm256_add_epi16(low_sum, _mm256_maddubs_epi16(low[i], word(i)));
    high_sum = _mm256_add_epi16(high_sum, _mm256_maddubs_epi16(high[i], word(4 + i)));
  }
  if constexpr (8 * 2 * kMaxValue * 128 <= 32767) {
    return _mm256_madd_epi16(_mm256_add_epi16(low_sum, high_sum), factor);
  } else {
    return _mm256_add_epi32(_mm256_madd_epi16(low_sum, factor), _mm256_madd_epi16(high_sum, factor));
  }
}
#endif
