// GGUF-quantized weights times a few rows of activations in 8-bit integers: the decode path where
// the activations are 8-bit (--quantized-activations int8, or auto's default for the family).
//
// quant_dot_int8(x, weight, type, out, in) -> [rows, out] in x's dtype (float32 or bfloat16):
//   row for row, bit for bit what quant_gemm_int8 returns. x is rounded by the same round_row
//   (int8_lanes.h: 8 bits per 32 values, step = max|x| / 127; against Q8_0 on AVX2 7 bits per
//   16), each sub-block's integer sum is exact, and each output then takes the same float
//   operations in the same order: per sub-block y = fma(sum * step, scale, y), and for the float
//   offsets y = fma(x's sum, offset, y). So a decode row rounds the same alone, in a full batch,
//   or as a verify row beside its drafts.
// Why: quant_gemm_int8 holds a row of x per 32-bit lane, so one row multiplies 7 (AVX-512: 15)
// lanes of padding; quant_dot widens weights and x to 16 bits. Here a weight sub-block's 32 codes
// are one ymm against 32 of x's codes: vpmaddubsw and vpmaddwd (AVX2) or one vpdpbusd (VNNI),
// llama.cpp's vec_dot with Q8_0 activations.
// Layout of the work: kTile weight rows side by side. A sub-block gives each of them a vector of 8
// partial sums; the 8 vectors are summed across lanes into one (lane i: weight row i), so the
// float work and the gathered scales serve 8 weight rows an instruction. Two rows of x share
// those vectors (pair_dot: one row in lanes 0-3, the other in 4-7), so that one reduction serves
// both: at 2-4 rows the layers of Qwen2.5-Coder-1.5B took 11-20% less time (Zen 4, AVX-512 and
// AVX2 builds), and a verify row beside its drafts costs that much less. Threads over tiles.
// Oracle: quant_gemm_int8, bit for bit, and through it gguf-py (tests/test_quant_kernels.py).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "int8_lanes.h"
#include "transpose8.h"

namespace {

#ifdef CONVEYOR_INT8_LANES
using namespace conveyor_int8;
using conveyor_transpose::transpose8;

constexpr int kTile = 8;  // weight rows side by side: a float lane each

// x [rows, in] rounded by round_row, row-major: codes [rows][in]; steps [rows][in / kXGroup];
// sums (step * sum(q)) and starts (-zero point * sum(q)) [rows][in / sub]
struct PlainRows {
  std::vector<int8_t> codes;
  std::vector<float> steps, sums;
  std::vector<int32_t> starts;
};

template <int64_t kType, typename T>
const PlainRows& quantize_plain(const T* x, int64_t rows, int64_t in) {
  thread_local PlainRows q;  // reused: a hundred calls a step
  const int64_t groups = in / kXGroup<kType>, subs = in / kSubValues<kType>;
  q.codes.resize(rows * in);
  q.steps.resize(rows * groups);
  q.sums.resize(rows * subs);
  q.starts.resize(rows * subs);
  for (int64_t r = 0; r < rows; ++r)
    round_row<kType>(
        x + r * in, in,
        [&](int64_t at, const int8_t* codes) { std::memcpy(q.codes.data() + r * in + at, codes, kRoundValues); },
        [&](int64_t sub, int64_t group, float step, int32_t sum) {
          q.sums[r * subs + sub] = sub_sum(step, sum);
          q.starts[r * subs + sub] = -kZeroPoint<kType> * sum;
          q.steps[r * groups + group] = step;
        });
  return q;
}

// sub-block j (of 32 values) of the block at b as unsigned codes (Q8_0: q + 128)
template <int64_t kType>
inline __m256i codes32(const uint8_t* b, int j) {
  if constexpr (kType == Q4_0) return q4_0_sub(b).codes;
  if constexpr (kType == Q4_1) return q4_1_sub(b).codes;
  if constexpr (kType == Q5_0) return q5_0_sub(b).codes;
  if constexpr (kType == Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    return _mm256_xor_si256(q, _mm256_set1_epi8(-128));
  }
  if constexpr (kType == Q4_K) return k4_k5_codes(b + 16, nullptr, j);
  if constexpr (kType == Q5_K) {
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    return k4_k5_codes(b + 48, &high, j);
  }
  if constexpr (kType == Q6_K) return q6_k_codes(b, j);
}

// v[i] -> lane i of `low` the sum of v[i]'s lanes 0-3, of `high` the sum of its lanes 4-7
inline void sum_halves(const __m256i v[kTile], __m256i& low, __m256i& high) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  low = _mm256_permute2x128_si256(u0, u1, 0x20);
  high = _mm256_permute2x128_si256(u0, u1, 0x31);
}

