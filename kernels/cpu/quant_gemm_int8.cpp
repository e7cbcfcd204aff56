// GGUF-quantized weights times many rows of activations in 8-bit integers (AVX-512 VNNI, AVX2).
//
// quant_gemm_int8(x, weight, type, out, in) -> [rows, out] in x's dtype (float32 or bfloat16):
//   y = x8 @ dequantize(weight)^T, x8 = x rounded to 8 bits per 32 values of a row (llama.cpp's
//   Q8_0): step = max|x| / 127 (against Q8_0 on AVX2: 63 per 16 values, int8_lanes.h's
//   kNarrowX). Steps over 256 values (llama.cpp's Q8_K for K-quants, and ours for every type at
//   first) doubled SmolLM2's and Gemma 3's perplexity changes (0.6%, 1.35%).
//   Integer sums per sub-block are exact; the scales apply in float32.
// Why: vpdpbusd does 64 products a cycle where vdpbf16ps does 32 (one zmm each a cycle on the
// AMD EPYC of docs/benchmarks.md): quant_gemm.cpp's bfloat16 tiles ran at 80-95% of their peak.
// On AVX2, vpmaddubsw does 32 where an FMA does 8, and weights need no widening to 16 bits.
// x is quantized once a call, a row a lane of a vector (int8_lanes.h: 16 rows with AVX-512, or 8
// in ymm lanes where a call has 8 rows or fewer, a verify step or a small batch: 1.3-1.45x; 8
// with AVX2), so that 4 codes of a weight row are one broadcast and no weights are transposed.
// Each thread takes a run of weight rows, kColumns at a time: unpacked to their codes (in L1),
// then multiplied by every row of x, kRowBlocks row blocks a step (AVX-512: 6 weight rows and 2
// row blocks, 12 chains of vpdpbusd, enough to hide its latency; 4 rows: half the rate; AVX2: 2
// row blocks, 2 of the tile's 4 weight rows at a time).
// Oracle: tests/test_quant_kernels.py (x rounded as here, gguf-py's dequantize, float64).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "int8_lanes.h"

namespace {

#ifdef CONVEYOR_INT8_LANES
using namespace conveyor_int8;

// x [rows, in] as signed 8-bit codes (int8_lanes.h's round_row), a row a lane:
// codes: [rows / kLanes (rounded up)][in / 4][kLanes rows][4 values], padding rows 0;
// steps: [row blocks][in / kXGroup][kLanes];
// starts: [row blocks][in / sub][kLanes] int32, -zero_point * sum(q) over each sub-block: where a
// sub-block's integer sum starts; sums: the same, step * sum(q), the sum of the values x8 holds
// (for the float offsets)
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> steps, sums;
  std::vector<int32_t> starts;
  int64_t blocks = 0;
};

template <typename L, int64_t kType, typename T>
void quantize_row(const T* x, int64_t r, int64_t in, QuantizedRows& q) {
  constexpr int kLanes = L::kLanes;
  const int64_t block = r / kLanes, lane = r % kLanes, groups = in / kXGroup<kType>, subs = in / kSubValues<kType>;
  int8_t* codes = q.codes.data() + block * in * kLanes + lane * 4;
  round_row<kType>(
      x, in,
      [&](int64_t at, const int8_t* part) {
        for (int i = 0; i < kRoundValues / 4; ++i) std::memcpy(codes + (at + 4 * i) * kLanes, part + 4 * i, 4);
      },
      [&](int64_t sub, int64_t group, float step, int32_t sum) {
        const int64_t at = (block * subs + sub) * kLanes + lane;
        q.sums[at] = sub_sum(step, sum);
        q.starts[at] = -kZeroPoint<kType> * sum;
        q.steps[(block * groups + group) * kLanes + lane] = step;
      });
}

