// The tiled nibble layout read by the AVX512 and AVX2 4/5-bit kernels (quant_linear.cpp) and the LM-head
// screen (screen_linear.cpp), written by kvserve.quant.tile_nibbles: per tile of 16 output rows
// and group of 32 inputs, 256 bytes of nibbles, byte 64 i + 4 r + c holding row r's weight
// 4 i + c in its low nibble and 16 + 4 i + c in its high nibble, then each format's scales (the
// screen's groups of 64: two such blocks of nibbles, then its scales). Each
// 32-bit lane of a 64-byte vector is one output row: one vpdpbusd adds four products to each of
// 16 rows against one broadcast word of activations, and no row needs a horizontal sum.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
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
