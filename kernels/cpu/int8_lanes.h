// quant_gemm_int8.cpp's vectors, per instruction set and width (and quant_dot_int8.cpp's dot32: 32
// unsigned weight codes times 32 of x's signed codes in one ymm each -> 8 int32 lanes, lane k the
// sum of products 4k..4k+3). A vector holds a 32-bit lane per row of x (kLanes rows), 4 of the
// row's 8-bit codes a lane; 4 codes of a weight row are one broadcast. Rows are independent lanes
// doing the same integer and float operations, so a row's result is the same bits in either width.
// - Zmm, AVX-512 VNNI: 16 rows; vpdpbusd adds 4 products a lane into 32 bits.
// - Ymm: 8 rows. With AVX-512 VNNI, the GEMM's few-rows width: a zmm holding 5-8 rows multiplied
//   8-11 lanes of padding, and a 256-bit vpdpbusd issues twice where a 512-bit one issues once
//   (Zen 4 splits it in two halves). With AVX-VNNI without AVX-512 (Alder Lake and later), the
//   same vpdpbusd on 256 bits. With AVX2 alone, vpmaddubsw adds 2 products into 16 bits and
//   saturates past 32767, so a chunk of kChunkSteps steps adds there only as far as the weights'
//   largest code allows (2 * 127 * code a step), then vpmaddwd widens it into the 32-bit sums.
//   Q8_0's unsigned codes (q + 128) would overflow it against 8-bit x (2 * 127 * 255), so there x
//   is rounded to 7 bits in steps of 16 values (kNarrowX): vpmaddubsw, vpmaddwd and vpaddd for 32
//   products, where llama.cpp's sign trick (|w| times x with w's sign) takes vpsignb and vpabsb
//   too.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "gguf_blocks.h"

