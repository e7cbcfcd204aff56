// GGUF-quantized weights multiplied in their own block layout on CPU.
//
// Shapes:
//   x:       [rows, in], float32 or bfloat16
//   weight:  [out, row_bytes] uint8: each row is in / block_size blocks of the GGUF type, as in the
//            file (ggml-common.h's block structs, little-endian, half-precision scales)
//   returns  [rows, out] in x's dtype:  y = x @ dequantize(weight)^T
//
// Method: threads over output rows (at::parallel_for); each weight row is dequantized block by
// block into a per-thread float32 buffer of `in` floats (stays in L1/L2), then dotted with every
// row of x (8-wide FMA, four accumulators). The weight bytes are read once per call whatever the
// number of rows. No intrinsics: the block dequantizers are written so that -march=native
// vectorizes them (AVX2 here, AVX-512 where the build machine has it); activations are not
// quantized to Q8 (llama.cpp's integer path) yet. quant_dequantize returns the whole float32 matrix (the prefill path: torch's
// blocked matmul then runs on it). Oracle: gguf-py's gguf.quants.dequantize
// (tests/test_quant_kernels.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// gguf.GGMLQuantizationType values
enum GgmlType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Layout {
  int64_t block_values, block_bytes;
};

Layout layout_of(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "quant_matmul: no kernel for ggml type ", type);
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

void dequant_q4_0(const uint8_t* __restrict__ b, float* __restrict__ y) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * ((qs[j] & 0xF) - 8);
    y[j + 16] = d * ((qs[j] >> 4) - 8);
  }
}

void dequant_q4_1(const uint8_t* __restrict__ b, float* __restrict__ y) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (qs[j] & 0xF) + m;
    y[j + 16] = d * (qs[j] >> 4) + m;
  }
}

void dequant_q5_0(const uint8_t* __restrict__ b, float* __restrict__ y) {
  const float d = half_at(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const uint32_t lo = (qs[j] & 0xFu) | (((qh >> j) << 4) & 0x10u);
    const uint32_t hi = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10u);
    y[j] = d * (static_cast<int>(lo) - 16);
    y[j + 16] = d * (static_cast<int>(hi) - 16);
  }
}

void dequant_q8_0(const uint8_t* __restrict__ b, float* __restrict__ y) {
  const float d = half_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = d * qs[j];
}

// the 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block
inline void scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K (high_bits null) and Q5_K: 8 sub-blocks of 32, value = d*scale*q - dmin*min
void dequant_k4_k5(const uint8_t* __restrict__ b, const uint8_t* __restrict__ scales, const uint8_t* __restrict__ qs,
                   const uint8_t* __restrict__ high_bits, float* __restrict__ y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  for (int sub = 0; sub < 8; sub += 2) {
    int sc0, m0, sc1, m1;
    scale_min_k4(sub, scales, &sc0, &m0);
    scale_min_k4(sub + 1, scales, &sc1, &m1);
    const float d0 = d * sc0, d1 = d * sc1, min0 = dmin * m0, min1 = dmin * m1;
    const uint8_t* q = qs + sub * 16;
    for (int l = 0; l < 32; ++l) {
      int lo = q[l] & 0xF, hi = q[l] >> 4;
      if (high_bits) {
        lo |= ((high_bits[l] >> sub) & 1) << 4;
        hi |= ((high_bits[l] >> (sub + 1)) & 1) << 4;
      }
      y[sub * 32 + l] = d0 * lo - min0;
      y[sub * 32 + 32 + l] = d1 * hi - min1;
    }
  }
}

void dequant_q4_k(const uint8_t* __restrict__ b, float* __restrict__ y) { dequant_k4_k5(b, b + 4, b + 16, nullptr, y); }
void dequant_q5_k(const uint8_t* __restrict__ b, float* __restrict__ y) { dequant_k4_k5(b, b + 4, b + 48, b + 16, y); }

void dequant_q6_k(const uint8_t* __restrict__ b, float* __restrict__ y) {
  const uint8_t* __restrict__ ql = b;
  const uint8_t* __restrict__ qh = b + 128;
  const int8_t* __restrict__ sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int half = 0; half < 2; ++half, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int group = 0; group < 2; ++group) {  // 16 values share a scale
      const float s1 = d * sc[group], s2 = d * sc[group + 2];
      const float s3 = d * sc[group + 4], s4 = d * sc[group + 6];
      for (int l = group * 16; l < group * 16 + 16; ++l) {
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = s1 * q1;
        y[l + 32] = s2 * q2;
        y[l + 64] = s3 * q3;
        y[l + 96] = s4 * q4;
      }
    }
  }
}

