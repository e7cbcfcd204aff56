// Greedy vocabulary projection on CPU: for each row of hidden states, the index of its largest
// logit hidden . W[v] over the vocabulary, without writing the [rows, vocab] logits to memory.
// kernels/reference.py's greedy_projection (torch argmax of F.linear) is the oracle
// (tests/test_greedy_projection.py).
//
// Shapes:
//   hidden:  [num_rows, hidden_size], float32 or bfloat16
//   weight:  [vocab_size, hidden_size], row-major, hidden's dtype (the lm_head / tied embedding)
//   returns  [num_rows] int64
//
// Meaning, as torch.argmax over the logits in the model's dtype: ties go to the first index, a
// NaN is the maximum (the first NaN wins); bfloat16 logits are rounded to bfloat16 (as F.linear
// returns them) before they are compared. Each logit is one float32 dot product whose sum order
// does not depend on the number of threads.
//
// Blocking: the vocabulary is split into one contiguous chunk per thread (at::parallel_for), so
// W is read from memory once per call. Inside a chunk, a tile of vocabulary rows (~16 KB) stays
// in L1 while every pair of hidden rows runs over it: 2 rows x 4 vocabulary rows of dot products
// at once, vectorised along hidden (8 float32 lanes: AVX2 under -march=native), the 8 sums
// reduced into one vector at once and compared lane-wise with the running best of each lane.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // any float address
typedef int32_t i8 __attribute__((vector_size(32)));
typedef int32_t i8u __attribute__((vector_size(32), aligned(4)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));

constexpr int64_t kRows = 2, kVocab = 4;  // the register block: 8 accumulators
constexpr int64_t kTileBytes = 16 * 1024;  // vocabulary rows of a tile: about this many bytes
constexpr int64_t kMinChunk = 4096;  // vocabulary rows a thread gets at least

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }

inline v8 load8(const at::BFloat16* p) {  // bfloat16 -> float32: the bits, 16 places up
  const u16x8 bits = *reinterpret_cast<const u16x8*>(p);
  return (v8)(__builtin_convertvector(bits, i8) << 16);
}

