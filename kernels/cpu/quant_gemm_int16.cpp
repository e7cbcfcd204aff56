// GGUF-quantized weights times many rows of activations in 16-bit integers (AVX2): quant_dot.cpp's
// numbers (x rounded per group to int16 as quantized_rows.h rounds it, weights unpacked to int16 with
// every integer of the type folded in, int32 sums, the scales in float32) in a GEMM's layout.
//
// quant_gemm_int16(x, weight, type, out, in) -> [rows, out] in x's dtype (float32 or bfloat16)
//
// Why: quant_dot reads a weight tile once per pass of 4 rows of x, each (weight row, x row) a
// chain of its own with a horizontal sum at the end, which suits 1-4 rows. Where activations stay
// in the model's dtype (Gemma 3's default, --quantized-activations dtype) and a decode step has
// many sequences, this kernel holds a row of x a lane, 8 rows a vector, two values a lane (vpmaddwd
// adds their products into 32 bits), and broadcasts two weights of a row at a time: each thread
// unpacks kColumns weight rows into int16 once (in L1) and multiplies every row of x by them.
// A lane's sum holds one unit (32 values; Q6_K 16: |w16| <= 4064 and |xq| <= 32767 keep 8 steps of
// two products below 2^31), then converts: y += float(sum) * (d * dx), plus the float offsets
// (Q4_1's m, Q4_K/Q5_K's -dmin * min_j) times x's sum of each sub-block.
// The same integers as quant_dot; the floats add in another order (within float32's rounding).
// Oracle: tests/test_quant_kernels.py (x rounded to int16 per group, gguf-py's dequantize).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "int16_weights.h"
#include "quantized_rows.h"

namespace {

#if defined(CONVEYOR_GGUF_BLOCKS) && defined(__AVX2__)
using namespace conveyor_gguf;

constexpr int kLanes = 8;    // rows of x a vector
constexpr int kColumns = 4;  // weight rows a thread unpacks at a time
constexpr int kPair = 2;     // weight rows and row blocks a product takes (16 ymm registers)

template <int64_t kType>
constexpr int kUnit = kType == Q6_K ? 16 : 32;  // values a lane sums before it converts

// x [rows, in] in lanes: values [row blocks][in / 2][kLanes][2]; steps [row blocks][in / group]
// [kLanes]; sums (x's represented values per 32) [row blocks][in / 32][kLanes]; padding rows 0
struct LaneRows {
  std::vector<int16_t> values;
  std::vector<float> steps, sums;
  int64_t blocks = 0, group = 0;
};

template <typename T>
void to_lanes(const T* x, int64_t rows, int64_t in, int64_t group, LaneRows& lanes) {
  const QuantizedRows& q = quantize_rows(x, rows, in, group);
  const int64_t groups = in / group, subs = in / 32;
  lanes.blocks = (rows + kLanes - 1) / kLanes;
  lanes.group = group;
  lanes.values.assign(lanes.blocks * in * kLanes, 0);
  lanes.steps.assign(lanes.blocks * groups * kLanes, 0.f);
  lanes.sums.assign(lanes.blocks * subs * kLanes, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t block = r / kLanes, lane = r % kLanes;
    int16_t* values = lanes.values.data() + block * in * kLanes + lane * 2;
    for (int64_t k = 0; k < in; k += 2) std::memcpy(values + k * kLanes, q.values.data() + r * in + k, 4);
    for (int64_t g = 0; g < groups; ++g) lanes.steps[(block * groups + g) * kLanes + lane] = q.steps[r * groups + g];
    for (int64_t s = 0; s < subs; ++s)
      lanes.sums[(block * subs + s) * kLanes + lane] = q.sub_sums[r * q.sums_stride + s];
  }
}

// a thread's unpacked weight rows: codes [kColumns][in]; d per block; float offsets per 32 values
struct Tile {
  std::vector<int16_t> codes;
  std::vector<float> scales, offsets;
};

inline void store_w16(int16_t* dst, const W16& w) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  _mm512_storeu_si512(dst, w.v);
#else
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), w.low);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), w.high);
#endif
}