template <typename L, int64_t kType, typename T>
void quantize_rows(const T* x, int64_t rows, int64_t in, QuantizedRows& q) {
  constexpr int kLanes = L::kLanes;
  const int64_t subs = in / kSubValues<kType>;
  q.blocks = (rows + kLanes - 1) / kLanes;
  q.codes.assign(q.blocks * in * kLanes, 0);
  q.steps.assign(q.blocks * (in / kXGroup<kType>) * kLanes, 0.f);
  q.sums.assign(q.blocks * subs * kLanes, 0.f);
  q.starts.assign(q.blocks * subs * kLanes, 0);
  at::parallel_for(0, rows, kLanes, [&](int64_t begin, int64_t end) {  // a block's rows share lines
    for (int64_t r = begin; r < end; ++r) quantize_row<L, kType>(x + r * in, r, in, q);
  });
}

// a thread's unpacked weight rows: codes [kColumns][in] uint8; scale and offset per sub-block
struct Tile {
  std::vector<uint8_t> codes;
  std::vector<float> scales, offsets;
};

// w's lanes: 4 values each; Q6_K's two scales sit in lanes 0 and 4
inline float lane_of(__m256 v, int half) {
  return half ? _mm_cvtss_f32(_mm256_extractf128_ps(v, 1)) : _mm256_cvtss_f32(v);
}

// A K-quant's super-block at once, with vector arithmetic for its 8 (Q6_K: 16) scales: sub-block
// by sub-block (a SubBlock each, its scale taken back out of a vector) took the Q4_K step 44% of
// the time of its multiplies. codes: its 256 codes; scales, offsets: its sub-blocks'.
// Q4_K (kHigh false) and Q5_K, whose fifth bits of sub-block j are bit j of the 32 bytes of qh:
template <bool kHigh>
inline void unpack_k4_k5(const uint8_t* b, uint8_t* codes, float* scales, float* offsets) {
  uint32_t scale_words[2], min_words[2];
  k4_scales_mins(b, scale_words, min_words);
  _mm256_storeu_ps(scales, _mm256_mul_ps(floats8(scale_words), _mm256_set1_ps(half_at(b))));
  _mm256_storeu_ps(offsets, _mm256_mul_ps(floats8(min_words), _mm256_set1_ps(-half_at(b + 2))));
  const uint8_t* qs = b + (kHigh ? 48 : 16);
  const __m256i mask = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const __m256i high = kHigh ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {  // sub-blocks 2p and 2p + 1 share 32 bytes of nibbles
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (j / 2) * 32));
    __m256i values = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(packed, 4) : packed, mask);
    if constexpr (kHigh)
      values = _mm256_or_si256(values, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, j), one), 4));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + j * 32), values);
  }
}

inline void unpack_q6_k(const uint8_t* b, uint8_t* codes, float* scales) {
  const __m128i signed_scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  const __m256 d = _mm256_set1_ps(half_at(b + 208));
  _mm256_storeu_ps(scales, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(signed_scales)), d));
  _mm256_storeu_ps(scales + 8,
                   _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(signed_scales, 8))), d));
  for (int j = 0; j < 8; ++j)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + j * 32), q6_k_codes(b, j));
}

template <int64_t kType>
void unpack_row(const uint8_t* wrow, int64_t in, int64_t o, Tile& tile) {
  constexpr int kSubs = 32 / kSubValues<kType>;  // scales in a 32-value sub-block
  const int64_t subs = in / kSubValues<kType>;
  uint8_t* codes = tile.codes.data() + o * in;
  float *scales = tile.scales.data() + o * subs, *offsets = tile.offsets.data() + o * subs;
  if constexpr (kType == Q4_K || kType == Q5_K) {
    for (int64_t s = 0; s < in / 256; ++s)
      unpack_k4_k5<kType == Q5_K>(wrow + s * kBlockBytes<kType>, codes + s * 256, scales + s * 8, offsets + s * 8);
    return;
  }
  if constexpr (kType == Q6_K) {
    for (int64_t s = 0; s < in / 256; ++s) unpack_q6_k(wrow + s * kQ6kBytes, codes + s * 256, scales + s * 16);
    return;
  }
  visit_row(kType, wrow, in, [&](const SubBlock& sub, int64_t s) CONVEYOR_INLINE {
    __m256i values = sub.codes;
    if constexpr (kType == Q8_0)
      values = _mm256_xor_si256(sub.sign_of, _mm256_set1_epi8(-128));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + s * 32), values);
    for (int h = 0; h < kSubs; ++h) {
      scales[s * kSubs + h] = lane_of(sub.scale, h);
      if constexpr (kFloatOffset<kType>) offsets[s * kSubs + h] = lane_of(sub.offset, h);
    }
  });
}