// the two half-precision values `at` bytes into each of the tile's rows (a block's d, and Q4_1's
// m or the next bytes): `first` and `second` with row i in lane i. One 32-bit load a row: two
// 16-bit gathers took twice the instructions, a fifth of Q4_1's time with AVX2
inline void halves_of(const uint8_t* const rows[kTile], int64_t at, __m256& first, __m256& second) {
  int32_t words[kTile];
  for (int i = 0; i < kTile; ++i) std::memcpy(words + i, rows[i] + at, 4);
  const __m256i pairs = _mm256_setr_epi32(words[0], words[1], words[2], words[3], words[4], words[5], words[6],
                                          words[7]);
  // per 128-bit lane: the 4 first halves, then the 4 second ones; then the lanes' first halves together
  const __m256i split = _mm256_shuffle_epi8(
      pairs, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3,
                              6, 7, 10, 11, 14, 15));
  const __m256i ordered = _mm256_permute4x64_epi64(split, 0xD8);  // 64-bit parts 0, 2, 1, 3
  first = _mm256_cvtph_ps(_mm256_castsi256_si128(ordered));
  second = _mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1));
}

// A block's weight scales and float offsets for the tile's rows: per scale of the block (a K-quant
// has 8, Q6_K 16), a vector with weight row i in lane i, the floats quant_gemm_int8 unpacks
template <int64_t kType>
struct TileScales {
  static constexpr int kCount = kType == Q6_K ? 16 : kSubsPerBlock<kType>;
  __m256 scales[kCount], offsets[kFloatOffset<kType> ? kCount : 1];
};

template <int64_t kType>
inline void scales_of(const uint8_t* const rows[kTile], int64_t block_at, TileScales<kType>& t) {
  if constexpr (kSubsPerBlock<kType> == 1) {
    __m256 second;
    halves_of(rows, block_at, t.scales[0], kType == Q4_1 ? t.offsets[0] : second);
  } else if constexpr (kType == Q6_K) {
    for (int i = 0; i < kTile; ++i) {
      const uint8_t* b = rows[i] + block_at;
      const __m128i signed_scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
      const __m256 d = _mm256_set1_ps(half_at(b + 208));
      t.scales[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(signed_scales)), d);
      t.scales[i + 8] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(signed_scales, 8))), d);
    }
    transpose8(t.scales);
    transpose8(t.scales + 8);
  } else {  // Q4_K, Q5_K
    for (int i = 0; i < kTile; ++i) {
      const uint8_t* b = rows[i] + block_at;
      uint32_t scale_words[2], min_words[2];
      k4_scales_mins(b, scale_words, min_words);
      t.scales[i] = _mm256_mul_ps(floats8(scale_words), _mm256_set1_ps(half_at(b)));
      t.offsets[i] = _mm256_mul_ps(floats8(min_words), _mm256_set1_ps(-half_at(b + 2)));
    }
    transpose8(t.scales);
    transpose8(t.offsets);
  }
}

// Two rows of x in the lanes of one product, so that one reduction (sum_halves) serves both:
// a's values 0-15 with b's 16-31, and a's 16-31 with b's 0-15 (a weight sub-block and its halves
// swapped multiply them), each row whole in one half of the lanes. Not Q6_K's: a scale per 16 values
inline void pair_halves(__m256i& a, __m256i& b) {
  const __m256i straight = _mm256_blend_epi32(a, b, 0xF0), crossed = _mm256_permute2x128_si256(a, b, 0x21);
  a = straight;
  b = crossed;
}

// lanes 0-3: row a's products with the sub-block's codes, summed 4 a lane; lanes 4-7: row b's
template <int64_t kType>
inline __m256i pair_dot(__m256i codes, __m256i swapped, __m256i straight, __m256i crossed) {
#ifdef CONVEYOR_INT8_VNNI
  return dpbusd256(dpbusd256(_mm256_setzero_si256(), codes, straight), swapped, crossed);
#else
  if constexpr (kChunkSteps<kType> >= 2)  // the two products' 16-bit sums add without overflow
    return _mm256_madd_epi16(_mm256_add_epi16(products_of(codes, straight), products_of(swapped, crossed)),
                             _mm256_set1_epi16(1));
  return _mm256_add_epi32(dot32(codes, straight), dot32(swapped, crossed));
#endif
}

