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
// W is read from memory once per call. Inside a chunk, a tile of vocabulary rows (~16 KB) is
// copied once into panels of 16 vocabulary rows laid out hidden-major ([hidden][16], float32:
// bfloat16 widened here, once per tile) and stays in L1 while every group of 6 hidden rows runs
// over it: 6 rows x 16 logits in 12 vector accumulators, six broadcasts of x and two loads of the
// panel per hidden element (12 FMAs), no horizontal sums; the next tile is prefetched meanwhile. Each lane keeps the running best of its
// logits; lanes, chunks and the few leftover vocabulary rows are merged by argmax's rules.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "transpose8.h"

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

// the register block: 6 rows x 16 logits in 12 accumulators (measured on Zen 3: 4 rows ~9% slower,
// 8 rows spill)
constexpr int64_t kRows = 6, kLanes = 16;
constexpr int64_t kTileBytes = 16 * 1024;  // a tile of panels: about this many bytes (in L1)
constexpr int64_t kMinChunk = 4096;  // vocabulary rows a thread gets at least

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

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

inline v8 load8(const at::BFloat16* p) {  // bfloat16 -> float32: the bits, 16 places up
  const u16x8 bits = *reinterpret_cast<const u16x8*>(p);
  return (v8)(__builtin_convertvector(bits, i8) << 16);
}

// out[h * stride + j] = w[j][h] for 8 vocabulary rows j and 8 hidden elements h from h0.
template <typename T>
inline void transpose_8x8(const T* w, int64_t hidden_size, int64_t h0, float* out, int64_t stride) {
#if defined(__AVX__)
  __m256 r[8];
  for (int j = 0; j < 8; ++j) r[j] = (__m256)load8(w + j * hidden_size + h0);
  conveyor_transpose::transpose8(r);
  for (int h = 0; h < 8; ++h) _mm256_storeu_ps(out + h * stride, r[h]);
#else
  for (int j = 0; j < 8; ++j)
    for (int h = 0; h < 8; ++h) out[h * stride + j] = to_float(w[j * hidden_size + h0 + h]);
#endif
}

// panel[h * 16 + j] = w[j][h] for the 16 vocabulary rows at w, in float32.
template <typename T>
inline void pack_panel(const T* w, int64_t hidden_size, float* panel) {
  const int64_t whole = hidden_size / 8 * 8;
  for (int64_t h = 0; h < whole; h += 8) {
    transpose_8x8(w, hidden_size, h, panel + h * kLanes, kLanes);
    transpose_8x8(w + 8 * hidden_size, hidden_size, h, panel + h * kLanes + 8, kLanes);
  }
  for (int64_t j = 0; j < kLanes; ++j)
    for (int64_t h = whole; h < hidden_size; ++h)
      panel[h * kLanes + j] = to_float(w[j * hidden_size + h]);
}

struct Problem {
  int64_t num_rows, padded_rows, hidden_size, vocab_size;
  bool round_bf16;
};

// Running best of each (row, lane): lane j of a row has seen the logits of the vocabulary rows
// 16k + j of the chunk so far.
struct LaneBest {
  std::vector<float> value;  // [padded_rows, 16]
  std::vector<int32_t> index;  // [padded_rows, 16]
};

inline void update(float* best, int32_t* best_index, v8 logits, i8 index, bool round_bf16) {
  if (round_bf16) logits = round_to_bf16(logits);
  const v8 top = load8(best);
  const i8 top_index = *reinterpret_cast<const i8u*>(best_index);
  const i8 take = (logits > top) | ((logits != logits) & (top == top));
  store8(best, take ? logits : top);
  *reinterpret_cast<i8u*>(best_index) = take ? index : top_index;
}

// Logits of kRows rows of x ([kRows, hidden] at x) against one panel, folded into the rows'
// lane bests.
inline void rows_x_panel(const float* x, const float* panel, const Problem& p, int32_t v,
                         float* best, int32_t* best_index) {
  const int64_t n = p.hidden_size;
  v8 acc[kRows][2] = {};
  for (int64_t h = 0; h < n; ++h) {
    v8 w0 = load8(panel + h * kLanes), w1 = load8(panel + h * kLanes + 8);
    asm("" : "+x"(w0), "+x"(w1));  // two loads, not one per FMA: the loads are the bottleneck
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      const float b = x[i * n + h];
      acc[i][0] += b * w0, acc[i][1] += b * w1;
    }
  }
  const i8 low = {0, 1, 2, 3, 4, 5, 6, 7};
  const i8 first = low + v, second = low + (v + 8);
  for (int i = 0; i < kRows; ++i) {
    update(best + i * kLanes, best_index + i * kLanes, acc[i][0], first, p.round_bf16);
    update(best + i * kLanes + 8, best_index + i * kLanes + 8, acc[i][1], second, p.round_bf16);
  }
}