template <int64_t kType>
void unpack_row(const uint8_t* row, int64_t in, int64_t o, Tile& tile) {
  constexpr int kSubs = kSubsPerBlock<kType>;
  const int64_t blocks = in / (32 * kSubs), subs = in / 32;
  int16_t* codes = tile.codes.data() + o * in;
  float *scales = tile.scales.data() + o * blocks, *offsets = tile.offsets.data() + o * subs;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * kBlockBytes<kType>;
    const BlockHeader h = header_of<kType>(block);
    scales[b] = h.d;
    if constexpr (kType == Q4_1) offsets[b] = half_at(block + 2);
    if constexpr (kType == Q4_K || kType == Q5_K) _mm256_storeu_ps(offsets + b * 8, h.offsets);
    for (int j = 0; j < kSubs; ++j) store_w16(codes + (b * kSubs + j) * 32, weights16<kType>(block, j, h));
  }
}

// out[rb][j][lane]: row (b0 + rb) * kLanes + lane of x . the tile's weight row j0 + j
template <int64_t kType, int RB>
void block_product(const LaneRows& x, int64_t b0, const Tile& tile, int64_t j0, int64_t in,
                   float out[RB][kPair][kLanes]) {
  constexpr int kBlockValues = 32 * kSubsPerBlock<kType>;
  const int64_t groups = in / x.group, subs = in / 32, blocks = in / kBlockValues;
  __m256 y[RB][kPair];
  for (int rb = 0; rb < RB; ++rb)
    for (int j = 0; j < kPair; ++j) y[rb][j] = _mm256_setzero_ps();
  for (int64_t u0 = 0; u0 < in; u0 += kUnit<kType>) {
    __m256i sums[RB][kPair];
    for (int rb = 0; rb < RB; ++rb)
      for (int j = 0; j < kPair; ++j) sums[rb][j] = _mm256_setzero_si256();
    const int16_t* xs = x.values.data() + (b0 * in + u0) * kLanes;
    const int16_t* ws = tile.codes.data() + j0 * in + u0;
#pragma GCC unroll 16
    for (int k = 0; k < kUnit<kType>; k += 2) {
      __m256i xv[RB];
      for (int rb = 0; rb < RB; ++rb) {
        xv[rb] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + (rb * in + k) * kLanes));
        asm("" : "+x"(xv[rb]));  // loaded once for both weight rows, not folded into each vpmaddwd
      }
      for (int j = 0; j < kPair; ++j) {
        int32_t two;
        std::memcpy(&two, ws + j * in + k, 4);
        const __m256i wv = _mm256_set1_epi32(two);
        for (int rb = 0; rb < RB; ++rb) sums[rb][j] = _mm256_add_epi32(sums[rb][j], _mm256_madd_epi16(wv, xv[rb]));
      }
    }
    const int64_t g = u0 / x.group, b = u0 / kBlockValues;
    for (int rb = 0; rb < RB; ++rb) {
      const __m256 step = _mm256_loadu_ps(x.steps.data() + ((b0 + rb) * groups + g) * kLanes);
      for (int j = 0; j < kPair; ++j) {
        const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(tile.scales[(j0 + j) * blocks + b]), step);
        y[rb][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[rb][j]), scale, y[rb][j]);
      }
    }
    if constexpr (kFloatOffset<kType>) {  // their units are whole sub-blocks of 32
      const int64_t s = u0 / 32;
      for (int rb = 0; rb < RB; ++rb) {
        const __m256 x_sums = _mm256_loadu_ps(x.sums.data() + ((b0 + rb) * subs + s) * kLanes);
        for (int j = 0; j < kPair; ++j)
          y[rb][j] = _mm256_fmadd_ps(_mm256_set1_ps(tile.offsets[(j0 + j) * subs + s]), x_sums, y[rb][j]);
      }
    }
  }
  for (int rb = 0; rb < RB; ++rb)
    for (int j = 0; j < kPair; ++j) _mm256_storeu_ps(out[rb][j], y[rb][j]);
}

