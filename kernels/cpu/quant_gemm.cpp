// GGUF-quantized weights times many rows of activations (prefill, batched decode): the weights
// dequantized a tile of output rows at a time, then multiplied.
//
// quant_dequantize_as(weight, type, out, in, dtype) -> [out, in] float32 or bfloat16 (AVX-512):
//   tiles for torch's matmul.
// quant_gemm(x, weight, type, out, in) -> [rows, out] bfloat16 (AVX-512 BF16):
//   x [rows, in] bfloat16, y = x @ dequantize(weight)^T with the weights rounded to bfloat16 (as
//   the tiles for torch's matmul are), products summed in float32. Each thread dequantizes a
//   tile of output rows (at most kTileBytes: it stays in the core's L2) and multiplies it at
//   once, 4 rows of x by 4 weight rows per step of 32 values in 16 vdpbf16ps accumulators: the
//   weights are unpacked once per call and written nowhere else. A batched decode step spent as
//   long writing and re-reading torch's tiles as multiplying them.
// Oracle: gguf-py's dequantize then a float matmul (tests/test_quant_kernels.py).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"

namespace {

#if defined(CONVEYOR_GGUF_BLOCKS) && defined(__AVX512F__) && defined(__AVX512BW__)
using namespace conveyor_gguf;

// one sub-block's 32 weights in two vectors of 16 floats: scale * u + offset (or scale * q)
inline void sub_weights(const SubBlock& sub, __m512 w[2]) {
  const __m256i bytes = sub.is_signed ? sub.sign_of : sub.codes;
  const __m128i halves[2] = {_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)};
  const __m128 scales = _mm256_castps256_ps128(sub.scale), high_scales = _mm256_extractf128_ps(sub.scale, 1);
  const __m128 offsets = _mm256_castps256_ps128(sub.offset), high_offsets = _mm256_extractf128_ps(sub.offset, 1);
  for (int h = 0; h < 2; ++h) {
    const __m512i ints = sub.is_signed ? _mm512_cvtepi8_epi32(halves[h]) : _mm512_cvtepu8_epi32(halves[h]);
    w[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_broadcastss_ps(h ? high_scales : scales),
                           _mm512_broadcastss_ps(h ? high_offsets : offsets));
  }
}

template <typename T>
inline void store_sub(const SubBlock& sub, T* y) {
  __m512 w[2];
  sub_weights(sub, w);
  for (int h = 0; h < 2; ++h) {
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(y + h * 16, w[h]);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + h * 16), to_bf16(w[h]));
    }
  }
}

template <typename T>
inline void dequantize_row(int64_t type, const uint8_t* wrow, int64_t in, T* y) {
  visit_row(type, wrow, in, [&](const SubBlock& sub, int64_t s) CONVEYOR_INLINE { store_sub(sub, y + s * 32); });
}

template <typename T>
void dequantize_rows(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t out, int64_t in, T* y) {
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) dequantize_row(type, w + o * row_bytes, in, y + o * in);
  });
}

// [out, in] in `dtype` (float32 or bfloat16)
at::Tensor quant_dequantize_as(const at::Tensor& weight, int64_t type, int64_t out, int64_t in,
                               at::ScalarType dtype) {
  const int64_t row_bytes = row_bytes_of(type, in);
  check_blocks(weight, row_bytes, out, "quant_dequantize_as");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_dequantize_as: float32 or bfloat16");
  at::Tensor y = at::empty({out, in}, weight.options().dtype(dtype));
  if (dtype == at::kFloat) {
    dequantize_rows(type, weight.data_ptr<uint8_t>(), row_bytes, out, in, y.data_ptr<float>());
  } else {
    dequantize_rows(type, weight.data_ptr<uint8_t>(), row_bytes, out, in,
                    reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  }
  return y;
}

bool quant_dequantize_as_available() { return true; }
#define CONVEYOR_QUANT_DEQUANTIZE_AS 1

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
constexpr int kBlock = 4;                  // rows of x and weight rows per microkernel step
constexpr int64_t kTileBytes = 256 << 10;  // a thread's dequantized weights

// [sum(a), sum(b), sum(c), sum(d)]
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: [a, b, c, d], each the sum of its 4 values there
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 low = _mm512_castps512_ps256(abcd);
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1));
  const __m256 half = _mm256_add_ps(low, high);
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

