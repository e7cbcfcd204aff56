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
// model's argmaxes). Lane sums are the sums of 4 represented values. Every weight type is read
// as 32 codes u per sub-block plus a scale and an offset per lane of 4 values, so that
// w = scale * u + offset (Q4_0: u in 0..15, offset -8d; Q6_K: u in 0..63, two scales per 32
// values; Q8_0: u = |q| with x's sign flipped where q < 0, offset 0). Then
//   sum(w * x) over a sub-block = scale . dx / 256 * (256 dot(u, xq) + dot(u, xr)) + offset . lanesum(x)
// with dot(u, xq) in one VNNI vpdpbusd (8 int32 lanes of 4 products; AVX2 without VNNI:
// vpmaddubsw + vpmaddwd, no saturation since u <= 128). Accumulated in 8 float lanes per row of
// x, summed once per output. Threads over output rows; the weight bytes are read once per call.
// Oracle: gguf-py's dequantize then a float matmul (tests/test_quant_kernels.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_QUANT_DOT 1
#endif

namespace {

#ifdef CONVEYOR_QUANT_DOT

// the visitors' lambdas run once per 32 weights: a call each (SubBlock through memory) cost
// Q4_0 half its time
#define CONVEYOR_INLINE __attribute__((always_inline))

enum GgmlType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
constexpr int kMaxRows = 4;  // rows of x sharing one unpacked weight sub-block

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; c10::Half's conversion is a dozen scalar ones
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// x quantized per block of 32 in two terms, x ~ d * codes + d / 256 * residual codes: the second
// term brings the activations' error near float32's (residual off: one term, as llama.cpp's Q8
// activations). The step of the second term is a power of two below the first's, so that both
// dot products sum in one integer, 256 * dot(u, codes) + dot(u, residual codes) (below 2^24:
// exact in float32). Lane sums are those of the values the codes stand for.
struct QuantizedRows {
  std::vector<int8_t> codes, residual_codes;  // [rows, in]
  std::vector<float> dot_scales;              // [rows, in / 32]: d, or d / 256 with residual
  std::vector<float> lane_sums;               // [rows, in / 32, 8]
};

// 32 values to codes in [-127, 127]; returns the scale
inline float quantize_block(const float* v, int8_t* codes) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < 32; ++i) codes[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
  return amax / 127.f;
}

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t in, bool residual) {
  const int64_t blocks = in / 32;
  QuantizedRows q{std::vector<int8_t>(rows * in), std::vector<int8_t>(residual ? rows * in : 0),
                  std::vector<float>(rows * blocks), std::vector<float>(rows * blocks * 8)};
  for (int64_t b = 0; b < rows * blocks; ++b) {
    const float* v = x + b * 32;
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

// the 32-value sub-blocks of a type: Visit(sub, index of the sub-block in the row)
template <typename Visit>
inline void q4_0_subs(const uint8_t* b, int64_t s, Visit&& visit) {
  const float d = half_at(b);
  visit(SubBlock{nibbles_low_then_high(b + 2), _mm256_set1_ps(d), _mm256_set1_ps(-8.f * d)}, s);
}

template <typename Visit>
inline void q4_1_subs(const uint8_t* b, int64_t s, Visit&& visit) {
  visit(SubBlock{nibbles_low_then_high(b + 4), _mm256_set1_ps(half_at(b)), _mm256_set1_ps(half_at(b + 2))}, s);
}

template <typename Visit>
inline void q5_0_subs(const uint8_t* b, int64_t s, Visit&& visit) {
  const float d = half_at(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const __m256i codes = _mm256_or_si256(nibbles_low_then_high(b + 6), bit_bytes(qh));
  visit(SubBlock{codes, _mm256_set1_ps(d), _mm256_set1_ps(-16.f * d)}, s);
}

template <typename Visit>
inline void q8_0_subs(const uint8_t* b, int64_t s, Visit&& visit) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  SubBlock sub{_mm256_abs_epi8(q), _mm256_set1_ps(half_at(b)), _mm256_setzero_ps()};
  sub.sign_of = q;
  sub.is_signed = true;
  sub.has_offset = false;
  visit(sub, s);
}

// Q4_K (high null) and Q5_K: 8 sub-blocks; w = d * scale_j * q - dmin * min_j
template <typename Visit>
inline void k4_k5_subs(const uint8_t* b, const uint8_t* qs, const uint8_t* high, int64_t s, Visit&& visit) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i high_bits =
      high ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)) : _mm256_setzero_si256();
  for (int pair = 0; pair < 4; ++pair) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + pair * 32));
    for (int half = 0; half < 2; ++half) {
      const int j = pair * 2 + half;
      __m256i codes = _mm256_and_si256(half ? _mm256_srli_epi16(packed, 4) : packed, mask);
      if (high) {
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(high_bits, j), _mm256_set1_epi8(1));
        codes = _mm256_or_si256(codes, _mm256_slli_epi16(bit, 4));
      }
      int scale, min;
      scale_min_k4(j, scales, &scale, &min);
      visit(SubBlock{codes, _mm256_set1_ps(d * scale), _mm256_set1_ps(-dmin * min)}, s * 8 + j);
    }
  }
}