// y[i] += one sub-block's part (`sums` lane i: weight row i's exact integer sum, less the start)
inline __m256 add_part(__m256 y, __m256i sums, int32_t start, float step, __m256 scales) {
  const __m256 whole = _mm256_cvtepi32_ps(_mm256_add_epi32(sums, _mm256_set1_epi32(start)));
  return _mm256_fmadd_ps(_mm256_mul_ps(whole, _mm256_set1_ps(step)), scales, y);
}

// R rows of x (from r0) times the tile's weight rows -> y[r], 8 results a lane each; each weight
// sub-block is unpacked once for the R rows. `ahead`: the next tile's bytes, fetched a share a block
template <int64_t kType, int R>
void tile_rows(const uint8_t* const rows[kTile], const PlainRows& x, int64_t r0, int64_t in, const Ahead& ahead,
               __m256 y[R]) {
  constexpr int kSubs = kSubsPerBlock<kType>;
  constexpr bool kHalves = kSubValues<kType> == 16;  // a sub-block's values 0-15 and 16-31 apart
  constexpr int kPairs = kHalves ? 0 : R / 2;  // pairs of rows sharing their vectors (pair_dot)
  const int64_t blocks = in / (32 * kSubs), subs = in / kSubValues<kType>, groups = in / kXGroup<kType>;
  __m256 sum[R];  // in registers: written through y they were stored every sub-block
  for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
  const int64_t share = ahead.size ? ahead.share_of(blocks) : 0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (share) ahead.fetch_part(b, share, ahead.size <= 16384);  // into L1 where it fits
    TileScales<kType> t;
    scales_of<kType>(rows, b * kBlockBytes<kType>, t);
    for (int j = 0; j < kSubs; ++j) {
      const int64_t s32 = b * kSubs + j;  // the sub-block of 32 values in the row: its group of x
      __m256i xv[R], parts[R][kTile];
      for (int r = 0; r < R; ++r)
        xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes.data() + (r0 + r) * in + s32 * 32));
      for (int p = 0; p < kPairs; ++p) pair_halves(xv[2 * p], xv[2 * p + 1]);