// out[rb][j][lane] = row (b0 + rb) * kLanes + lane of x . the tile's weight row j0 + j, for RB row
// blocks and kColumns weight rows. Registers (AVX-512): 12 integer chains and 12 float sums (RB 2);
// the group of x's steps and the sub-block are compile-time (a division by a run-time group was two
// idivs a sub-block), and each sub-block adds straight into the float sums (a second set of 12
// partial sums spilled)
template <typename L, int64_t kType, int RB, int kColumns, typename T>
void block_product(const QuantizedRows& x, int64_t b0, const Tile& tile, int64_t j0, int64_t in, const Ahead& ahead,
                   T out[RB][kColumns][L::kLanes]) {
  using Ints = typename L::Ints;
  using Floats = typename L::Floats;
  constexpr int kLanes = L::kLanes;
  constexpr int kSub = kSubValues<kType>, kSubsPerGroup = kXGroup<kType> / kSub, kChunk = 4 * kChunkSteps<kType>;
  const int64_t subs = in / kSub, groups = in / kXGroup<kType>;
  Floats y[RB][kColumns];
  for (int rb = 0; rb < RB; ++rb)
    for (int j = 0; j < kColumns; ++j) y[rb][j] = L::zero_floats();
  const uint8_t* w = tile.codes.data() + j0 * in;
  const float *w_scales = tile.scales.data() + j0 * subs, *w_offsets = tile.offsets.data() + j0 * subs;
  const int64_t share = ahead.size ? ahead.share_of(subs) : 0;
  for (int64_t s = 0; s < subs; ++s) {
    if (share) ahead.fetch_part(s, share, true);
    Ints sums[RB][kColumns];
    for (int rb = 0; rb < RB; ++rb) {
      const Ints start = L::load_ints(x.starts.data() + ((b0 + rb) * subs + s) * kLanes);
      for (int j = 0; j < kColumns; ++j) sums[rb][j] = start;
    }
    const int8_t* xs = x.codes.data() + (b0 * in + s * kSub) * kLanes;
    const uint8_t* ws = w + s * kSub;
#pragma GCC unroll 8
    for (int c = 0; c < kSub; c += kChunk) {
      Ints chunk[RB][kColumns];
      for (int rb = 0; rb < RB; ++rb)
        for (int j = 0; j < kColumns; ++j) chunk[rb][j] = L::chunk_start(sums[rb][j]);
#pragma GCC unroll 8
      for (int k = c; k < c + kChunk; k += 4) {
        Ints xv[RB];
        for (int rb = 0; rb < RB; ++rb) xv[rb] = L::in_register(L::load_ints(xs + (rb * in + k) * kLanes));
        for (int j = 0; j < kColumns; ++j) {
          const Ints wv = L::broadcast4(ws + j * in + k);
          for (int rb = 0; rb < RB; ++rb) chunk[rb][j] = L::dot_step(chunk[rb][j], wv, xv[rb]);
        }
      }
      for (int rb = 0; rb < RB; ++rb)
        for (int j = 0; j < kColumns; ++j) sums[rb][j] = L::chunk_end(sums[rb][j], chunk[rb][j]);
    }
    const int64_t g = s / kSubsPerGroup;
    for (int rb = 0; rb < RB; ++rb) {
      const Floats step = L::load_floats(x.steps.data() + ((b0 + rb) * groups + g) * kLanes);
      for (int j = 0; j < kColumns; ++j)
        y[rb][j] = L::fmadd(L::mul(L::floats_of(sums[rb][j]), step), L::splat(w_scales[j * subs + s]), y[rb][j]);
    }
    if constexpr (kFloatOffset<kType>) {
      for (int rb = 0; rb < RB; ++rb) {
        const Floats offsets = L::load_floats(x.sums.data() + ((b0 + rb) * subs + s) * kLanes);
        for (int j = 0; j < kColumns; ++j) y[rb][j] = L::fmadd(offsets, L::splat(w_offsets[j * subs + s]), y[rb][j]);
      }
    }
  }
  for (int rb = 0; rb < RB; ++rb)
    for (int j = 0; j < kColumns; ++j) L::store_lanes(y[rb][j], out[rb][j]);
}