// Q6_K: 2 halves of 128 values, 4 sub-blocks of 32 each, a signed scale per 16 values;
// w = d * scale * (q - 32), q in 0..63 from 4 low bits (ql) and 2 high bits (qh)
template <typename Visit>
inline void q6_k_subs(const uint8_t* b, int64_t s, Visit&& visit) {
  const float d = half_at(b + 208);
  const __m256i low_mask = _mm256_set1_epi8(0x0F), two_bits = _mm256_set1_epi8(3);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b + half * 64;
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + half * 32));
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + half * 8);
    for (int k = 0; k < 4; ++k) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + (k & 1) * 32));
      const __m256i low = _mm256_and_si256(k < 2 ? packed : _mm256_srli_epi16(packed, 4), low_mask);
      const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), two_bits);
      const __m256i codes = _mm256_or_si256(low, _mm256_slli_epi16(top, 4));
      const float s0 = d * sc[2 * k], s1 = d * sc[2 * k + 1];
      visit(SubBlock{codes, two_halves(s0, s1), two_halves(-32.f * s0, -32.f * s1)}, s * 8 + half * 4 + k);
    }
  }
}

template <typename Visit>
inline void visit_row(int64_t type, const uint8_t* row, int64_t in, Visit&& visit) {
  switch (type) {
    case Q4_0: for (int64_t s = 0; s < in / 32; ++s) q4_0_subs(row + s * 18, s, visit); break;
    case Q4_1: for (int64_t s = 0; s < in / 32; ++s) q4_1_subs(row + s * 20, s, visit); break;
    case Q5_0: for (int64_t s = 0; s < in / 32; ++s) q5_0_subs(row + s * 22, s, visit); break;
    case Q8_0: for (int64_t s = 0; s < in / 32; ++s) q8_0_subs(row + s * 34, s, visit); break;
    case Q4_K:
      for (int64_t s = 0; s < in / 256; ++s) k4_k5_subs(row + s * 144, row + s * 144 + 16, nullptr, s, visit);
      break;
    case Q5_K:
      for (int64_t s = 0; s < in / 256; ++s)
        k4_k5_subs(row + s * 176, row + s * 176 + 48, row + s * 176 + 16, s, visit);
      break;
    case Q6_K: for (int64_t s = 0; s < in / 256; ++s) q6_k_subs(row + s * 210, s, visit); break;
    default: TORCH_CHECK(false, "quant_dot: no kernel for ggml type ", type);
  }
}

