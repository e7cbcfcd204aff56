// GGUF-quantized weights times activations quantized to 8 bits, in integer dot products (the
// decode path: few rows; llama.cpp's method, written afresh, with a second int8 term for x).
//
// Shapes:
//   x:       [rows, in], float32 or bfloat16 (in a multiple of 32)
//   weight:  [out, row_bytes] uint8, each row in / block_size blocks of the GGUF type (as in the
//            file: ggml-common.h's block structs, little-endian, half-precision scales)
//   returns  [rows, out] in x's dtype: y = x @ dequantize(weight)^T, x rounded per block of 32
//
// Method. Each row of x is quantized once per call, per block of 32: xq = round(x / dx) in
// [-127, 127], dx = max|x| / 127; with `residual` (the default) the rest x - dx * xq is quantized
// with the step dx / 256 (xr, clamped to [-127, 127]), so x ~ dx * xq + dx / 256 * xr to about
// 1e-5 of the block's largest value (one term alone: about 4e-3, enough to flip 4% of a small
// model's argmaxes). Lane sums are the sums of 4 represented values. The weights are read as
// gguf_blocks.h's sub-blocks: 32 codes u with a scale and an offset per lane of 4 values. Then
//   sum(w * x) over a sub-block = scale . dx / 256 * (256 dot(u, xq) + dot(u, xr)) + offset . lanesum(x)
// with dot(u, xq) in one VNNI vpdpbusd (8 int32 lanes of 4 products; AVX2 without VNNI:
// vpmaddubsw + vpmaddwd, no saturation since u <= 128). Accumulated in 8 float lanes per row of
// x, summed once per output. Threads over groups of 8 weight rows (one row of x; 4 with more):
// a group's rows are read side by side, each x sub-block loaded once for all of them, with a
// chain of accumulators per weight row, and the next group prefetched as this one is read. The
// weight bytes are read once per call.
// Oracle: gguf-py's dequantize then a float matmul (tests/test_quant_kernels.py).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"

namespace {

#ifdef CONVEYOR_GGUF_BLOCKS
using namespace conveyor_gguf;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Two rows of x in one 512-bit operand: the weight codes broadcast to both halves, each half's
// lanes computed as the 256-bit path computes one row's (so a row's result does not depend on
// the rows beside it). A verify of 5 drafts (6 rows of one sequence) ran 1.1-1.5x faster than
// row by row on Zen 4, whose 512-bit instructions are two 256-bit halves.
#define CONVEYOR_ROW_PAIRS 1
constexpr int kMaxRows = 6;  // rows of x sharing one unpacked weight sub-block
constexpr int kFirstPairedRows = 4;  // fewer rows go one by one (a pair's set-up is not paid back)
#else
constexpr int kMaxRows = 4;
constexpr int kFirstPairedRows = kMaxRows + 1;  // no pairs
#endif

// x quantized per block of 32 in two terms, x ~ d * codes + d / 256 * residual codes: the second
// term brings the activations' error near float32's (residual off: one term, as llama.cpp's Q8
// activations). The step of the second term is a power of two below the first's, so that both
// dot products sum in one integer, 256 * dot(u, codes) + dot(u, residual codes) (below 2^24:
// exact in float32). Lane sums are those of the values the codes stand for.
struct QuantizedRows {
  std::vector<int8_t> codes, residual_codes;  // [rows, in]
  std::vector<float> dot_scales;              // [rows, in / 32]: d, or d / 256 with residual
  std::vector<float> lane_sums;               // [rows, in / 32, 8]
  // the same for rows 2p, 2p + 1 side by side (pair_rows)
  std::vector<int8_t> pair_codes, pair_residual_codes;  // [rows / 2, in / 32, 64]
  std::vector<float> pair_scales, pair_lane_sums;        // [rows / 2, in / 32, 16]
};

// 32 values to codes in [-127, 127]; returns the scale
inline float quantize_block(const float* v, int8_t* codes) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < 32; ++i) codes[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
  return amax / 127.f;
}

