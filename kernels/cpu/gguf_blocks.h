// GGUF blocks unpacked in registers, shared by quant_dot.cpp (integer dots, few rows) and
// quant_gemm.cpp (dequantized tiles, many rows). Every weight type is read as 32 codes u per
// sub-block plus a scale and an offset per lane of 4 values, so that w = scale * u + offset
// (Q4_0: u in 0..15, offset -8d; Q6_K: u in 0..63, two scales per 32 values; Q8_0: u = |q|
// with the sign in `sign_of`, offset 0). Blocks as in the file: ggml-common.h's block structs,
// little-endian, half-precision scales.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_GGUF_BLOCKS 1

namespace conveyor_gguf {

// the visitors' lambdas run once per 32 weights: a call each (SubBlock through memory) cost
// Q4_0 half its time
#define CONVEYOR_INLINE __attribute__((always_inline))

enum GgmlType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };


inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; c10::Half's conversion is a dozen scalar ones
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// 16 bytes of nibbles -> 32 codes: low nibbles first (values 0..15), then the high ones
inline __m256i nibbles_low_then_high(const uint8_t* p) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return _mm256_set_m128i(high, low);
}

// byte i = 0x10 where bit i of `bits` is set, else 0
inline __m256i bit_bytes(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10));
#else
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i one_bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, one_bit), one_bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
#endif
}

inline __m256 two_halves(float first, float second) {
  return _mm256_insertf128_ps(_mm256_set1_ps(first), _mm_set1_ps(second), 1);
}

// One sub-block of 32 weights: codes, per-lane scale and offset; signed: codes are |q| and x's
// sign must follow q's (Q8_0)
struct SubBlock {
  __m256i codes;
  __m256 scale, offset;
  __m256i sign_of = _mm256_setzero_si256();
  bool is_signed = false;
  bool has_offset = true;
};

inline void scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// a Q4_K/Q5_K block's 6-bit scales and mins (scale_min_k4 for the 8 at once), 4 per word
inline void k4_scales_mins(const uint8_t* b, uint32_t scales[2], uint32_t mins[2]) {
  uint32_t u[3];
  std::memcpy(u, b + 4, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  scales[0] = u[0] & low6;
  scales[1] = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);
  mins[0] = u[1] & low6;
  mins[1] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);
}

// 8 unsigned bytes, 4 a word (k4_scales_mins's) -> 8 floats
inline __m256 floats8(const uint32_t words[2]) {
  const __m128i bytes = _mm_set_epi32(0, 0, static_cast<int>(words[1]), static_cast<int>(words[0]));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

// One sub-block on its own: s is its index in the row (for the K-quants, j its index in the
// super-block at b). The visitors below decode a K-quant's shared fields once per super-block.
inline SubBlock q4_0_sub(const uint8_t* b) {
  const float d = half_at(b);
  return SubBlock{nibbles_low_then_high(b + 2), _mm256_set1_ps(d), _mm256_set1_ps(-8.f * d)};
}

inline SubBlock q4_1_sub(const uint8_t* b) {
  return SubBlock{nibbles_low_then_high(b + 4), _mm256_set1_ps(half_at(b)), _mm256_set1_ps(half_at(b + 2))};
}

inline SubBlock q5_0_sub(const uint8_t* b) {
  const float d = half_at(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const __m256i codes = _mm256_or_si256(nibbles_low_then_high(b + 6), bit_bytes(qh));
  return SubBlock{codes, _mm256_set1_ps(d), _mm256_set1_ps(-16.f * d)};
}

inline SubBlock q8_0_sub(const uint8_t* b) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  SubBlock sub{_mm256_abs_epi8(q), _mm256_set1_ps(half_at(b)), _mm256_setzero_ps()};
  sub.sign_of = q;
  sub.is_signed = true;
  sub.has_offset = false;
  return sub;
}

// Q4_K (high_bits null) and Q5_K: sub-block j's 32 codes, 0..15 (0..31)
inline __m256i k4_k5_codes(const uint8_t* qs, const __m256i* high_bits, int j) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (j / 2) * 32));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256i codes = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(packed, 4) : packed, mask);
  if (high_bits) {
    const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(*high_bits, j), _mm256_set1_epi8(1));
    codes = _mm256_or_si256(codes, _mm256_slli_epi16(bit, 4));
  }
  return codes;
}

