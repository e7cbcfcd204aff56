// GGUF-quantized weights times activations quantized to 16-bit integers, in integer dot
// products (the decode path: few rows; llama.cpp's method, written afresh, with int16 x).
//
// Shapes:
//   x:       [rows, in], float32 or bfloat16 (in a multiple of 32)
//   weight:  [out, row_bytes] uint8, each row in / block_size blocks of the GGUF type (as in the
//            file: ggml-common.h's block structs, little-endian, half-precision scales)
//   returns  [rows, out] in x's dtype: y = x @ dequantize(weight)^T, x rounded per group
//
// Method. Each row of x is quantized once per call, per group (a K-quant's block of 256 values;
// for the other types the most of 256, 128, 64 and 32 that divides a row): xq = round(x / dx) in
// [-32767, 32767], dx = max|x| / 32767, so x is represented to 1.5e-5 of its group's largest
// value. The weights are unpacked per sub-block of
// 32 into 16-bit integers w16 with everything integer in the type folded in: the zero point
// (Q4_0: u - 8, Q6_K: u - 32) and a K-quant's sub-block scale (Q4_K: sc_j * u; Q6_K: sc * (u - 32),
// one sc per 16 values). Then per sub-block one vpdpwssd (AVX-512 VNNI: 16 int32 lanes of 2
// products; AVX2: vpmaddwd twice) adds dot(w16, xq) into an integer accumulator, which a
// K-quant keeps over its whole super-block; at the end of a block it becomes float once:
//   sum(w * x) over a block = d * dx * sum of the integer lanes  (+ the float offsets' terms)
// The offsets that are floats (Q4_1's m, Q4_K/Q5_K's dmin * min_j) are summed apart, against
// the sums of x's represented values per sub-block. Bounds: |w16| <= 4096 (Q6_K), |xq| <= 32767,
// and a lane sums at most 16 products between conversions: below 2^31.
// Threads over bands of weight rows; every pass of kMaxRows rows of x runs over a band while
// it is in cache, so the weight bytes are read from memory once per call whatever the rows. A
// tile's rows are read side by side, each x sub-block loaded once for all of them, a chain of
// accumulators per (weight row, x row), and the next tile prefetched as this one is read. A row
// of x comes out the same whatever rows run beside it.
// Oracle: gguf-py's dequantize then a float matmul (tests/test_quant_kernels.py).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "int16_weights.h"
#include "quantized_rows.h"