// x's blocks [count, 32] into q's codes, scales and lane sums
template <typename T>
void quantize_blocks(const T* x, int64_t count, bool residual, QuantizedRows& q) {
  for (int64_t b = 0; b < count; ++b) {
    float v[32];
    for (int i = 0; i < 32; ++i) v[i] = static_cast<float>(x[b * 32 + i]);
    int8_t* codes = q.codes.data() + b * 32;
    const float d = quantize_block(v, codes);
    float represented[32];
    for (int i = 0; i < 32; ++i) represented[i] = d * codes[i];
    q.dot_scales[b] = d;
    if (residual) {
      const float step = d / 256.f, inverse = d > 0.f ? 256.f / d : 0.f;
      int8_t* rest_codes = q.residual_codes.data() + b * 32;
      for (int i = 0; i < 32; ++i) {
        const float code = std::nearbyint((v[i] - represented[i]) * inverse);  // |code| <= 128
        rest_codes[i] = static_cast<int8_t>(std::clamp(code, -127.f, 127.f));
        represented[i] += step * rest_codes[i];
      }
      q.dot_scales[b] = step;
    }
    for (int lane = 0; lane < 8; ++lane) {
      const float* r = represented + lane * 4;
      q.lane_sums[b * 8 + lane] = r[0] + r[1] + r[2] + r[3];
    }
  }
}

#ifdef CONVEYOR_ROW_PAIRS
// Rows 2p and 2p + 1 side by side, per sub-block s at [p, s]: their codes (32 bytes each), their
// scales (8 floats each: dx broadcast) and lane sums (8 each), for one 512-bit operand a pair
void pair_rows(int64_t rows, int64_t subs, bool residual, QuantizedRows& q) {
  const int64_t pairs = rows / 2;
  q.pair_codes.resize(pairs * subs * 64);
  q.pair_residual_codes.resize(residual ? pairs * subs * 64 : 0);
  q.pair_scales.resize(pairs * subs * 16);
  q.pair_lane_sums.resize(pairs * subs * 16);
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t s = 0; s < subs; ++s)
      for (int half = 0; half < 2; ++half) {
        const int64_t xb = (2 * p + half) * subs + s, at = (p * subs + s) * 2 + half;
        std::memcpy(q.pair_codes.data() + at * 32, q.codes.data() + xb * 32, 32);
        if (residual) std::memcpy(q.pair_residual_codes.data() + at * 32, q.residual_codes.data() + xb * 32, 32);
        std::fill_n(q.pair_scales.data() + at * 8, 8, q.dot_scales[xb]);
        std::memcpy(q.pair_lane_sums.data() + at * 8, q.lane_sums.data() + xb * 8, 8 * sizeof(float));
      }
}
#endif

// x [rows, in] contiguous, float32 or bfloat16; the buffers are the calling thread's, reused by
// its next call (a decode step makes about a hundred)
const QuantizedRows& quantize_rows(const at::Tensor& x, bool residual) {
  thread_local QuantizedRows q;
  const int64_t values = x.numel(), blocks = values / 32;
  q.codes.resize(values);
  q.residual_codes.resize(residual ? values : 0);
  q.dot_scales.resize(blocks);
  q.lane_sums.resize(blocks * 8);
  if (x.scalar_type() == at::kFloat) {
    quantize_blocks(x.data_ptr<float>(), blocks, residual, q);
  } else {
    quantize_blocks(x.data_ptr<at::BFloat16>(), blocks, residual, q);
  }
#ifdef CONVEYOR_ROW_PAIRS
  if (x.size(0) >= kFirstPairedRows) pair_rows(x.size(0), x.size(1) / 32, residual, q);
#endif
  return q;
}

// acc + 8 int32 lanes, lane i = sum of u[4i..4i+3] * x[4i..4i+3]; u unsigned, x signed
inline __m256i dot_lanes(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 codes of x, their signs following q's for signed types
inline __m256i codes_for(const SubBlock& sub, const int8_t* codes) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  return sub.is_signed ? _mm256_sign_epi8(x, sub.sign_of) : x;
}

