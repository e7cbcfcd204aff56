// An 8x8 block of floats transposed in registers (AVX): greedy_projection.cpp's panels of
// vocabulary rows, quant_dot_int8.cpp's scales of 8 weight rows.
#pragma once

#if defined(__AVX__)
#include <immintrin.h>

namespace conveyor_transpose {

// rows i = 0..7 of v become its columns: v[j][i] = v[i][j] before
inline void transpose8(__m256 v[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    v[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

}  // namespace conveyor_transpose
#endif
