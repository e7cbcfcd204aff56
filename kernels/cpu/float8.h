// Eight floats as GCC/Clang vector extensions: AVX2 or AVX-512 instructions under -march=native,
// plain loops elsewhere. Loads from float32 and bfloat16 rows, lane sums and e^x for x <= 0, shared
// by paged_decode.cpp's softmax and sampling.cpp's token weights.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace conveyor_float8 {

// eight floats, loaded from any float address
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline float sum_lanes(v8 x) {
  float total = 0.f;
  for (int i = 0; i < 8; ++i) total += x[i];
  return total;
}

inline v8 load8(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline v8 load8(const at::BFloat16* p) {  // bfloat16 -> float32: the bits, 16 places up
  const u16x8 bits = *reinterpret_cast<const u16x8*>(p);
  return (v8)(__builtin_convertvector(bits, i8) << 16);
}

// exp(x) for x <= 0 (scores minus their maximum), about 1 ulp: 2^n * e^r with n = round(x /
// ln 2), |r| <= ln 2 / 2, e^r by Cephes' polynomial; 0 below -87 (e^-87 is ~1e-38).
inline v8 exp8(v8 x) {
#if defined(__AVX__)
  const v8 too_small = (v8)(x < -87.f);
  x = x < -87.f ? v8{} - 87.f : x;
  const v8 n = (v8)_mm256_round_ps((__m256)(x * 1.44269504088896341f),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v8 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const i8 scale = (__builtin_convertvector(n, i8) + 127) << 23;
  const v8 out = p * (v8)scale;
  return (v8)((i8)out & ~(i8)too_small);
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = std::exp(x[i]);
  return out;
#endif
}

}  // namespace conveyor_float8