inline __m512bh load_bf16(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// sums[r][j] = x[r] . w[j] for R rows of x (row stride in) and 4 weight rows (row stride in)
template <int R>
inline void dot_block(const uint16_t* x, const uint16_t* w, int64_t in, __m128 sums[R]) {
  __m512 acc[R][kBlock];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kBlock; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 32) {
    __m512bh wv[kBlock];
    for (int j = 0; j < kBlock; ++j) wv[j] = load_bf16(w + j * in + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = load_bf16(x + r * in + k);
      for (int j = 0; j < kBlock; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

// y[r, o0 + j] for R rows of x from r0 and the tile's `count` weight rows (padded to a multiple
// of 4 with zero rows)
template <int R>
void tile_rows_product(const uint16_t* x, int64_t r0, const uint16_t* tile, int64_t count, int64_t in,
                       uint16_t* y, int64_t out, int64_t o0) {
  __m128 sums[R];
  for (int64_t j0 = 0; j0 < count; j0 += kBlock) {
    dot_block<R>(x + r0 * in, tile + j0 * in, in, sums);
    const int64_t valid = std::min<int64_t>(kBlock, count - j0);
    for (int r = 0; r < R; ++r) {
      const __m128i packed = reinterpret_cast<__m128i>(_mm_cvtneps_pbh(sums[r]));  // 4 bf16, low half
      uint16_t* dst = y + (r0 + r) * out + o0 + j0;
      if (valid == kBlock) {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), packed);
      } else {
        uint16_t values[8];
        _mm_storeu_si128(reinterpret_cast<__m128i*>(values), packed);
        std::memcpy(dst, values, valid * 2);
      }
    }
  }
}

void tile_product(const uint16_t* x, int64_t rows, const uint16_t* tile, int64_t count, int64_t in,
                  uint16_t* y, int64_t out, int64_t o0) {
  int64_t r0 = 0;
  for (; r0 + kBlock <= rows; r0 += kBlock) tile_rows_product<kBlock>(x, r0, tile, count, in, y, out, o0);
  switch (rows - r0) {
    case 1: return tile_rows_product<1>(x, r0, tile, count, in, y, out, o0);
    case 2: return tile_rows_product<2>(x, r0, tile, count, in, y, out, o0);
    case 3: return tile_rows_product<3>(x, r0, tile, count, in, y, out, o0);
  }
}

// output rows per tile: at most kTileBytes of bfloat16, a multiple of 4, and every thread a tile
int64_t tile_rows_for(int64_t out, int64_t in) {
  const int64_t fits = std::max<int64_t>(kBlock, kTileBytes / (in * 2) / kBlock * kBlock);
  const int64_t threads = at::get_num_threads();
  const int64_t share = (out + threads - 1) / threads;
  return std::min(fits, (share + kBlock - 1) / kBlock * kBlock);
}

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& weight, int64_t type, int64_t out, int64_t in) {
  const int64_t row_bytes = row_bytes_of(type, in);
  check_blocks(weight, row_bytes, out, "quant_gemm");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == in && in % 32 == 0 &&
                  x.scalar_type() == at::kBFloat16,
              "quant_gemm: x bfloat16 [rows, ", in, "], a multiple of 32");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, out}, xc.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const int64_t tile_rows = tile_rows_for(out, in);
  const int64_t num_tiles = (out + tile_rows - 1) / tile_rows;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    // the worker's tile, kept between calls: a fresh vector zeroed up to 256 KiB a call, a
    // hundred calls a step (every row a tile uses is written below, its padding included)
    thread_local std::vector<uint16_t> tile;
    if (tile.size() < static_cast<size_t>(tile_rows * in)) tile.resize(tile_rows * in);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * tile_rows, count = std::min(tile_rows, out - o0);
      const int64_t padded = (count + kBlock - 1) / kBlock * kBlock;
      for (int64_t o = 0; o < count; ++o) dequantize_row(type, w + (o0 + o) * row_bytes, in, tile.data() + o * in);
      std::fill(tile.begin() + count * in, tile.begin() + padded * in, 0);
      tile_product(xp, rows, tile.data(), count, in, yp, out, o0);
    }
  });
  return y;
}

bool quant_gemm_available() { return true; }
#define CONVEYOR_QUANT_GEMM 1
#endif  // AVX-512 BF16

#endif  // AVX-512

#ifndef CONVEYOR_QUANT_DEQUANTIZE_AS  // no AVX-512: quant_matmul.cpp's float32 dequantization serves
at::Tensor quant_dequantize_as(const at::Tensor&, int64_t, int64_t, int64_t, at::ScalarType) {
  TORCH_CHECK(false, "quant_dequantize_as: built without AVX-512");
}
bool quant_dequantize_as_available() { return false; }
#endif

#ifndef CONVEYOR_QUANT_GEMM  // no AVX-512 BF16: torch's matmul over dequantized tiles serves
at::Tensor quant_gemm(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "quant_gemm: built without AVX-512 BF16");
}
bool quant_gemm_available() { return false; }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("quant_dequantize_as(Tensor weight, int ggml_type, int out_features, int in_features, ScalarType dtype) -> Tensor");
  m.impl("quant_dequantize_as", c10::DispatchKey::CPU, &quant_dequantize_as);
  m.def("quant_dequantize_as_available() -> bool");
  m.impl("quant_dequantize_as_available", &quant_dequantize_as_available);
  m.def("quant_gemm(Tensor x, Tensor weight, int ggml_type, int out_features, int in_features) -> Tensor");
  m.impl("quant_gemm", c10::DispatchKey::CPU, &quant_gemm);
  m.def("quant_gemm_available() -> bool");
  m.impl("quant_gemm_available", &quant_gemm_available);
}