// y[rows, out] of the tile's `count` weight rows, from o0: kColumns of them a product (with 2 row
// blocks L::kPairColumns)
template <typename L, int64_t kType, int RB, typename T>
void store_blocks(const QuantizedRows& x, int64_t b0, const Tile& tile, const Ahead& ahead, int64_t count, int64_t in,
                  int64_t rows, T* y, int64_t out, int64_t o0) {
  constexpr int kColumns = RB == 2 ? L::kPairColumns : L::kColumns;
  static_assert(L::kColumns % kColumns == 0);
  for (int64_t j0 = 0; j0 < count; j0 += kColumns) {
    T results[RB][kColumns][L::kLanes];
    block_product<L, kType, RB, kColumns>(x, b0, tile, j0, in, j0 == 0 ? ahead : Ahead{}, results);
    const int64_t columns = std::min<int64_t>(kColumns, count - j0);
    for (int rb = 0; rb < RB; ++rb) {
      for (int lane = 0; lane < L::kLanes; ++lane) {
        const int64_t r = (b0 + rb) * L::kLanes + lane;
        if (r >= rows) break;
        for (int j = 0; j < columns; ++j) y[r * out + o0 + j0 + j] = results[rb][j][lane];
      }
    }
  }
}

// the worker's tile, kept between calls. Through a reference taken once: each use of a
// thread_local in a loop called __tls_get_addr (the library is position-independent), once a
// sub-block, and unpacking took twice as long
__attribute__((noinline)) Tile& worker_tile() {
  thread_local Tile tile;
  return tile;
}

// Rows in chunks of kChunkRows, each weight tile unpacked again for each chunk: Qwen2.5-0.5B's
// FFN on a Zen 3 (AVX2, 2 threads) ran 124 Gp/s at 256 and 512 rows and 107 at 1024, whose codes
// (896 KiB, for 896 values a row) streamed from L3 for every tile of 4 weight rows
constexpr int64_t kChunkRows = 256;  // a multiple of every width's kLanes * kRowBlocks

