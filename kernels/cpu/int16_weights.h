// quant_dot.cpp's weights, per instruction set: a sub-block of 32 GGUF codes as 16-bit integers
// with every integer of its type folded in (zero point, a K-quant's sub-block scale), its dot
// products with int16 x summed in int32 lanes, and the float accumulators they convert into.
// AVX-512: 32 weights a register, 16 lanes, 6 rows of x a pass; AVX2: two registers, 8 lanes, 4.
#pragma once

#include <cstring>

#include "gguf_blocks.h"

#ifdef CONVEYOR_GGUF_BLOCKS
namespace conveyor_gguf {

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 32 int16 weights of a sub-block in one register; 16 int32 lanes per accumulator
struct W16 {
  __m512i v;
};
using IntSum = __m512i;
using FloatSum = __m512;
constexpr int kMaxRows = 6;
constexpr int kRegisters = 32;
constexpr int kFlushSubs = 8;  // a lane takes 2 products a sub-block: 16 before it must convert

inline W16 widen(__m256i u8) { return {_mm512_cvtepu8_epi16(u8)}; }
inline W16 widen_signed(__m256i s8) { return {_mm512_cvtepi8_epi16(s8)}; }
// Widening straight from memory (vpmovzxbw, a memory operand) and splitting nibbles in 16-bit
// lanes (an and, a shift) takes half the instructions of splitting bytes first, then assembling
// and widening a register, as on AVX2
inline __m256i bytes16(const uint8_t* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512i bytes32(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 bytes of packed nibbles (value i low, value i + 16 high) -> the 32 values
inline W16 nibbles16(const uint8_t* p) {
  const __m256i w = bytes16(p);
  return {_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(w, _mm256_set1_epi16(0x0F))),
                             _mm256_srli_epi16(w, 4), 1)};
}
// 32 signed bytes -> the 32 values
inline W16 signed16(const uint8_t* p) {
  return widen_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// a Q4_K block's sub-block j: the low (j even) or high nibbles of 32 bytes
// (sub-blocks j and j + 1 share their 32 bytes: one widening serves both)
inline W16 k4_nibbles16(const uint8_t* qs, int j) {
  const __m512i w = bytes32(qs + (j / 2) * 32);
  return {j % 2 ? _mm512_srli_epi16(w, 4) : _mm512_and_si512(w, _mm512_set1_epi16(0x0F))};
}
// a Q5_0 block's 32 values u - 16, u = nibble + 16 * its bit of qh: nibble - 16 where the bit is
// clear (a masked move of -16 and an add in 16-bit lanes)
inline W16 q5_0_16(const uint8_t* b) {
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  return {_mm512_add_epi16(nibbles16(b + 6).v, _mm512_maskz_mov_epi16(~qh, _mm512_set1_epi16(-16)))};
}
// a Q6_K block's sub-block j: sc * (u - 32), one 8-bit scale per 16 values, u from 4 low bits
// (ql) and 2 high bits (qh), each byte widened from memory and its bits taken in 16-bit lanes
inline W16 q6_k_16(const uint8_t* b, int j) {
  const int half = j / 4, k = j % 4;
  const __m512i mask = _mm512_set1_epi16(0x0F), top_mask = _mm512_set1_epi16(0x30);
  const __m512i low = bytes32(b + half * 64 + (k & 1) * 32), high = bytes32(b + 128 + half * 32);
  const __m512i nibble = k < 2 ? _mm512_and_si512(low, mask) : _mm512_srli_epi16(low, 4);
  const __m512i top = k == 3 ? _mm512_and_si512(_mm512_srli_epi16(high, 2), top_mask)
                             : _mm512_and_si512(_mm512_slli_epi16(high, 4 - 2 * k), top_mask);
  const int8_t* sc = q6_k_scales(b, j);
  const __m512i scales = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_set1_epi8(sc[1]), _mm_set1_epi8(sc[0])));
  const __m512i centred = _mm512_sub_epi16(_mm512_or_si512(nibble, top), _mm512_set1_epi16(32));
  return {_mm512_mullo_epi16(centred, scales)};
}
inline W16 minus(W16 w, int16_t zero) { return {_mm512_sub_epi16(w.v, _mm512_set1_epi16(zero))}; }
inline W16 times(W16 w, int16_t first16, int16_t last16) {
  const __m512i scales = _mm512_inserti64x4(_mm512_set1_epi16(first16), _mm256_set1_epi16(last16), 1);
  return {_mm512_mullo_epi16(w.v, scales)};
}
// one scale for all 32 (a broadcast; the pair above is two and an insert)
inline W16 times(W16 w, int16_t scale) { return {_mm512_mullo_epi16(w.v, _mm512_set1_epi16(scale))}; }
inline IntSum int_zero() { return _mm512_setzero_si512(); }
inline IntSum dot_add(IntSum acc, W16 w, const int16_t* x) {
  const __m512i xv = _mm512_loadu_si512(x);
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, w.v, xv);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w.v, xv));
#endif
}
inline FloatSum float_zero() { return _mm512_setzero_ps(); }
inline FloatSum convert_add(FloatSum acc, IntSum sum, float scale) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(scale), acc);
}
// acc's first 8 lanes + offsets * sums
inline FloatSum add_offsets(FloatSum acc, __m256 offsets, __m256 sums) {
  return _mm512_mask3_fmadd_ps(_mm512_castps256_ps512(offsets), _mm512_castps256_ps512(sums), acc, 0xFF);
}
inline float total(FloatSum v) { return _mm512_reduce_add_ps(v); }
#else
// AVX2: the 32 weights in two registers, values 0..15 and 16..31; 8 int32 lanes
struct W16 {
  __m256i low, high;
};
using IntSum = __m256i;
using FloatSum = __m256;
constexpr int kMaxRows = 4;
constexpr int kRegisters = 16;
constexpr int kFlushSubs = 4;  // a lane takes 4 products a sub-block

