// Rows of activations quantized to 16-bit integers per group, for quant_dot.cpp's integer dot
// products: xq = round(x / dx) in [-32767, 32767] with dx = max|x| / 32767 per group, and the
// sums of the represented values per sub-block of 32 (what the float offsets of Q4_1, Q4_K and
// Q5_K multiply).
#pragma once

#include <algorithm>
#include <vector>

#include "gguf_blocks.h"

#ifdef CONVEYOR_GGUF_BLOCKS
namespace conveyor_gguf {

// x per group of `group` values: int16 values, the group's step dx and the sums of the
// represented values per sub-block of 32 (for the types whose offsets are floats)
inline int64_t padded8(int64_t n) { return (n + 7) / 8 * 8; }

struct QuantizedRows {
  int64_t group;
  std::vector<int16_t> values;  // [rows, in]
  std::vector<float> steps;     // [rows, in / group]
  int64_t sums_stride;          // in / 32, padded to a multiple of 8
  std::vector<float> sub_sums;  // [rows, sums_stride], zeros past in / 32
};

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// one group of `count` values (a multiple of 8) -> values, step, sums per 32
template <typename T>
void quantize_group(const T* x, int64_t count, int16_t* values, float* step, float* sub_sums) {
  __m256 amax = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t i = 0; i < count; i += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(load8(x + i), abs_mask));
  float lanes[8];
  _mm256_storeu_ps(lanes, amax);
  const float largest = *std::max_element(lanes, lanes + 8);
  *step = largest / 32767.f;
  const __m256 inverse = _mm256_set1_ps(largest > 0.f ? 32767.f / largest : 0.f);
  for (int64_t s = 0; s < count / 32; ++s) {
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = s * 32; i < s * 32 + 32; i += 8) {
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + i), inverse));  // nearest, ties to even
      sum = _mm256_add_epi32(sum, q);
      const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(values + i), packed);
    }
    int32_t parts[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts), sum);
    int32_t whole = 0;
    for (int32_t p : parts) whole += p;
    sub_sums[s] = *step * static_cast<float>(whole);
  }
}

// values of x sharing a step: a K-quant's block; for the others the most of 256, 128, 64 and 32
// that divides a row (fewer steps to compute, about the same error: 1.5e-5 of the group's largest)
template <int64_t kType>
inline int64_t x_group(int64_t in) {
  if (kSubsPerBlock<kType> > 1) return 256;
  int64_t group = 256;
  while (in % group) group /= 2;
  return group;
}

// x [rows, in] contiguous; the buffers are the calling thread's, reused by its next call (a
// decode step makes about a hundred)
template <typename T>
const QuantizedRows& quantize_rows(const T* x, int64_t rows, int64_t in, int64_t group) {
  thread_local QuantizedRows q;
  q.group = group;
  q.values.resize(rows * in);
  q.steps.resize(rows * in / group);
  q.sums_stride = padded8(in / 32);
  q.sub_sums.assign(rows * q.sums_stride, 0.f);
  const int64_t groups = in / group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = r * groups + g;
      quantize_group(x + at * group, group, q.values.data() + at * group, &q.steps[at],
                     &q.sub_sums[r * q.sums_stride + g * group / 32]);
    }
  return q;
}

}  // namespace conveyor_gguf
#endif