// Q4_K and Q5_K: sub-block j of 8; w = d * scale_j * q - dmin * min_j
inline SubBlock k4_k5_sub(float d, float dmin, const uint8_t* scales, const uint8_t* qs, const __m256i* high_bits,
                          int j) {
  int scale, min;
  scale_min_k4(j, scales, &scale, &min);
  return SubBlock{k4_k5_codes(qs, high_bits, j), _mm256_set1_ps(d * scale), _mm256_set1_ps(-dmin * min)};
}

// Q6_K: 2 halves of 128 values, 4 sub-blocks of 32 each, a signed scale per 16 values;
// w = d * scale * (q - 32), q in 0..63 from 4 low bits (ql) and 2 high bits (qh)
inline __m256i q6_k_codes(const uint8_t* b, int j) {
  const int half = j / 4, k = j % 4;
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + half * 64 + (k & 1) * 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + half * 32));
  const __m256i low = _mm256_and_si256(k < 2 ? packed : _mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F));
  const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), _mm256_set1_epi8(3));
  return _mm256_or_si256(low, _mm256_slli_epi16(top, 4));
}

// sub-block j's two scales, of its first and last 16 values
inline const int8_t* q6_k_scales(const uint8_t* b, int j) {
  return reinterpret_cast<const int8_t*>(b + 192 + (j / 4) * 8) + 2 * (j % 4);
}

inline SubBlock q6_k_sub(float d, const uint8_t* b, int j) {
  const int8_t* sc = q6_k_scales(b, j);
  const float s0 = d * sc[0], s1 = d * sc[1];
  return SubBlock{q6_k_codes(b, j), two_halves(s0, s1), two_halves(-32.f * s0, -32.f * s1)};
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 floats -> 16 bfloat16, round to nearest even (finite inputs)
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}
#endif

// bytes of a K-quant's super-block
constexpr int64_t kQ4kBytes = 144, kQ5kBytes = 176, kQ6kBytes = 210;

// bytes of a block of the type (a K-quant's super-block)
template <int64_t kType>
constexpr int64_t kBlockBytes = kType == Q4_0   ? 18
                                : kType == Q4_1 ? 20
                                : kType == Q5_0 ? 22
                                : kType == Q8_0 ? 34
                                : kType == Q4_K ? kQ4kBytes
                                : kType == Q5_K ? kQ5kBytes
                                                : kQ6kBytes;

template <int64_t kType>
constexpr int kSubsPerBlock = kType == Q4_K || kType == Q5_K || kType == Q6_K ? 8 : 1;

// the types whose offsets are floats: Q4_1's m, Q4_K/Q5_K's -dmin * min_j
template <int64_t kType>
constexpr bool kFloatOffset = kType == Q4_1 || kType == Q4_K || kType == Q5_K;

// fn(std::integral_constant<int64_t, type>{}) for each type the kernels take
template <typename Fn>
void with_type(int64_t type, const char* op, Fn&& fn) {
  switch (type) {
    case Q4_0: return fn(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return fn(std::integral_constant<int64_t, Q4_1>{});
    case Q5_0: return fn(std::integral_constant<int64_t, Q5_0>{});
    case Q8_0: return fn(std::integral_constant<int64_t, Q8_0>{});
    case Q4_K: return fn(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return fn(std::integral_constant<int64_t, Q5_K>{});
    case Q6_K: return fn(std::integral_constant<int64_t, Q6_K>{});
  }
  TORCH_CHECK(false, op, ": no kernel for ggml type ", type);
}

// the 32-value sub-blocks of a row: Visit(sub, index of the sub-block in the row)
template <typename Visit>
inline void k4_k5_subs(const uint8_t* b, const uint8_t* qs, const uint8_t* high, int64_t s, Visit&& visit) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const __m256i high_bits = high ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)) : _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) visit(k4_k5_sub(d, dmin, b + 4, qs, high ? &high_bits : nullptr, j), s * 8 + j);
}