inline W16 widen(__m256i u8) {
  return {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(u8)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u8, 1))};
}
// Widening straight from memory (vpmovzxbw ymm, m128) is one instruction per 16 values; a
// 32-byte register widens in three (two of them lane-crossing) after it is assembled.
inline __m256i bytes16(const uint8_t* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline W16 nibbles16(const uint8_t* p) {
  const __m256i w = bytes16(p);
  return {_mm256_and_si256(w, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(w, 4)};
}
inline W16 signed16(const uint8_t* p) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline W16 k4_nibbles16(const uint8_t* qs, int j) {
  const uint8_t* p = qs + (j / 2) * 32;
  const __m256i low = bytes16(p), high = bytes16(p + 16);
  if (j % 2) return {_mm256_srli_epi16(low, 4), _mm256_srli_epi16(high, 4)};
  const __m256i mask = _mm256_set1_epi16(0x0F);
  return {_mm256_and_si256(low, mask), _mm256_and_si256(high, mask)};
}
inline W16 minus(W16 w, int16_t zero) {
  const __m256i z = _mm256_set1_epi16(zero);
  return {_mm256_sub_epi16(w.low, z), _mm256_sub_epi16(w.high, z)};
}
inline W16 times(W16 w, int16_t first16, int16_t last16) {
  return {_mm256_mullo_epi16(w.low, _mm256_set1_epi16(first16)), _mm256_mullo_epi16(w.high, _mm256_set1_epi16(last16))};
}
inline W16 times(W16 w, int16_t scale) { return times(w, scale, scale); }
inline W16 q5_0_16(const uint8_t* b) {
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  return minus(widen(_mm256_or_si256(nibbles_low_then_high(b + 6), bit_bytes(qh))), 16);
}
inline W16 q6_k_16(const uint8_t* b, int j) {
  const int8_t* sc = q6_k_scales(b, j);
  return times(minus(widen(q6_k_codes(b, j)), 32), sc[0], sc[1]);
}
inline IntSum int_zero() { return _mm256_setzero_si256(); }
inline IntSum dot_add(IntSum acc, W16 w, const int16_t* x) {
  const __m256i x_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x_high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(acc, w.low, x_low), w.high, x_high);
#else
  const __m256i low = _mm256_madd_epi16(w.low, x_low), high = _mm256_madd_epi16(w.high, x_high);
  return _mm256_add_epi32(acc, _mm256_add_epi32(low, high));
#endif
}
inline FloatSum float_zero() { return _mm256_setzero_ps(); }
inline FloatSum convert_add(FloatSum acc, IntSum sum, float scale) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(scale), acc);
}
inline FloatSum add_offsets(FloatSum acc, __m256 offsets, __m256 sums) { return _mm256_fmadd_ps(offsets, sums, acc); }
inline float total(FloatSum v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Per GGUF type, on either width (quant_dot.cpp and quant_gemm_int16.cpp):
// what a block's sub-blocks share: its float scale d, a K-quant's sub-block scales and the
// factors of the float offsets per sub-block (Q4_K/Q5_K: -dmin * min_j; Q4_1 adds its m apart)
struct BlockHeader {
  float d;
  uint8_t scales[8];
  __m256 offsets;
};

template <int64_t kType>
inline BlockHeader header_of(const uint8_t* b) {
  BlockHeader h;
  h.d = half_at(kType == Q6_K ? b + 208 : b);
  if constexpr (kType == Q4_K || kType == Q5_K) {
    uint32_t scales[2], mins[2];
    k4_scales_mins(b, scales, mins);
    std::memcpy(h.scales, scales, 8);
    h.offsets = _mm256_mul_ps(floats8(mins), _mm256_set1_ps(-half_at(b + 2)));
  }
  return h;
}

// sub-block j of block b as 16-bit integers: every integer of the type folded in
template <int64_t kType>
inline W16 weights16(const uint8_t* b, int j, const BlockHeader& h) {
  if constexpr (kType == Q4_0) return minus(nibbles16(b + 2), 8);
  if constexpr (kType == Q4_1) return nibbles16(b + 4);
  if constexpr (kType == Q5_0) return q5_0_16(b);
  if constexpr (kType == Q8_0) return signed16(b + 2);
  if constexpr (kType == Q4_K) return times(k4_nibbles16(b + 16, j), h.scales[j]);
  if constexpr (kType == Q5_K) {
    const __m256i high_bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    return times(widen(k4_k5_codes(b + 48, &high_bits, j)), h.scales[j]);
  }
  if constexpr (kType == Q6_K) return q6_k_16(b, j);
}

}  // namespace conveyor_gguf
#endif