namespace {

#ifdef CONVEYOR_GGUF_BLOCKS
using namespace conveyor_gguf;

// the sums of x's represented values that block b's offsets multiply, for row `row`
inline __m256 offset_sums(const QuantizedRows& xq, int64_t row, int64_t b) {
  return load8(xq.sub_sums.data() + row * xq.sums_stride + b * 8);
}

// acc + sum over blocks b of m[b] * x's sum of block b (Q4_1's offsets: one scalar a block,
// gathered per weight row while its blocks are read, then 8 blocks an FMA here); both padded
// with zeros to `stride`, a multiple of 8
inline FloatSum add_q4_1_offsets(FloatSum acc, const float* m, const float* x_sums, int64_t stride) {
  for (int64_t b = 0; b < stride; b += 8) acc = add_offsets(acc, load8(m + b), load8(x_sums + b));
  return acc;
}

// sub-blocks unpacked at once per weight row: a K-quant's as many as a lane sums before it
// converts (8 registers: AVX-512 all 8, AVX2 4); the other types' blocks have one
template <int64_t kType>
constexpr int kChunkSubs = kSubsPerBlock<kType> < kFlushSubs ? kSubsPerBlock<kType> : kFlushSubs;

constexpr int kSpareRegisters = 4;  // x's loads, a block's scales, masks
constexpr int kMaxTileOut = 8;     // the most weight rows a tile reads side by side

// weight rows a tile reads side by side: as many as the registers hold with R rows of x beside
// a chunk's unpacked weights (a float accumulator per pair)
template <int64_t kType, int R>
constexpr int tile_out() {
  constexpr int unpacked = kChunkSubs<kType> * static_cast<int>(sizeof(W16) / sizeof(IntSum));
  constexpr int fit = (kRegisters - kSpareRegisters - unpacked) / R;
  return fit >= kMaxTileOut ? kMaxTileOut : fit >= 4 ? 4 : fit < 1 ? 1 : fit;
}

// y for R rows of x (from row r0) and kOut weight rows (from o0; `valid` of them stored). A
// block lies in one group of x, whose step folds into the block's scale (summing the other types'
// blocks per group, then scaling by the step, took 9% more of Q4_0's and Q5_0's time, and a
// register per pair). Per weight row, a chunk of sub-blocks is unpacked once, then each row of x
// sums its dot products with all of them in one integer chain.
template <int64_t kType, int kOut, int R, typename T>
void dot_tile(const uint8_t* w, int64_t row_bytes, int64_t in, const QuantizedRows& xq, int64_t r0, int64_t o0,
              int valid, int64_t out, T* y, float* q4_1_m) {
  constexpr int kSubs = kSubsPerBlock<kType>, kChunk = kChunkSubs<kType>;
  const int64_t subs = in / 32, groups = in / xq.group, blocks_per_group = xq.group / (32 * kSubs);
  const uint8_t* rows[kOut];
  for (int i = 0; i < kOut; ++i) rows[i] = w + (o0 + std::min(i, valid - 1)) * row_bytes;
  FloatSum acc[kOut][R];
  for (int i = 0; i < kOut; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = float_zero();
  // kOut rows read side by side are kOut streams, which the hardware prefetcher served at half
  // the speed of one: the next group's rows (contiguous) are fetched at the pace this one is read
  const Ahead next_group{w + (o0 + kOut) * row_bytes, kOut * row_bytes};
  const bool fits_l1 = next_group.size <= 16384;
  const int64_t share = next_group.share_of(subs / kChunk);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      BlockHeader h[kOut];
      for (int i = 0; i < kOut; ++i) h[i] = header_of<kType>(rows[i] + b * kBlockBytes<kType>);
      if constexpr (kType == Q4_1)
        for (int i = 0; i < kOut; ++i) q4_1_m[i * xq.sums_stride + b] = half_at(rows[i] + b * kBlockBytes<kType> + 2);
      for (int c = 0; c < kSubs; c += kChunk) {
        const int64_t s = b * kSubs + c;  // the chunk's first sub-block in the row
        next_group.fetch_part(s / kChunk, share, fits_l1);
#pragma GCC unroll 8
        for (int i = 0; i < kOut; ++i) {
          W16 wv[kChunk];
#pragma GCC unroll 8
          for (int j = 0; j < kChunk; ++j) wv[j] = weights16<kType>(rows[i] + b * kBlockBytes<kType>, c + j, h[i]);
#pragma GCC unroll 6
          for (int r = 0; r < R; ++r) {
            const int16_t* x = xq.values.data() + (r0 + r) * in + s * 32;
            IntSum sum = int_zero();
#pragma GCC unroll 8
            for (int j = 0; j < kChunk; ++j) sum = dot_add(sum, wv[j], x + j * 32);
            acc[i][r] = convert_add(acc[i][r], sum, h[i].d * xq.steps[(r0 + r) * groups + g]);
          }
        }
      }
      if constexpr (kFloatOffset<kType> && kType != Q4_1)
        for (int i = 0; i < kOut; ++i)
          for (int r = 0; r < R; ++r) acc[i][r] = add_offsets(acc[i][r], h[i].offsets, offset_sums(xq, r0 + r, b));
    }
  }
  if constexpr (kType == Q4_1)
    for (int i = 0; i < kOut; ++i)
      for (int r = 0; r < R; ++r)
        acc[i][r] = add_q4_1_offsets(acc[i][r], q4_1_m + i * xq.sums_stride,
                                     xq.sub_sums.data() + (r0 + r) * xq.sums_stride, xq.sums_stride);
  for (int i = 0; i < valid; ++i)
    for (int r = 0; r < R; ++r) y[(r0 + r) * out + o0 + i] = static_cast<T>(total(acc[i][r]));
}

// weight rows that every pass over x's rows reads while they are still in L1/L2 (a multiple of
// every tile width: 1, 2, 3, 4, 8), so that many rows read the weights from memory once, not
// once per pass of kMaxRows
constexpr int64_t kBandRows = 24;