template <typename Visit>
inline void q6_k_subs(const uint8_t* b, int64_t s, Visit&& visit) {
  const float d = half_at(b + 208);
  for (int j = 0; j < 8; ++j) visit(q6_k_sub(d, b, j), s * 8 + j);
}

template <typename Visit>
inline void visit_row(int64_t type, const uint8_t* row, int64_t in, Visit&& visit) {
  switch (type) {
    case Q4_0: for (int64_t s = 0; s < in / 32; ++s) visit(q4_0_sub(row + s * kBlockBytes<Q4_0>), s); break;
    case Q4_1: for (int64_t s = 0; s < in / 32; ++s) visit(q4_1_sub(row + s * kBlockBytes<Q4_1>), s); break;
    case Q5_0: for (int64_t s = 0; s < in / 32; ++s) visit(q5_0_sub(row + s * kBlockBytes<Q5_0>), s); break;
    case Q8_0: for (int64_t s = 0; s < in / 32; ++s) visit(q8_0_sub(row + s * kBlockBytes<Q8_0>), s); break;
    case Q4_K:
      for (int64_t s = 0; s < in / 256; ++s)
        k4_k5_subs(row + s * kQ4kBytes, row + s * kQ4kBytes + 16, nullptr, s, visit);
      break;
    case Q5_K:
      for (int64_t s = 0; s < in / 256; ++s)
        k4_k5_subs(row + s * kQ5kBytes, row + s * kQ5kBytes + 48, row + s * kQ5kBytes + 16, s, visit);
      break;
    case Q6_K: for (int64_t s = 0; s < in / 256; ++s) q6_k_subs(row + s * kQ6kBytes, s, visit); break;
    default: TORCH_CHECK(false, "gguf: no kernel for ggml type ", type);
  }
}

// The blocks of the weight rows a thread reads next, fetched a share at a time while it multiplies
// the rows it has unpacked: the multiplies read no memory, and without this the memory stayed idle
// through them and the unpacking then waited on it (in quant_gemm_int8, the unpacking of Q8_0, a
// load, a xor and a store per 32 bytes, took 40% of the time of the multiplies it fed)
struct Ahead {
  const uint8_t* bytes = nullptr;
  int64_t size = 0;

  // bytes a share of `parts` takes, whole lines (a division: once a loop, not once a share)
  int64_t share_of(int64_t parts) const { return (size / parts + 64) & ~int64_t{63}; }

  // the `part`th `share` bytes
  void fetch_part(int64_t part, int64_t share, bool into_l1) const {
    for (int64_t at = part * share; at < std::min(size, (part + 1) * share); at += 64) {
      const char* line = reinterpret_cast<const char*>(bytes + at);
      into_l1 ? _mm_prefetch(line, _MM_HINT_T0) : _mm_prefetch(line, _MM_HINT_T1);
    }
  }
};

inline int64_t row_bytes_of(int64_t type, int64_t in) {
  switch (type) {
    case Q4_0: return in / 32 * kBlockBytes<Q4_0>;
    case Q4_1: return in / 32 * kBlockBytes<Q4_1>;
    case Q5_0: return in / 32 * kBlockBytes<Q5_0>;
    case Q8_0: return in / 32 * kBlockBytes<Q8_0>;
    case Q4_K: return in / 256 * kQ4kBytes;
    case Q5_K: return in / 256 * kQ5kBytes;
    case Q6_K: return in / 256 * kQ6kBytes;
  }
  TORCH_CHECK(false, "gguf: no kernel for ggml type ", type);
}

inline void check_blocks(const at::Tensor& weight, int64_t row_bytes, int64_t out, const char* op) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.numel() == out * row_bytes,
              op, ": weight must be contiguous uint8 [", out, ", ", row_bytes, "]");
}

}  // namespace conveyor_gguf

#endif