// y[rows, out] for RB row blocks from b0 times the tile's `count` weight rows (from o0)
template <int64_t kType, int RB, typename T>
void store_blocks(const LaneRows& x, int64_t b0, const Tile& tile, int64_t count, int64_t in, int64_t rows, T* y,
                  int64_t out, int64_t o0) {
  for (int64_t j0 = 0; j0 < count; j0 += kPair) {
    float results[RB][kPair][kLanes];
    block_product<kType, RB>(x, b0, tile, j0, in, results);
    const int64_t columns = std::min<int64_t>(kPair, count - j0);
    for (int rb = 0; rb < RB; ++rb)
      for (int lane = 0; lane < kLanes; ++lane) {
        const int64_t r = (b0 + rb) * kLanes + lane;
        if (r >= rows) break;
        for (int j = 0; j < columns; ++j) y[r * out + o0 + j0 + j] = static_cast<T>(results[rb][j][lane]);
      }
  }
}

// the worker's tile, kept between calls (through a reference taken once: see quant_gemm_int8.cpp)
__attribute__((noinline)) Tile& worker_tile() {
  thread_local Tile tile;
  return tile;
}

template <int64_t kType, typename T>
void gemm(const T* xp, int64_t rows, const uint8_t* w, int64_t out, int64_t in, T* yp) {
  const int64_t row_bytes = row_bytes_of(kType, in), blocks = in / (32 * kSubsPerBlock<kType>), subs = in / 32;
  thread_local LaneRows callers;  // the workers read the caller's
  LaneRows& x = callers;
  to_lanes(xp, rows, in, x_group<kType>(in), x);
  at::parallel_for(0, (out + kColumns - 1) / kColumns, 1, [&](int64_t begin, int64_t end) {
    Tile& tile = worker_tile();
    tile.codes.resize(kColumns * in);
    tile.scales.resize(kColumns * blocks);
    tile.offsets.resize(kColumns * subs);
    for (int64_t step = begin; step < end; ++step) {
      const int64_t o0 = step * kColumns, count = std::min<int64_t>(kColumns, out - o0);
      for (int64_t o = 0; o < count; ++o) unpack_row<kType>(w + (o0 + o) * row_bytes, in, o, tile);
      int64_t b = 0;
      for (; b + kPair <= x.blocks; b += kPair) store_blocks<kType, kPair>(x, b, tile, count, in, rows, yp, out, o0);
      if (b < x.blocks) store_blocks<kType, 1>(x, b, tile, count, in, rows, yp, out, o0);
    }
  });
}

template <typename T>
void gemm_of_type(int64_t type, const T* x, int64_t rows, const uint8_t* w, int64_t out, int64_t in, T* y) {
  with_type(type, "quant_gemm_int16", [&](auto tag) { gemm<decltype(tag)::value>(x, rows, w, out, in, y); });
}

at::Tensor quant_gemm_int16(const at::Tensor& x, const at::Tensor& weight, int64_t type, int64_t out, int64_t in) {
  check_blocks(weight, row_bytes_of(type, in), out, "quant_gemm_int16");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == in && in % 32 == 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_gemm_int16: x float32 or bfloat16 [rows, ", in, "], a multiple of 32");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), out}, xc.options());
  if (x.size(0) == 0 || out == 0) return y;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    gemm_of_type(type, xc.data_ptr<float>(), x.size(0), w, out, in, y.data_ptr<float>());
  } else {
    gemm_of_type(type, xc.data_ptr<at::BFloat16>(), x.size(0), w, out, in, y.data_ptr<at::BFloat16>());
  }
  return y;
}

bool quant_gemm_int16_available() { return true; }
#else
at::Tensor quant_gemm_int16(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "quant_gemm_int16: built without AVX2");
}
bool quant_gemm_int16_available() { return false; }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("quant_gemm_int16(Tensor x, Tensor weight, int ggml_type, int out_features, int in_features) -> Tensor");
  m.impl("quant_gemm_int16", c10::DispatchKey::CPU, &quant_gemm_int16);
  m.def("quant_gemm_int16_available() -> bool");
  m.impl("quant_gemm_int16_available", &quant_gemm_int16_available);
}