// one pass of R rows of x (from r0) over weight rows [begin, end), a tile of them at a time
template <int64_t kType, int R, typename T>
void dot_pass(const uint8_t* w, int64_t row_bytes, int64_t in, const QuantizedRows& xq, int64_t r0, int64_t begin,
              int64_t end, int64_t out, T* y, float* q4_1_m) {
  constexpr int kOut = tile_out<kType, R>();
  static_assert(kBandRows % kOut == 0, "a band holds whole tiles");
  for (int64_t o0 = begin; o0 < end; o0 += kOut) {
    const int valid = static_cast<int>(std::min<int64_t>(kOut, end - o0));
    dot_tile<kType, kOut, R>(w, row_bytes, in, xq, r0, o0, valid, out, y, q4_1_m);
  }
}

// every pass over one band of weight rows: kMaxRows rows of x each, the last the rest
template <int64_t kType, typename T>
void dot_band(const uint8_t* w, int64_t row_bytes, int64_t in, const QuantizedRows& xq, int64_t rows, int64_t begin,
              int64_t end, int64_t out, T* y, float* q4_1_m) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, rows - r0)) {
      case 1: dot_pass<kType, 1>(w, row_bytes, in, xq, r0, begin, end, out, y, q4_1_m); break;
      case 2: dot_pass<kType, 2>(w, row_bytes, in, xq, r0, begin, end, out, y, q4_1_m); break;
      case 3: dot_pass<kType, 3>(w, row_bytes, in, xq, r0, begin, end, out, y, q4_1_m); break;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      case 4: dot_pass<kType, 4>(w, row_bytes, in, xq, r0, begin, end, out, y, q4_1_m); break;
      case 5: dot_pass<kType, 5>(w, row_bytes, in, xq, r0, begin, end, out, y, q4_1_m); break;
      default: dot_pass<kType, 6>(w, row_bytes, in, xq, r0, begin, end, out, y, q4_1_m); break;
#else
      default: dot_pass<kType, 4>(w, row_bytes, in, xq, r0, begin, end, out, y, q4_1_m); break;
#endif
    }
  }
}

// y [rows, out] in x's dtype: threads over bands of weight rows, each read from memory once
template <int64_t kType, typename T>
void dot_type(const uint8_t* w, int64_t row_bytes, int64_t in, const T* x, int64_t rows, int64_t out, T* y) {
  const QuantizedRows& xq = quantize_rows(x, rows, in, x_group<kType>(in));
  const int64_t bands = (out + kBandRows - 1) / kBandRows;
  at::parallel_for(0, bands, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q4_1_m(kType == Q4_1 ? kMaxTileOut * xq.sums_stride : 0, 0.f);  // [kMaxTileOut, sums_stride]
    for (int64_t band = begin; band < end; ++band)
      dot_band<kType>(w, row_bytes, in, xq, rows, band * kBandRows, std::min(out, (band + 1) * kBandRows), out, y,
                      q4_1_m.data());
  });
}

template <typename T>
void dot_all(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t in, const T* x, int64_t rows, int64_t out,
             T* y) {
  with_type(type, "quant_dot", [&](auto tag) {
    dot_type<decltype(tag)::value>(w, row_bytes, in, x, rows, out, y);
  });
}

void check_dot_inputs(const at::Tensor& x, const at::Tensor& weight, int64_t row_bytes, int64_t out, int64_t in) {
  check_blocks(weight, row_bytes, out, "quant_dot");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == in && in % 32 == 0,
              "quant_dot: x [rows, ", in, "], a multiple of 32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_dot: x float32 or bfloat16");
}

at::Tensor quant_dot(const at::Tensor& x, const at::Tensor& weight, int64_t type, int64_t out, int64_t in) {
  const int64_t row_bytes = row_bytes_of(type, in);
  check_dot_inputs(x, weight, row_bytes, out, in);
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, out}, xc.options());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    dot_all(type, w, row_bytes, in, xc.data_ptr<float>(), rows, out, y.data_ptr<float>());
  } else {
    dot_all(type, w, row_bytes, in, xc.data_ptr<at::BFloat16>(), rows, out, y.data_ptr<at::BFloat16>());
  }
  return y;
}

bool quant_dot_available() { return true; }
#else  // no AVX2: quant_matmul's float kernel serves every row count

at::Tensor quant_dot(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "quant_dot: built without AVX2");
}

bool quant_dot_available() { return false; }

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("quant_dot(Tensor x, Tensor weight, int ggml_type, int out_features, int in_features) -> Tensor");
  m.impl("quant_dot", c10::DispatchKey::CPU, &quant_dot);
  m.def("quant_dot_available() -> bool");
  m.impl("quant_dot_available", &quant_dot_available);
}