#ifdef CONVEYOR_ROW_PAIRS
constexpr bool kRowPairs = true;

// a weight sub-block for two rows of x at once: codes, scale and offset in both halves, and
// the mask of the lanes whose x must change sign (signed types)
struct PairSub {
  __m512i codes;
  __m512 scale, offset;
  __mmask64 negate;
};

inline PairSub pair_sub(const SubBlock& sub) {
  const auto both = [](__m256 v) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v))); };
  const __mmask64 negate = sub.is_signed ? _mm512_movepi8_mask(_mm512_broadcast_i64x4(sub.sign_of)) : 0;
  return PairSub{_mm512_broadcast_i64x4(sub.codes), both(sub.scale), both(sub.offset), negate};
}

// 64 codes of a pair of rows at p, their signs following the weight's (vpsignb's, but for lanes
// whose weight code is 0, whose products are 0 either way)
inline __m512i pair_codes_for(const PairSub& sub, const int8_t* p) {
  const __m512i x = _mm512_loadu_si512(p);
  return _mm512_mask_sub_epi8(x, sub.negate, _mm512_setzero_si512(), x);
}

template <bool kResidual>
inline void pair_step(const PairSub& sub, bool has_offset, const QuantizedRows& xq, int64_t at, __m512& acc,
                      __m512& off) {
  __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), sub.codes,
                                    pair_codes_for(sub, xq.pair_codes.data() + at * 64));
  if constexpr (kResidual)
    dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dot, 8), sub.codes,
                              pair_codes_for(sub, xq.pair_residual_codes.data() + at * 64));
  const __m512 scale = _mm512_mul_ps(sub.scale, _mm512_loadu_ps(xq.pair_scales.data() + at * 16));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
  if (has_offset) off = _mm512_fmadd_ps(sub.offset, _mm512_loadu_ps(xq.pair_lane_sums.data() + at * 16), off);
}