// a whole row of `in` values, the block function inlined (no call per block)
template <void (*Dequant)(const uint8_t*, float*), int64_t kValues, int64_t kBytes>
void dequant_row_of(const uint8_t* row, int64_t in, float* y) {
  for (int64_t v = 0, b = 0; v < in; v += kValues, b += kBytes) Dequant(row + b, y + v);
}

using DequantRow = void (*)(const uint8_t*, int64_t, float*);

DequantRow dequant_row_for(int64_t type) {
  switch (type) {
    case Q4_0: return dequant_row_of<dequant_q4_0, 32, 18>;
    case Q4_1: return dequant_row_of<dequant_q4_1, 32, 20>;
    case Q5_0: return dequant_row_of<dequant_q5_0, 32, 22>;
    case Q8_0: return dequant_row_of<dequant_q8_0, 32, 34>;
    case Q4_K: return dequant_row_of<dequant_q4_k, 256, 144>;
    case Q5_K: return dequant_row_of<dequant_q5_k, 256, 176>;
    case Q6_K: return dequant_row_of<dequant_q6_k, 256, 210>;
  }
  TORCH_CHECK(false, "quant_matmul: no kernel for ggml type ", type);
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }

// n is a multiple of 32
inline float dot(const float* a, const float* b, int64_t n) {
  v8 acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
  for (int64_t i = 0; i < n; i += 32) {
    acc0 += load8(a + i) * load8(b + i);
    acc1 += load8(a + i + 8) * load8(b + i + 8);
    acc2 += load8(a + i + 16) * load8(b + i + 16);
    acc3 += load8(a + i + 24) * load8(b + i + 24);
  }
  v8 acc = (acc0 + acc1) + (acc2 + acc3);
  float sum = 0.f;
  for (int k = 0; k < 8; ++k) sum += acc[k];
  return sum;
}

void check_weight(const at::Tensor& weight, int64_t type, int64_t out, int64_t in) {
  const Layout lay = layout_of(type);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "quant weight: contiguous uint8 on CPU");
  TORCH_CHECK(in % lay.block_values == 0, "quant weight: in_features ", in,
              " is not a multiple of the block size ", lay.block_values);
  TORCH_CHECK(weight.numel() == out * (in / lay.block_values) * lay.block_bytes,
              "quant weight: ", weight.numel(), " bytes do not hold [", out, ", ", in, "]");
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                        int64_t out, int64_t in) {
  check_weight(weight, type, out, in);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == in, "quant_matmul: x [rows, ", in, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_matmul: x float32 or bfloat16");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, out}, xf.options());
  const Layout lay = layout_of(type);
  const DequantRow dequant_row = dequant_row_for(type);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = in / lay.block_values * lay.block_bytes;
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wrow(in);
    for (int64_t o = begin; o < end; ++o) {
      dequant_row(w + o * row_bytes, in, wrow.data());
      for (int64_t r = 0; r < rows; ++r) yp[r * out + o] = dot(xp + r * in, wrow.data(), in);
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// [out, in] float32: the whole matrix (the prefill path and the embedding rows)
at::Tensor quant_dequantize(const at::Tensor& weight, int64_t type, int64_t out, int64_t in) {
  check_weight(weight, type, out, in);
  const Layout lay = layout_of(type);
  const DequantRow dequant_row = dequant_row_for(type);
  at::Tensor y = at::empty({out, in}, at::kFloat);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = in / lay.block_values * lay.block_bytes;
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) dequant_row(w + o * row_bytes, in, yp + o * in);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("quant_matmul(Tensor x, Tensor weight, int ggml_type, int out_features, int in_features) -> Tensor");
  m.impl("quant_matmul", c10::DispatchKey::CPU, &quant_matmul);
  m.def("quant_dequantize(Tensor weight, int ggml_type, int out_features, int in_features) -> Tensor");
  m.impl("quant_dequantize", c10::DispatchKey::CPU, &quant_dequantize);
}