// The best (value, index) of each row over vocabulary [begin, end) of one chunk.
template <typename T>
void best_of_chunk(const float* x, const T* w, const Problem& p, int64_t begin, int64_t end,
                   float* out_value, int64_t* out_index) {
  const int64_t n = p.hidden_size;
  const int64_t paneled_end = begin + (end - begin) / kLanes * kLanes;
  const int64_t tile = std::max<int64_t>(kLanes, kTileBytes / (n * 4) / kLanes * kLanes);
  const float lowest = -std::numeric_limits<float>::infinity();
  LaneBest lanes{std::vector<float>(p.padded_rows * kLanes, lowest),
                 std::vector<int32_t>(p.padded_rows * kLanes)};
  for (int64_t i = 0; i < p.padded_rows * kLanes; ++i) lanes.index[i] = begin + i % kLanes;
  std::vector<float> panels(tile * n);
  for (int64_t tile_begin = begin; tile_begin < paneled_end; tile_begin += tile) {
    const int64_t num_panels = (std::min(paneled_end, tile_begin + tile) - tile_begin) / kLanes;
    for (int64_t k = 0; k < num_panels; ++k)
      pack_panel(w + (tile_begin + k * kLanes) * n, n, panels.data() + k * kLanes * n);
    // the next tile's bytes come in from memory while this one is in use, a share per row group
    const char* next = reinterpret_cast<const char*>(w + (tile_begin + tile) * n);
    const int64_t next_bytes =
        std::max<int64_t>(0, std::min(paneled_end - tile_begin - tile, tile)) * n * sizeof(T);
    const int64_t num_groups = p.padded_rows / kRows;
    const int64_t share = (next_bytes / 64 + num_groups - 1) / num_groups * 64;
    for (int64_t row = 0; row < p.padded_rows; row += kRows) {
      const int64_t from = row / kRows * share, to = std::min(next_bytes, from + share);
      for (int64_t b = from; b < to; b += 64) __builtin_prefetch(next + b);
      for (int64_t k = 0; k < num_panels; ++k)
        rows_x_panel(x + row * n, panels.data() + k * kLanes * n, p,
                     static_cast<int32_t>(tile_begin + k * kLanes), &lanes.value[row * kLanes],
                     &lanes.index[row * kLanes]);
    }
  }
  for (int64_t row = 0; row < p.num_rows; ++row) {
    float value = lowest;
    int64_t index = begin;
    if (paneled_end > begin) {
      for (int64_t lane = row * kLanes; lane < (row + 1) * kLanes; ++lane)
        if (beats(lanes.value[lane], lanes.index[lane], value, index))
          value = lanes.value[lane], index = lanes.index[lane];
    }
    for (int64_t v = paneled_end; v < end; ++v) {  // fewer than 16 leftover vocabulary rows
      float logit = 0.f;
      for (int64_t h = 0; h < n; ++h) logit += x[row * n + h] * to_float(w[v * n + h]);
      if (p.round_bf16) logit = round_to_bf16(logit);
      if (beats(logit, v, value, index)) value = logit, index = v;
    }
    out_value[row] = value;
    out_index[row] = index;
  }
}

template <typename T>
at::Tensor project(const at::Tensor& hidden, const at::Tensor& weight, bool round_bf16) {
  const int64_t num_rows = hidden.size(0), n = hidden.size(1);
  const int64_t padded_rows = (num_rows + kRows - 1) / kRows * kRows;
  const Problem p{num_rows, padded_rows, n, weight.size(0), round_bf16};
  std::vector<float> x(padded_rows * n, 0.f);  // [padded_rows, hidden] float32, zero rows after
  const T* hidden_data = hidden.data_ptr<T>();
  for (int64_t i = 0; i < num_rows * n; ++i) x[i] = to_float(hidden_data[i]);
  // one vocabulary chunk per thread, none under kMinChunk rows: small problems stay on the
  // calling thread
  const int64_t num_chunks = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), p.vocab_size / kMinChunk));
  const int64_t chunk = (p.vocab_size + num_chunks - 1) / num_chunks;
  const int64_t chunk_size = (chunk + kLanes - 1) / kLanes * kLanes;
  std::vector<float> values(num_chunks * num_rows);  // [num_chunks, num_rows]
  std::vector<int64_t> indices(num_chunks * num_rows);
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, num_chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t begin = std::min(p.vocab_size, c * chunk_size);
      const int64_t end = c + 1 == num_chunks ? p.vocab_size : std::min(p.vocab_size, begin + chunk_size);
      best_of_chunk<T>(x.data(), w, p, begin, end, &values[c * num_rows], &indices[c * num_rows]);
    }
  });
  at::Tensor out = at::empty({num_rows}, hidden.options().dtype(at::kLong));
  int64_t* out_data = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < num_rows; ++row) {
    float value = values[row];
    int64_t index = indices[row];
    for (int64_t c = 1; c < num_chunks; ++c)
      if (c * chunk_size < p.vocab_size &&
          beats(values[c * num_rows + row], indices[c * num_rows + row], value, index))
        value = values[c * num_rows + row], index = indices[c * num_rows + row];
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