template <typename L, int64_t kType, typename T>
void gemm_in(const T* xp, int64_t rows, const uint8_t* w, int64_t out, int64_t in, T* yp) {
  constexpr int kSub = kSubValues<kType>, kColumns = L::kColumns;
  const int64_t row_bytes = row_bytes_of(kType, in), subs = in / kSub;
  thread_local QuantizedRows callers;  // reused: a hundred calls a step
  QuantizedRows& x = callers;           // the workers read the caller's, not their own
  quantize_rows<L, kType>(xp, rows, in, x);
  const int64_t chunk_blocks = kChunkRows / L::kLanes;
  // each thread a run of weight rows, unpacked kColumns at a time just before they multiply: the
  // blocks stream from memory all along (unpacking a 256 KiB tile at once waited on memory)
  at::parallel_for(0, (out + kColumns - 1) / kColumns, 1, [&](int64_t begin, int64_t end) {
    Tile& tile = worker_tile();
    if (tile.codes.size() < static_cast<size_t>(kColumns * in)) tile.codes.resize(kColumns * in);
    for (auto* v : {&tile.scales, &tile.offsets})
      if (v->size() < static_cast<size_t>(kColumns * subs)) v->resize(kColumns * subs);
    for (int64_t first = 0; first < x.blocks; first += chunk_blocks) {
      const int64_t last = std::min(x.blocks, first + chunk_blocks);
      for (int64_t step = begin; step < end; ++step) {
        const int64_t o0 = step * kColumns, count = std::min<int64_t>(kColumns, out - o0);
        for (int64_t o = 0; o < count; ++o) unpack_row<kType>(w + (o0 + o) * row_bytes, in, o, tile);
        if (count < kColumns) {  // the last rows: zero weights
          std::fill(tile.codes.begin() + count * in, tile.codes.begin() + kColumns * in, 0);
          for (auto* v : {&tile.scales, &tile.offsets})
            std::fill(v->begin() + count * subs, v->begin() + kColumns * subs, 0.f);
        }
        const int64_t next = std::min(out, o0 + kColumns);
        const Ahead ahead{w + next * row_bytes, (std::min(out, next + kColumns) - next) * row_bytes};
        int64_t b = first;
        if constexpr (L::kRowBlocks == 2)
          for (; b + 2 <= last; b += 2)
            store_blocks<L, kType, 2>(x, b, tile, b == first ? ahead : Ahead{}, count, in, rows, yp, out, o0);
        for (; b < last; ++b)
          store_blocks<L, kType, 1>(x, b, tile, b == first ? ahead : Ahead{}, count, in, rows, yp, out, o0);
      }
    }
  });
}

// with AVX-512, up to 8 rows in ymm lanes: bit for bit the zmm lanes' results, at about twice the rate
template <int64_t kType, typename T>
void gemm(const T* xp, int64_t rows, const uint8_t* w, int64_t out, int64_t in, T* yp) {
#ifdef CONVEYOR_INT8_ZMM
  if (rows <= Ymm::kLanes) return gemm_in<Ymm, kType>(xp, rows, w, out, in, yp);
#endif
  gemm_in<Widest, kType>(xp, rows, w, out, in, yp);
}

at::Tensor quant_gemm_int8(const at::Tensor& x, const at::Tensor& weight, int64_t type, int64_t out, int64_t in) {
  return rows_times_blocks("quant_gemm_int8", x, weight, type, out, in, [](auto tag, auto... args) {
    gemm<decltype(tag)::value>(args...);
  });
}

// how x is rounded against weights of `type`: [values a step, largest code] (int8_lanes.h)
std::vector<int64_t> quant_int8_x_rounding(int64_t type) {
  std::vector<int64_t> rounding;
  with_type(type, "quant_int8_x_rounding", [&](auto tag) {
    rounding = {kXGroup<decltype(tag)::value>, kXTop<decltype(tag)::value>};
  });
  return rounding;
}

bool quant_gemm_int8_available() { return true; }
#define CONVEYOR_QUANT_GEMM_INT8 1
#endif  // CONVEYOR_INT8_LANES

#ifndef CONVEYOR_QUANT_GEMM_INT8
at::Tensor quant_gemm_int8(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "quant_gemm_int8: built without AVX2");
}
std::vector<int64_t> quant_int8_x_rounding(int64_t) { TORCH_CHECK(false, "quant_int8_x_rounding: built without AVX2"); }
bool quant_gemm_int8_available() { return false; }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("quant_gemm_int8(Tensor x, Tensor weight, int ggml_type, int out_features, int in_features) -> Tensor");
  m.impl("quant_gemm_int8", c10::DispatchKey::CPU, &quant_gemm_int8);
  m.def("quant_int8_x_rounding(int ggml_type) -> int[]");
  m.impl("quant_int8_x_rounding", &quant_int8_x_rounding);
  m.def("quant_gemm_int8_available() -> bool");
  m.impl("quant_gemm_int8_available", &quant_gemm_int8_available);
}