int64_t row_bytes_of(int64_t type, int64_t in) {
  switch (type) {
    case Q4_0: return in / 32 * 18;
    case Q4_1: return in / 32 * 20;
    case Q5_0: return in / 32 * 22;
    case Q8_0: return in / 32 * 34;
    case Q4_K: return in / 256 * 144;
    case Q5_K: return in / 256 * 176;
    case Q6_K: return in / 256 * 210;
  }
  TORCH_CHECK(false, "quant_dot: no kernel for ggml type ", type);
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

// y[r * out + o] for R rows of x (starting at row r0) and one weight row o
template <int R, bool kResidual>
void dot_rows(int64_t type, const uint8_t* wrow, int64_t in, const QuantizedRows& xq, int64_t r0,
              int64_t out, int64_t o, float* y) {
  const int64_t blocks = in / 32;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  visit_row(type, wrow, in, [&](const SubBlock& sub, int64_t s) CONVEYOR_INLINE {
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (r0 + r) * blocks + s;
      __m256i dot = dot_lanes(_mm256_setzero_si256(), sub.codes, codes_for(sub, xq.codes.data() + xb * 32));
      if constexpr (kResidual)
        dot = dot_lanes(_mm256_slli_epi32(dot, 8), sub.codes, codes_for(sub, xq.residual_codes.data() + xb * 32));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sub.scale, _mm256_set1_ps(xq.dot_scales[xb])),
                               acc[r]);
      if (sub.has_offset)
        acc[r] = _mm256_fmadd_ps(sub.offset, _mm256_loadu_ps(xq.lane_sums.data() + xb * 8), acc[r]);
    }
  });
  for (int r = 0; r < R; ++r) y[(r0 + r) * out + o] = sum_lanes(acc[r]);
}

template <bool kResidual>
void dot_chunk(int64_t type, const uint8_t* wrow, int64_t in, const QuantizedRows& xq, int64_t r0,
               int64_t count, int64_t out, int64_t o, float* y) {
  switch (count) {
    case 1: return dot_rows<1, kResidual>(type, wrow, in, xq, r0, out, o, y);
    case 2: return dot_rows<2, kResidual>(type, wrow, in, xq, r0, out, o, y);
    case 3: return dot_rows<3, kResidual>(type, wrow, in, xq, r0, out, o, y);
    default: return dot_rows<4, kResidual>(type, wrow, in, xq, r0, out, o, y);
  }
}

void check_blocks(const at::Tensor& weight, int64_t row_bytes, int64_t out, const char* op) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.numel() == out * row_bytes,
              op, ": weight must be contiguous uint8 [", out, ", ", row_bytes, "]");
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
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0);
  const QuantizedRows xq = quantize_rows(xf.data_ptr<float>(), rows, in, residual);
  const auto chunk = residual ? dot_chunk<true> : dot_chunk<false>;
  at::Tensor y = at::empty({rows, out}, xf.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* w = weight.data_ptr<uint8_t>();
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows)
        chunk(type, w + o * row_bytes, in, xq, r0, std::min<int64_t>(kMaxRows, rows - r0), out, o, yp);
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

bool quant_dot_available() { return true; }

// ---- dequantize (the many-rows path: tiles of output rows for torch's matmul) ----------------

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
void dequantize_rows(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t out, int64_t in, T* y) {
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      visit_row(type, w + o * row_bytes, in,
                [&](const SubBlock& sub, int64_t s) CONVEYOR_INLINE { store_sub(sub, y + o * in + s * 32); });
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
#endif

#else  // no AVX2: quant_matmul's float kernel serves every row count

at::Tensor quant_dot(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, bool) {
  TORCH_CHECK(false, "quant_dot: built without AVX2");
}

bool quant_dot_available() { return false; }

#endif

#ifndef CONVEYOR_QUANT_DEQUANTIZE_AS  // no AVX-512: quant_matmul.cpp's float32 dequantization serves
at::Tensor quant_dequantize_as(const at::Tensor&, int64_t, int64_t, int64_t, at::ScalarType) {
  TORCH_CHECK(false, "quant_dequantize_as: built without AVX-512");
}
bool quant_dequantize_as_available() { return false; }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("quant_dot(Tensor x, Tensor weight, int ggml_type, int out_features, int in_features, bool residual=True) -> Tensor");
  m.impl("quant_dot", c10::DispatchKey::CPU, &quant_dot);
  m.def("quant_dot_available() -> bool");
  m.impl("quant_dot_available", &quant_dot_available);
  m.def("quant_dequantize_as(Tensor weight, int ggml_type, int out_features, int in_features, ScalarType dtype) -> Tensor");
  m.impl("quant_dequantize_as", c10::DispatchKey::CPU, &quant_dequantize_as);
  m.def("quant_dequantize_as_available() -> bool");
  m.impl("quant_dequantize_as_available", &quant_dequantize_as_available);
}