#ifdef CONVEYOR_GGUF_BLOCKS
#define CONVEYOR_INT8_LANES 1
namespace conveyor_int8 {
using namespace conveyor_gguf;

// the sum of the values a sub-block of x's codes stands for (what a float offset multiplies):
// one product of the exact integer sum, so every kernel and lane width gets the same float
inline float sub_sum(float step, int32_t codes_sum) { return step * static_cast<float>(codes_sum); }

inline int32_t four_at(const uint8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return four;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define CONVEYOR_INT8_ZMM 1
#define CONVEYOR_INT8_VNNI 1
inline __m256i dpbusd256(__m256i sums, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(sums, w, x); }
constexpr int kYmmColumns = 12;  // 12 chains of vpdpbusd with one row block; 32 registers hold them
#elif defined(__AVXVNNI__)
#define CONVEYOR_INT8_VNNI 1
inline __m256i dpbusd256(__m256i sums, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(sums, w, x); }
constexpr int kYmmColumns = 12;  // 6 sums, 6 float sums, x, w: 6 chains of vpdpbusd (4: output 19 ms, 6: 14)
#else
constexpr int kYmmColumns = 4;  // 16 ymm registers: 4 sums, 4 chunks and 4 float sums, x, w
#endif
#ifdef CONVEYOR_INT8_VNNI
constexpr int kYmmRowBlocks = 1, kYmmPairColumns = kYmmColumns;
#else
// AVX2: 2 row blocks share each weight broadcast, 2 columns at a time (4 would spill): at 32 rows
// the output projection of Qwen2.5-0.5B (Q8_0) 41.7 against 45.6 ms, its Q5_0 FFN 0.78-0.82
// against 0.85-0.90 (the fastest of three runs each on a Zen 4, x86-64-v3 build)
constexpr int kYmmRowBlocks = 2, kYmmPairColumns = 2;
#endif

// x against Q8_0 where vpmaddubsw adds its products (AVX2 without VNNI): Q8_0's unsigned codes
// (up to 255) times x up to 127 would saturate 16 bits, so x is rounded to 7 bits there (2 * 63 *
// 255 fits), in steps of 16 values, as accurate as 8 bits in steps of 32 (Qwen2.5-0.5B's output
// projection on the teacher-forced text: argmax agreement with float32 x 0.9883 against 0.9888,
// 7 bits in steps of 32 0.9858). Where vpdpbusd adds into 32 bits, x keeps 8 bits in steps of 32.
template <int64_t kType>
#ifdef CONVEYOR_INT8_VNNI
constexpr bool kNarrowX = false;
#else
constexpr bool kNarrowX = kType == Q8_0;
#endif
template <int64_t kType>
constexpr int kXTop = kNarrowX<kType> ? 63 : 127;  // x's largest code: step = max|x| / kXTop
template <int64_t kType>
constexpr int kXGroup = kNarrowX<kType> ? 16 : 32;  // values of x sharing a step
// values whose integer sum takes one float step: a weight scale's (Q6_K: 16) or x's step's
template <int64_t kType>
constexpr int kSubValues = kType == Q6_K || kNarrowX<kType> ? 16 : 32;

#ifdef CONVEYOR_INT8_VNNI
template <int64_t kType>
constexpr int kChunkSteps = kSubValues<kType> / 4;  // a whole sub-block in 32 bits
inline __m256i dot32(__m256i w, __m256i x) { return dpbusd256(_mm256_setzero_si256(), w, x); }
#else
template <int64_t kType>
constexpr int kLargestCode = kType == Q8_0 ? 255 : kType == Q6_K ? 63 : kType == Q5_0 || kType == Q5_K ? 31 : 15;
template <int64_t kType>
constexpr int kChunkSteps = std::min(kSubValues<kType> / 4, 32767 / (2 * kXTop<kType> * kLargestCode<kType>));
inline __m256i products_of(__m256i w, __m256i x) {  // adjacent pairs summed into 16 bits
  return _mm256_maddubs_epi16(w, x);
}
inline __m256i dot32(__m256i w, __m256i x) { return _mm256_madd_epi16(products_of(w, x), _mm256_set1_epi16(1)); }
#endif

struct Ymm {
  static constexpr int kLanes = 8, kColumns = kYmmColumns, kRowBlocks = kYmmRowBlocks;
  static constexpr int kPairColumns = kYmmPairColumns;  // columns a product of 2 row blocks takes
  using Ints = __m256i;
  using Floats = __m256;

  static Ints load_ints(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Ints broadcast4(const uint8_t* p) { return _mm256_set1_epi32(four_at(p)); }
#ifdef CONVEYOR_INT8_VNNI
  static Ints in_register(Ints v) { return v; }
  // a chunk's products add straight onto the sub-block's sums
  static Ints chunk_start(Ints sums) { return sums; }
  static Ints chunk_end(Ints, Ints chunk) { return chunk; }
  static Ints dot_step(Ints chunk, Ints w, Ints x) { return dpbusd256(chunk, w, x); }
#else
  // v in a register at this point: GCC neither folds its load into each instruction that uses it
  // (x's codes, reloaded for every weight row) nor reassociates sums through it (a chunk's adds
  // into a tree, all its vpmaddubsw first and their products spilled)
  static Ints in_register(Ints v) {
    asm("" : "+x"(v));
    return v;
  }
  static Ints chunk_start(Ints) { return _mm256_setzero_si256(); }
  static Ints chunk_end(Ints sums, Ints chunk) {  // in a register too: Q8_0's chunks, unrolled, spilled
    return in_register(_mm256_add_epi32(sums, _mm256_madd_epi16(chunk, _mm256_set1_epi16(1))));
  }
  static Ints dot_step(Ints chunk, Ints w, Ints x) {
    return in_register(_mm256_add_epi16(chunk, products_of(w, x)));  // one add a step into its chain
  }
#endif

  static Floats load_floats(const float* p) { return _mm256_loadu_ps(p); }
  static Floats load_floats(const uint16_t* p) {  // bfloat16 -> float32
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
  }
  static Floats splat(float v) { return _mm256_set1_ps(v); }
  static Floats zero_floats() { return _mm256_setzero_ps(); }
  static Floats floats_of(Ints v) { return _mm256_cvtepi32_ps(v); }
  static Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
  static Floats fmadd(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_lanes(Floats v, float* dst) { _mm256_storeu_ps(dst, v); }
  static void store_lanes(Floats v, uint16_t* dst) {  // bfloat16, nearest even
    alignas(32) float values[kLanes];
    _mm256_store_ps(values, v);
    for (int i = 0; i < kLanes; ++i) dst[i] = c10::detail::round_to_nearest_even(values[i]);
  }
};

#ifdef CONVEYOR_INT8_ZMM
struct Zmm {
  static constexpr int kLanes = 16;
  static constexpr int kColumns = 6;    // weight rows a step: with 2 row blocks 12 chains of vpdpbusd hide
  static constexpr int kRowBlocks = 2;  // its latency (4 weight rows ran at half the rate)
  static constexpr int kPairColumns = kColumns;
  using Ints = __m512i;
  using Floats = __m512;

  static Ints load_ints(const void* p) { return _mm512_loadu_si512(p); }
  static Ints in_register(Ints v) { return v; }
  static Ints broadcast4(const uint8_t* p) { return _mm512_set1_epi32(four_at(p)); }
  static Ints chunk_start(Ints sums) { return sums; }
  static Ints chunk_end(Ints, Ints chunk) { return chunk; }
  static Ints dot_step(Ints chunk, Ints w, Ints x) { return _mm512_dpbusd_epi32(chunk, w, x); }

  static Floats load_floats(const float* p) { return _mm512_loadu_ps(p); }
  static Floats load_floats(const uint16_t* p) {  // bfloat16 -> float32
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
  }
  static Floats splat(float v) { return _mm512_set1_ps(v); }
  static Floats zero_floats() { return _mm512_setzero_ps(); }
  static Floats floats_of(Ints v) { return _mm512_cvtepi32_ps(v); }
  static Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
  static Floats fmadd(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
  static void store_lanes(Floats v, float* dst) { _mm512_storeu_ps(dst, v); }
  static void store_lanes(Floats v, uint16_t* dst) {  // bfloat16, nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), to_bf16(v));
  }
};
using Widest = Zmm;
#else
using Widest = Ymm;
#endif

// rounding x: kRoundValues values a vector
constexpr int kRoundValues = Widest::kLanes;

#ifdef CONVEYOR_INT8_ZMM
template <typename T>
float largest_magnitude(const T* values, int64_t count) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t k = 0; k < count; k += kRoundValues)
    top = _mm512_max_ps(top, _mm512_abs_ps(Zmm::load_floats(values + k)));
  return _mm512_reduce_max_ps(top);
}

// kRoundValues values times inverse, rounded to nearest even -> codes; returns their sum
template <typename T>
int32_t codes_of(const T* values, float inverse, int8_t codes[kRoundValues]) {
  const __m512i ints = _mm512_cvtps_epi32(_mm512_mul_ps(Zmm::load_floats(values), _mm512_set1_ps(inverse)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(ints));
  return _mm512_reduce_add_epi32(ints);
}
#else
template <typename T>
float largest_magnitude(const T* values, int64_t count) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps();
  for (int64_t k = 0; k < count; k += kRoundValues)
    top = _mm256_max_ps(top, _mm256_and_ps(Ymm::load_floats(values + k), magnitude));
  alignas(32) float lanes[kRoundValues];
  _mm256_store_ps(lanes, top);
  return *std::max_element(lanes, lanes + kRoundValues);
}

template <typename T>
int32_t codes_of(const T* values, float inverse, int8_t codes[kRoundValues]) {
  const __m256i ints = _mm256_cvtps_epi32(_mm256_mul_ps(Ymm::load_floats(values), _mm256_set1_ps(inverse)));
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), _mm_packs_epi16(words, words));
  alignas(32) int32_t lanes[kRoundValues];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), ints);
  int32_t sum = 0;
  for (int32_t lane : lanes) sum += lane;
  return sum;
}
#endif