// The last n < 8 elements of a row, zeros after them (never reads past the row).
template <typename T>
inline v8 load_tail(const T* p, int64_t n) {
  T buffer[8] = {};
  std::memcpy(buffer, p, n * sizeof(T));
  return load8(buffer);
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// [sum(a0), sum(a1), ..., sum(a7)]: eight horizontal sums in one vector.
inline v8 sum8(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5, v8 a6, v8 a7) {
#if defined(__AVX__)
  const __m256 t0 = _mm256_hadd_ps((__m256)a0, (__m256)a1);  // a0 01 23, a1 01 23 | 45 67
  const __m256 t1 = _mm256_hadd_ps((__m256)a2, (__m256)a3);
  const __m256 t2 = _mm256_hadd_ps((__m256)a4, (__m256)a5);
  const __m256 t3 = _mm256_hadd_ps((__m256)a6, (__m256)a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // a0..a3 over lanes 0-3 | over lanes 4-7
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  const __m256 low = _mm256_permute2f128_ps(u0, u1, 0x20);
  const __m256 high = _mm256_permute2f128_ps(u0, u1, 0x31);
  return (v8)_mm256_add_ps(low, high);
#else
  const v8* all[8] = {&a0, &a1, &a2, &a3, &a4, &a5, &a6, &a7};
  v8 out;
  for (int i = 0; i < 8; ++i) {
    float total = 0.f;
    for (int lane = 0; lane < 8; ++lane) total += (*all[i])[lane];
    out[i] = total;
  }
  return out;
#endif
}

// Round to the nearest bfloat16, ties to even, as at::BFloat16(float) does; NaN stays NaN.
inline v8 round_to_bf16(v8 x) {
  const u8 bits = (u8)x;
  const u8 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return (x != x) ? x : (v8)rounded;
}

inline float round_to_bf16(float x) {
  return std::isnan(x) ? x : static_cast<float>(at::BFloat16(x));
}

// Does (value, index) beat (best, best_index) under argmax's rules?
inline bool beats(float value, int64_t index, float best, int64_t best_index) {
  const bool value_nan = std::isnan(value), best_nan = std::isnan(best);
  if (value_nan || best_nan) return value_nan && (!best_nan || index < best_index);
  return value > best || (value == best && index < best_index);
}

// Dot products of 2 rows of x (float32, zero-padded to a multiple of 8) with 4 rows of w:
// lanes [x0.w0, x0.w1, x0.w2, x0.w3, x1.w0, x1.w1, x1.w2, x1.w3].
template <typename T>
inline v8 dots_2x4(const float* x0, const float* x1, const T* w, int64_t hidden_size) {
  const T *w0 = w, *w1 = w + hidden_size, *w2 = w + 2 * hidden_size, *w3 = w + 3 * hidden_size;
  v8 a00 = {}, a01 = {}, a02 = {}, a03 = {}, a10 = {}, a11 = {}, a12 = {}, a13 = {};
  const int64_t whole = hidden_size / 8 * 8;
  for (int64_t h = 0; h < whole; h += 8) {
    const v8 p = load8(x0 + h), q = load8(x1 + h);
    const v8 b0 = load8(w0 + h), b1 = load8(w1 + h), b2 = load8(w2 + h), b3 = load8(w3 + h);
    a00 += p * b0, a01 += p * b1, a02 += p * b2, a03 += p * b3;
    a10 += q * b0, a11 += q * b1, a12 += q * b2, a13 += q * b3;
  }
  if (whole < hidden_size) {
    const int64_t n = hidden_size - whole;
    const v8 p = load8(x0 + whole), q = load8(x1 + whole);
    const v8 b0 = load_tail(w0 + whole, n), b1 = load_tail(w1 + whole, n);
    const v8 b2 = load_tail(w2 + whole, n), b3 = load_tail(w3 + whole, n);
    a00 += p * b0, a01 += p * b1, a02 += p * b2, a03 += p * b3;
    a10 += q * b0, a11 += q * b1, a12 += q * b2, a13 += q * b3;
  }
  return sum8(a00, a01, a02, a03, a10, a11, a12, a13);
}

struct Problem {
  int64_t num_rows, num_pairs, hidden_size, padded_size, vocab_size;
  bool round_bf16;
};

// The best (value, index) of each row over vocabulary [begin, end) of one chunk.
struct Best {
  std::vector<float> value;
  std::vector<int64_t> index;
};

// Lane-wise running maxima of each row pair over the whole-group part of a chunk, then the
// leftover vocabulary rows one by one.
template <typename T>
void best_of_chunk(const float* x, const T* w, const Problem& p, int64_t begin, int64_t end,
                   Best& best) {
  const int64_t grouped_end = begin + (end - begin) / kVocab * kVocab;
  const int64_t tile = std::max<int64_t>(
      kVocab, kTileBytes / (p.hidden_size * (int64_t)sizeof(T)) / kVocab * kVocab);
  const float lowest = -std::numeric_limits<float>::infinity();
  std::vector<float> lane_best(p.num_pairs * 8, lowest);
  std::vector<int32_t> lane_index(p.num_pairs * 8);
  for (int64_t i = 0; i < p.num_pairs * 8; ++i) lane_index[i] = begin + i % kVocab;
  const i8 lane_offset = {0, 1, 2, 3, 0, 1, 2, 3};
  for (int64_t tile_begin = begin; tile_begin < grouped_end; tile_begin += tile) {
    const int64_t tile_end = std::min(grouped_end, tile_begin + tile);
    for (int64_t pair = 0; pair < p.num_pairs; ++pair) {
      const float* x0 = x + 2 * pair * p.padded_size;
      v8 top = *reinterpret_cast<const v8u*>(&lane_best[pair * 8]);
      i8 top_index = *reinterpret_cast<const i8u*>(&lane_index[pair * 8]);
      for (int64_t v = tile_begin; v < tile_end; v += kVocab) {
        v8 logits = dots_2x4(x0, x0 + p.padded_size, w + v * p.hidden_size, p.hidden_size);
        if (p.round_bf16) logits = round_to_bf16(logits);
        const i8 take = (logits > top) | ((logits != logits) & (top == top));
        top = take ? logits : top;
        top_index = take ? (lane_offset + (int32_t)v) : top_index;
      }
      *reinterpret_cast<v8u*>(&lane_best[pair * 8]) = top;
      *reinterpret_cast<i8u*>(&lane_index[pair * 8]) = top_index;
    }
  }
  for (int64_t row = 0; row < p.num_rows; ++row) {
    float value = lowest;
    int64_t index = begin;
    const int64_t first_lane = (row / 2) * 8 + (row % 2) * kVocab;
    if (grouped_end > begin) {
      for (int64_t lane = first_lane; lane < first_lane + kVocab; ++lane)
        if (beats(lane_best[lane], lane_index[lane], value, index))
          value = lane_best[lane], index = lane_index[lane];
    }
    const float* xr = x + row * p.padded_size;
    for (int64_t v = grouped_end; v < end; ++v) {
      float logit = 0.f;
      for (int64_t h = 0; h < p.hidden_size; ++h) logit += xr[h] * to_float(w[v * p.hidden_size + h]);
      if (p.round_bf16) logit = round_to_bf16(logit);
      if (beats(logit, v, value, index)) value = logit, index = v;
    }
    best.value[row] = value;
    best.index[row] = index;
  }
}

template <typename T>
at::Tensor project(const at::Tensor& hidden, const at::Tensor& weight, bool round_bf16) {
  const int64_t num_rows = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t padded_size = (hidden_size + 7) / 8 * 8, num_pairs = (num_rows + 1) / 2;
  const Problem p{num_rows, num_pairs, hidden_size, padded_size, weight.size(0), round_bf16};
  // x: [2 * num_pairs, padded_size] float32, zeros past each row and in a spare odd row
  std::vector<float> x(2 * num_pairs * padded_size, 0.f);
  const T* h_data = hidden.data_ptr<T>();
  for (int64_t r = 0; r < num_rows; ++r)
    for (int64_t h = 0; h < hidden_size; ++h)
      x[r * padded_size + h] = to_float(h_data[r * hidden_size + h]);
  // one vocabulary chunk per thread, none under kMinChunk rows: small problems stay on the
  // calling thread
  const int64_t num_chunks = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), p.vocab_size / kMinChunk));
  const int64_t chunk = (p.vocab_size + num_chunks - 1) / num_chunks;
  const int64_t chunk_size = (chunk + kVocab - 1) / kVocab * kVocab;
  std::vector<Best> bests(num_chunks, Best{std::vector<float>(num_rows), std::vector<int64_t>(num_rows)});
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, num_chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t begin = std::min(p.vocab_size, c * chunk_size);
      const int64_t end = c + 1 == num_chunks ? p.vocab_size : std::min(p.vocab_size, begin + chunk_size);
      if (begin < end) best_of_chunk<T>(x.data(), w, p, begin, end, bests[c]);
    }
  });
  at::Tensor out = at::empty({num_rows}, hidden.options().dtype(at::kLong));
  int64_t* out_data = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < num_rows; ++row) {
    float value = bests[0].value[row];
    int64_t index = bests[0].index[row];
    for (int64_t c = 1; c < num_chunks; ++c)
      if (c * chunk_size < p.vocab_size && beats(bests[c].value[row], bests[c].index[row], value, index))
        value = bests[c].value[row], index = bests[c].index[row];
    out_data[row] = index;
  }
  return out;
}

at::Tensor greedy_projection(const at::Tensor& hidden, const at::Tensor& weight) {
  TORCH_CHECK(hidden.device().is_cpu() && weight.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2, "hidden [rows, hidden], weight [vocab, hidden]");
  TORCH_CHECK(hidden.size(1) == weight.size(1), "hidden sizes differ: ", hidden.size(1), " vs ",
              weight.size(1));
  TORCH_CHECK(weight.size(0) > 0 && weight.size(0) < (int64_t(1) << 31),
              "vocab size must be in [1, 2^31)");
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "hidden and weight must share a dtype");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous (row-major)");
  const at::Tensor rows = hidden.contiguous();
  if (hidden.scalar_type() == at::kFloat) return project<float>(rows, weight, false);
  if (hidden.scalar_type() == at::kBFloat16) return project<at::BFloat16>(rows, weight, true);
  TORCH_CHECK(false, "greedy_projection: float32 or bfloat16 expected, got ", hidden.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("greedy_projection(Tensor hidden, Tensor weight) -> Tensor");
  m.impl("greedy_projection", c10::DispatchKey::CPU, &greedy_projection);
}