#pragma GCC unroll 8
      for (int i = 0; i < kTile; ++i) {
        const __m256i codes = codes32<kType>(rows[i] + b * kBlockBytes<kType>, j);
        if constexpr (kPairs > 0) {
          const __m256i swapped = _mm256_permute2x128_si256(codes, codes, 0x01);
          for (int p = 0; p < kPairs; ++p) parts[p][i] = pair_dot<kType>(codes, swapped, xv[2 * p], xv[2 * p + 1]);
        }
        for (int r = 2 * kPairs; r < R; ++r) parts[r - kPairs][i] = dot32(codes, xv[r]);
      }
      // lane i of low[r] and high[r]: weight row i's integer sums over the sub-block's values 0-15
      // and 16-31 of row r (a pair's rows: each whole in low)
      __m256i low[R], high[R];
      for (int p = 0; p < kPairs; ++p) {
        sum_halves(parts[p], low[2 * p], low[2 * p + 1]);
        high[2 * p] = high[2 * p + 1] = _mm256_setzero_si256();
      }
      for (int r = 2 * kPairs; r < R; ++r) sum_halves(parts[r - kPairs], low[r], high[r]);
      for (int r = 0; r < R; ++r) {
        const float* steps = x.steps.data() + (r0 + r) * groups;
        const int32_t* starts = x.starts.data() + (r0 + r) * subs;
        if constexpr (kHalves) {  // Q6_K: a scale per 16 values; Q8_0 with 7-bit x: a step of x
          const int scale = kType == Q6_K ? 2 * j : j, high_scale = kType == Q6_K ? 2 * j + 1 : j;
          constexpr bool kHalfSteps = kXGroup<kType> == 16;
          const int64_t step = kHalfSteps ? 2 * s32 : s32, high_step = kHalfSteps ? 2 * s32 + 1 : s32;
          sum[r] = add_part(sum[r], low[r], starts[2 * s32], steps[step], t.scales[scale]);
          sum[r] = add_part(sum[r], high[r], starts[2 * s32 + 1], steps[high_step], t.scales[high_scale]);
        } else {
          const float step = steps[s32];
          sum[r] = add_part(sum[r], _mm256_add_epi32(low[r], high[r]), starts[s32], step, t.scales[j]);
          if constexpr (kFloatOffset<kType>)
            sum[r] = _mm256_fmadd_ps(_mm256_set1_ps(x.sums[(r0 + r) * subs + s32]), t.offsets[j], sum[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r] = sum[r];
}

inline void store_row(__m256 y, int valid, float* dst) {
  alignas(32) float lanes[kTile];
  _mm256_store_ps(lanes, y);
  std::copy(lanes, lanes + valid, dst);
}

inline void store_row(__m256 y, int valid, uint16_t* dst) {  // bfloat16, nearest even
  alignas(32) float lanes[kTile];
  _mm256_store_ps(lanes, y);
  for (int i = 0; i < valid; ++i) dst[i] = c10::detail::round_to_nearest_even(lanes[i]);
}

constexpr int kMaxRows = 4;  // rows of x a pass over a tile

// every pass of up to kMaxRows rows of x over one tile; results stored from column o0
template <int64_t kType, typename T>
void tile_all_rows(const uint8_t* const rows[kTile], const PlainRows& x, int64_t rows_x, int64_t in,
                   const Ahead& ahead, int valid, T* y, int64_t out, int64_t o0) {
  for (int64_t r0 = 0; r0 < rows_x; r0 += kMaxRows) {
    const Ahead fetch = r0 == 0 ? ahead : Ahead{};
    __m256 results[kMaxRows];
    const int count = static_cast<int>(std::min<int64_t>(kMaxRows, rows_x - r0));
    switch (count) {
      case 1: tile_rows<kType, 1>(rows, x, r0, in, fetch, results); break;
      case 2: tile_rows<kType, 2>(rows, x, r0, in, fetch, results); break;
      case 3: tile_rows<kType, 3>(rows, x, r0, in, fetch, results); break;
      default: tile_rows<kType, 4>(rows, x, r0, in, fetch, results); break;
    }
    for (int r = 0; r < count; ++r) store_row(results[r], valid, y + (r0 + r) * out + o0);
  }
}

template <int64_t kType, typename T>
void dot_rows(const T* xp, int64_t rows, const uint8_t* w, int64_t out, int64_t in, T* y) {
  const PlainRows& x = quantize_plain<kType>(xp, rows, in);
  const int64_t row_bytes = row_bytes_of(kType, in), tiles = (out + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t o0 = tile * kTile;
      const int valid = static_cast<int>(std::min<int64_t>(kTile, out - o0));
      const uint8_t* weight_rows[kTile];
      for (int i = 0; i < kTile; ++i) weight_rows[i] = w + (o0 + std::min(i, valid - 1)) * row_bytes;
      const int64_t next = std::min(out, o0 + kTile);
      const Ahead ahead{w + next * row_bytes, (std::min(out, next + kTile) - next) * row_bytes};
      tile_all_rows<kType>(weight_rows, x, rows, in, ahead, valid, y, out, o0);
    }
  });
}

at::Tensor quant_dot_int8(const at::Tensor& x, const at::Tensor& weight, int64_t type, int64_t out, int64_t in) {
  return rows_times_blocks("quant_dot_int8", x, weight, type, out, in, [](auto tag, auto... args) {
    dot_rows<decltype(tag)::value>(args...);
  });
}

bool quant_dot_int8_available() { return true; }
#define CONVEYOR_QUANT_DOT_INT8 1
#endif  // CONVEYOR_INT8_LANES

#ifndef CONVEYOR_QUANT_DOT_INT8
at::Tensor quant_dot_int8(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "quant_dot_int8: built without AVX2");
}
bool quant_dot_int8_available() { return false; }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("quant_dot_int8(Tensor x, Tensor weight, int ggml_type, int out_features, int in_features) -> Tensor");
  m.impl("quant_dot_int8", c10::DispatchKey::CPU, &quant_dot_int8);
  m.def("quant_dot_int8_available() -> bool");
  m.impl("quant_dot_int8_available", &quant_dot_int8_available);
}