inline __m256 low_half(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
#else
constexpr bool kRowPairs = false;
#endif

// y for R rows of x (from row r0, even where R > 1) and kOut weight rows (from o0; `valid` of
// them stored): the x side of each sub-block is read once for the kOut weight rows, and the
// kOut * R accumulators are independent chains (one row's chain alone made the FMA latency the
// bound). With AVX-512, rows go two by two (kPairs), an odd last row alone.
template <int64_t kType, int kOut, int R, bool kResidual, typename T>
void dot_tile(const uint8_t* w, int64_t row_bytes, int64_t subs, const QuantizedRows& xq, int64_t r0, int64_t o0,
              int valid, int64_t out, T* y) {
  constexpr int kPairs = kRowPairs && R >= kFirstPairedRows ? R / 2 : 0, kFirstSingle = 2 * kPairs;
  const uint8_t* rows[kOut];
  for (int i = 0; i < kOut; ++i) rows[i] = w + (o0 + std::min(i, valid - 1)) * row_bytes;
  __m256 acc[kOut][R], off[kOut][R];  // off: the offsets' terms, a chain of their own
  for (int i = 0; i < kOut; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = off[i][r] = _mm256_setzero_ps();
#ifdef CONVEYOR_ROW_PAIRS
  __m512 pair_acc[kOut][kPairs > 0 ? kPairs : 1], pair_off[kOut][kPairs > 0 ? kPairs : 1];
  for (int i = 0; i < kOut; ++i)
    for (int p = 0; p < kPairs; ++p) pair_acc[i][p] = pair_off[i][p] = _mm512_setzero_ps();
#endif
  // kOut rows read side by side are kOut streams, which the hardware prefetcher served at half
  // the speed of one: the next group's rows (contiguous) are fetched at the pace this one is read
  const char* next_group = reinterpret_cast<const char*>(w + (o0 + kOut) * row_bytes);
  const int64_t ahead_per_sub = kOut * row_bytes / subs;
  const bool fits_l1 = kOut * row_bytes <= 16384;
  constexpr int kPerStep = kSubsPerBlock<kType>;  // a K-quant's 8 sub-blocks, their j constant
  for (int64_t s0 = 0; s0 < subs; s0 += kPerStep) {
#pragma GCC unroll 8
    for (int j = 0; j < kPerStep; ++j) {
      const int64_t s = s0 + j;
      for (int64_t b = s * ahead_per_sub; b < (s + 1) * ahead_per_sub; b += 64)
        fits_l1 ? _mm_prefetch(next_group + b, _MM_HINT_T0) : _mm_prefetch(next_group + b, _MM_HINT_T1);
#pragma GCC unroll 8
      for (int i = 0; i < kOut; ++i) {
        const SubBlock sub = sub_block_in<kType>(rows[i], s0, j);
#ifdef CONVEYOR_ROW_PAIRS
        if constexpr (kPairs > 0) {
          const PairSub pair = pair_sub(sub);
#pragma GCC unroll 3
          for (int p = 0; p < kPairs; ++p)
            pair_step<kResidual>(pair, sub.has_offset, xq, (r0 / 2 + p) * subs + s, pair_acc[i][p], pair_off[i][p]);
        }
#endif
#pragma GCC unroll 4
        for (int r = kFirstSingle; r < R; ++r) {
          const int64_t xb = (r0 + r) * subs + s;
          __m256i dot = dot_lanes(_mm256_setzero_si256(), sub.codes, codes_for(sub, xq.codes.data() + xb * 32));
          if constexpr (kResidual)
            dot = dot_lanes(_mm256_slli_epi32(dot, 8), sub.codes, codes_for(sub, xq.residual_codes.data() + xb * 32));
          const __m256 scale = _mm256_mul_ps(sub.scale, _mm256_broadcast_ss(xq.dot_scales.data() + xb));
          acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i][r]);
          if (sub.has_offset)
            off[i][r] = _mm256_fmadd_ps(sub.offset, _mm256_loadu_ps(xq.lane_sums.data() + xb * 8), off[i][r]);
        }
      }
    }
  }
#ifdef CONVEYOR_ROW_PAIRS
  for (int i = 0; i < kOut; ++i)
    for (int p = 0; p < kPairs; ++p) {
      const __m512 total = _mm512_add_ps(pair_acc[i][p], pair_off[i][p]);
      acc[i][2 * p] = low_half(total);  // = acc + off of the 256-bit path, lane for lane
      acc[i][2 * p + 1] = high_half(total);
    }
#endif
  for (int i = 0; i < valid; ++i)
    for (int r = 0; r < R; ++r) {
      const __m256 total = r < kFirstSingle ? acc[i][r] : _mm256_add_ps(acc[i][r], off[i][r]);
      y[(r0 + r) * out + o0 + i] = static_cast<T>(sum_lanes(total));
    }
}

// y [rows, out] in x's dtype: threads over groups of weight rows, each read once per call
template <int64_t kType, int R, bool kResidual, typename T>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t in, const QuantizedRows& xq, int64_t r0, int64_t out,
              T* y) {
  // 8 * 1, 4 * R or, past 4 rows (two registers a pair), 2 * R accumulators
  constexpr int kOut = R == 1 && kSubsPerBlock<kType> == 1 ? 8 : (R > 4 ? 2 : 4);
  const int64_t groups = (out + kOut - 1) / kOut;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int valid = static_cast<int>(std::min<int64_t>(kOut, out - g * kOut));
      dot_tile<kType, kOut, R, kResidual>(w, row_bytes, in / 32, xq, r0, g * kOut, valid, out, y);
    }
  });
}