// w = scale * (u - kZeroPoint) + offset, u the unsigned code (Q8_0: q + 128); only Q4_1 and the
// Q4_K/Q5_K mins have a float offset (kFloatOffset)
template <int64_t kType>
constexpr int kZeroPoint = kType == Q4_0 ? 8 : kType == Q5_0 ? 16 : kType == Q6_K ? 32 : kType == Q8_0 ? 128 : 0;

// An 8-bit kernel's op: x float32 or bfloat16 [rows, in] -> y [rows, out] in x's dtype, through
// run(type tag, x's data, rows, weight blocks, out, in, y's data) with bfloat16 as uint16_t
template <typename Run>
at::Tensor rows_times_blocks(const char* op, const at::Tensor& x, const at::Tensor& weight, int64_t type,
                             int64_t out, int64_t in, Run&& run) {
  check_blocks(weight, row_bytes_of(type, in), out, op);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == in && in % 32 == 0 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              op, ": x float32 or bfloat16 [rows, ", in, "], a multiple of 32");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), out}, xc.options());
  if (x.size(0) == 0 || out == 0) return y;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  with_type(type, op, [&](auto tag) {
    if (x.scalar_type() == at::kFloat) {
      run(tag, xc.data_ptr<float>(), x.size(0), w, out, in, y.data_ptr<float>());
    } else {
      run(tag, reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), x.size(0), w, out, in,
          reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
    }
  });
  return y;
}

// One row of x [in] rounded to signed codes q = round(x / step), step = max|x| / kXTop per kXGroup
// values (of the weights' type), the one rounding every 8-bit kernel takes (so that a row comes out
// of them bit for bit alike): put(at, codes) for each kRoundValues codes from value `at`;
// done(sub, group, step, sum(q)) after each sub-block of kSubValues, step its group's.
template <int64_t kType, typename T, typename Put, typename Done>
void round_row(const T* x, int64_t in, Put&& put, Done&& done) {
  constexpr int kGroup = kXGroup<kType>, kSub = kSubValues<kType>;
  constexpr float kLevels = kXTop<kType>;
  for (int64_t g = 0; g < in / kGroup; ++g) {
    const T* values = x + g * kGroup;
    const float top = largest_magnitude(values, kGroup);
    const float step = top / kLevels;
    const float inverse = top > 0.f ? kLevels / top : 0.f;
    for (int64_t first = 0; first < kGroup; first += kSub) {
      int32_t sum = 0;
      for (int64_t k = first; k < first + kSub; k += kRoundValues) {
        int8_t codes[kRoundValues];
        sum += codes_of(values + k, inverse, codes);
        put(g * kGroup + k, codes);
      }
      done((g * kGroup + first) / kSub, g, step, sum);
    }
  }
}

}  // namespace conveyor_int8
#endif