template <int64_t kType, bool kResidual, typename T>
void dot_all_rows(const uint8_t* w, int64_t row_bytes, int64_t in, const QuantizedRows& xq, int64_t rows,
                  int64_t out, T* y) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, rows - r0)) {
      case 1: dot_rows<kType, 1, kResidual>(w, row_bytes, in, xq, r0, out, y); break;
      case 2: dot_rows<kType, 2, kResidual>(w, row_bytes, in, xq, r0, out, y); break;
      case 3: dot_rows<kType, 3, kResidual>(w, row_bytes, in, xq, r0, out, y); break;
#ifdef CONVEYOR_ROW_PAIRS
      case 4: dot_rows<kType, 4, kResidual>(w, row_bytes, in, xq, r0, out, y); break;
      case 5: dot_rows<kType, 5, kResidual>(w, row_bytes, in, xq, r0, out, y); break;
      default: dot_rows<kType, 6, kResidual>(w, row_bytes, in, xq, r0, out, y); break;
#else
      default: dot_rows<kType, 4, kResidual>(w, row_bytes, in, xq, r0, out, y); break;
#endif
    }
  }
}

template <int64_t kType, typename T>
void dot_type(const uint8_t* w, int64_t row_bytes, int64_t in, const QuantizedRows& xq, int64_t rows, int64_t out,
              bool residual, T* y) {
  if (residual) return dot_all_rows<kType, true>(w, row_bytes, in, xq, rows, out, y);
  dot_all_rows<kType, false>(w, row_bytes, in, xq, rows, out, y);
}

template <typename T>
void dot_all(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t in, const QuantizedRows& xq, int64_t rows,
             int64_t out, bool residual, T* y) {
  switch (type) {
    case Q4_0: return dot_type<Q4_0>(w, row_bytes, in, xq, rows, out, residual, y);
    case Q4_1: return dot_type<Q4_1>(w, row_bytes, in, xq, rows, out, residual, y);
    case Q5_0: return dot_type<Q5_0>(w, row_bytes, in, xq, rows, out, residual, y);
    case Q8_0: return dot_type<Q8_0>(w, row_bytes, in, xq, rows, out, residual, y);
    case Q4_K: return dot_type<Q4_K>(w, row_bytes, in, xq, rows, out, residual, y);
    case Q5_K: return dot_type<Q5_K>(w, row_bytes, in, xq, rows, out, residual, y);
    case Q6_K: return dot_type<Q6_K>(w, row_bytes, in, xq, rows, out, residual, y);
    default: TORCH_CHECK(false, "quant_dot: no kernel for ggml type ", type);
  }
}

void check_dot_inputs(const at::Tensor& x, const at::Tensor& weight, int64_t row_bytes, int64_t out, int64_t in) {
  check_blocks(weight, row_bytes, out, "quant_dot");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == in && in % 32 == 0,
              "quant_dot: x [rows, ", in, "], a multiple of 32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_dot: x float32 or bfloat16");
}

at::Tensor quant_dot(const at::Tensor& x, const at::Tensor& weight, int64_t type, int64_t out, int64_t in,
                     bool residual) {
  const int64_t row_bytes = row_bytes_of(type, in);
  check_dot_inputs(x, weight, row_bytes, out, in);
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0);
  const QuantizedRows& xq = quantize_rows(xc, residual);
  at::Tensor y = at::empty({rows, out}, xc.options());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    dot_all(type, w, row_bytes, in, xq, rows, out, residual, y.data_ptr<float>());
  } else {
    dot_all(type, w, row_bytes, in, xq, rows, out, residual, y.data_ptr<at::BFloat16>());
  }
  return y;
}

bool quant_dot_available() { return true; }
#else  // no AVX2: quant_matmul's float kernel serves every row count

at::Tensor quant_dot(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, bool) {
  TORCH_CHECK(false, "quant_dot: built without AVX2");
}

bool quant_dot_available() { return false; }

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("quant_dot(Tensor x, Tensor weight, int ggml_type, int out_features, int in_features, bool residual=True) -> Tensor");
  m.impl("quant_dot", c10::DispatchKey::CPU, &quant_dot);
  m.def("quant_dot_available() -> bool");
  m.impl("quant_dot_available", &quant_dot_available);
}
