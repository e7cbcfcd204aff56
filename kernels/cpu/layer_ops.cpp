// A layer's small operations on CPU, each one op instead of the 4-10 small torch ops of
// kernels/reference.py's rms_norm, prepare_rotary, rotary_with_plan and store_kvcache (the
// oracle, in tests/test_layer_ops.py): at decode they run on a few rows, and torch's cost per op,
// not arithmetic, was their time.
//
// The roundings are the reference's: in bfloat16, x + residual is rounded to bfloat16, the sum of
// squares is taken in float32, x / rms is rounded to bfloat16 before the weight multiplies it,
// and the product is rounded again; rotary rounds x * cos and rotate(x) * sin each to bfloat16
// before adding them. Float32 has no roundings between.
//
// Shapes:
//   rms_norm(x [rows, n], weight [n], eps, residual [rows, n]?) -> (out [rows, n], x + residual)
//     (without residual the second is empty: x is the sum, and an op must not return its input)
//     x, weight, residual: one dtype, float32 or bfloat16, contiguous; or bfloat16 x and residual
//     with a float32 weight (Gemma's 1 + w): normalised in float32, rounded once to bfloat16
//     (x.float() through the float32 norm, then .to(bfloat16); kernels/reference.py's
//     rms_norm_in_float32)
//   rotary_with_plan(q [tokens, heads, d], k [tokens, kv_heads, d], cos [tokens, 1, d],
//                    sin [tokens, 1, d]) -> (q', k') contiguous
//     q, k may be strided views (the fused qkv's columns); their last dimension is contiguous;
//     cos holds (cos, cos), sin (-sin, sin) per position, in q's dtype (reference.RotaryPlan)
//   rotary_plan(positions [tokens] int, cache [max_position, d] float32, dtype) -> (cos, sin)
//     [tokens, 1, d] each: the cache rows hold cos in their first half, sin in the second
//   store_kvcache(key [tokens, kv_heads, d], value, k_cache [blocks, block_size, kv_heads, d],
//                 v_cache, slots [tokens] int): key/value rows into their slots; slot -1 is
//     skipped (CUDA-graph padding); key and value may be strided, d contiguous
//   silu_and_mul(both [rows, 2 i]) -> [rows, i]: silu(gate) * up, gate and up both's halves (the
//     SwiGLU MLP's middle; reference.silu_and_mul), contiguous, float32 or bfloat16

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "float8.h"

namespace {

using namespace conveyor_float8;

template <typename T>
inline T rounded(float v) {
  return static_cast<T>(v);  // bfloat16: round to nearest even, as torch's ops store
}

// W, the weight's dtype, is the one the norm computes in: x's own (x / rms rounded to it before the
// weight multiplies it), or float32 over bfloat16 rows (Gemma's (1 + w): x / rms and the product in
// float32, rounded once to bfloat16, as x.float() -> the float32 norm -> .to(bfloat16))
template <typename T, typename W = T>
void rms_norm_rows(const T* x, const T* residual, const W* weight, float eps, int64_t rows, int64_t n,
                   T* out, T* sum) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* s = residual ? sum + r * n : const_cast<T*>(xr);
      float squares = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        if (residual) s[i] = rounded<T>(static_cast<float>(xr[i]) + static_cast<float>(residual[r * n + i]));
        const float v = static_cast<float>(s[i]);
        squares += v * v;
      }
      const float inverse_rms = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float normed = static_cast<float>(rounded<W>(static_cast<float>(s[i]) * inverse_rms));
        o[i] = rounded<T>(static_cast<float>(rounded<W>(static_cast<float>(weight[i]) * normed)));
      }
    }
  });
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.is_contiguous() && a.device().is_cpu(),
              "rms_norm: ", what, " must be contiguous, on CPU, in x's dtype");
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: x [rows, n], float32 or bfloat16");
  check_same(x, x, "x");
  const bool float_weight = x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kFloat;
  check_same(weight, float_weight ? weight : x, "weight");
  TORCH_CHECK(weight.numel() == x.size(1), "rms_norm: weight [", x.size(1), "]");
  if (residual) {
    check_same(*residual, x, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "rms_norm: residual as x");
  }
  at::Tensor out = at::empty_like(x);
  at::Tensor sum = residual ? at::empty_like(x) : at::empty({0}, x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr, weight.data_ptr<float>(),
                  static_cast<float>(eps), rows, n, out.data_ptr<float>(), residual ? sum.data_ptr<float>() : nullptr);
  } else if (float_weight) {
    using B = at::BFloat16;
    rms_norm_rows(x.data_ptr<B>(), residual ? residual->data_ptr<B>() : nullptr, weight.data_ptr<float>(),
                  static_cast<float>(eps), rows, n, out.data_ptr<B>(), residual ? sum.data_ptr<B>() : nullptr);
  } else {
    using B = at::BFloat16;
    rms_norm_rows(x.data_ptr<B>(), residual ? residual->data_ptr<B>() : nullptr, weight.data_ptr<B>(),
                  static_cast<float>(eps), rows, n, out.data_ptr<B>(), residual ? sum.data_ptr<B>() : nullptr);
  }
  return {out, sum};
}

// out [tokens, heads, d] = x * cos + rotate(x) * sin, rotate(x) = (x2, x1) of x's halves
template <typename T>
void rotate_heads(const at::Tensor& x, const T* cos, const T* sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        const T* v = xp + t * token_stride + h * head_stride;
        T* o = op + (t * heads + h) * d;
        for (int64_t i = 0; i < d; ++i) {
          const float turned = static_cast<float>(v[i < half ? i + half : i - half]);
          const T a = rounded<T>(static_cast<float>(v[i]) * static_cast<float>(c[i]));
          const T b = rounded<T>(turned * static_cast<float>(s[i]));
          o[i] = rounded<T>(static_cast<float>(a) + static_cast<float>(b));
        }
      }
    }
  });
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 && x.device().is_cpu(),
              "rotary_with_plan: q and k [tokens, heads, head_dim], head_dim even and contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel(),
              "rotary_with_plan: cos and sin [tokens, 1, head_dim] contiguous in q's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    rotate_heads(x, cos.data_ptr<float>(), sin.data_ptr<float>(), out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rotary_with_plan: float32 or bfloat16");
    rotate_heads(x, cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(), out);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary_with_plan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                    const at::Tensor& sin) {
  return {rotate(q, cos, sin), rotate(k, cos, sin)};
}

template <typename T>
void plan_rows(const int64_t* positions, int64_t tokens, const float* cache, int64_t max_position,
               int64_t d, T* cos, T* sin) {
  const int64_t half = d / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(positions[t] >= 0 && positions[t] < max_position, "rotary_plan: position ", positions[t],
                " past the table's ", max_position);
    const float* row = cache + positions[t] * d;
    for (int64_t i = 0; i < half; ++i) {
      cos[t * d + i] = cos[t * d + half + i] = rounded<T>(row[i]);
      sin[t * d + i] = rounded<T>(-row[half + i]);
      sin[t * d + half + i] = rounded<T>(row[half + i]);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rotary_plan(const at::Tensor& positions, const at::Tensor& cache,
                                               at::ScalarType dtype) {
  TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.dim() == 2 && cache.is_contiguous() &&
                  cache.size(1) % 2 == 0,
              "rotary_plan: cache [max_position, head_dim] float32, contiguous");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rotary_plan: float32 or bfloat16");
  const at::Tensor ids = positions.to(at::kLong).contiguous();
  const int64_t tokens = ids.numel(), d = cache.size(1);
  at::Tensor cos = at::empty({tokens, 1, d}, cache.options().dtype(dtype));
  at::Tensor sin = at::empty_like(cos);
  if (dtype == at::kFloat) {
    plan_rows(ids.data_ptr<int64_t>(), tokens, cache.data_ptr<float>(), cache.size(0), d, cos.data_ptr<float>(),
              sin.data_ptr<float>());
  } else {
    plan_rows(ids.data_ptr<int64_t>(), tokens, cache.data_ptr<float>(), cache.size(0), d,
              cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>());
  }
  return {cos, sin};
}

// rows of x [tokens, heads, d] (d contiguous) into cache slots ([slots, heads, d] contiguous)
void store_rows(const at::Tensor& x, const int64_t* slots, int64_t num_slots, at::Tensor& cache) {
  const int64_t tokens = x.size(0), heads = x.size(1), row_bytes = x.size(2) * x.element_size();
  const auto* src = static_cast<const char*>(x.data_ptr());
  auto* dst = static_cast<char*>(cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    TORCH_CHECK(slots[t] < num_slots, "store_kvcache: slot ", slots[t], " past the cache's ", num_slots);
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + (slots[t] * heads + h) * row_bytes,
                  src + (t * x.stride(0) + h * x.stride(1)) * x.element_size(), row_bytes);
  }
}

void check_store(const at::Tensor& x, const at::Tensor& cache, int64_t tokens) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == tokens && x.stride(2) == 1 && cache.dim() == 4 &&
                  cache.is_contiguous() && cache.scalar_type() == x.scalar_type() &&
                  cache.size(2) == x.size(1) && cache.size(3) == x.size(2),
              "store_kvcache: key/value [tokens, kv_heads, head_dim] (head_dim contiguous) into a contiguous "
              "cache [blocks, block_size, kv_heads, head_dim] of their dtype");
}

void store_kvcache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping) {
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t tokens = slots.numel(), num_slots = k_cache.size(0) * k_cache.size(1);
  check_store(key, k_cache, tokens);
  check_store(value, v_cache, tokens);
  store_rows(key, slots.data_ptr<int64_t>(), num_slots, k_cache);
  store_rows(value, slots.data_ptr<int64_t>(), num_slots, v_cache);
}

// silu(g) = g * sigmoid(g), sigmoid from e^-|g| (exp8's domain): 1 / (1 + e) or e / (1 + e)
inline v8 silu8(v8 g) {
  const i8 sign = i8{} + static_cast<int32_t>(0x80000000u);
  const v8 e = exp8((v8)((i8)g | sign));  // e^-|g|: the sign bit set
  return g * ((g >= 0.f ? v8{} + 1.f : e) / (1.f + e));
}

inline void store8(v8 v, float* dst) { *reinterpret_cast<v8*>(dst) = v; }
inline void store8(v8 v, at::BFloat16* dst) {
  for (int i = 0; i < 8; ++i) dst[i] = v[i];
}

// 8 columns: bfloat16 rounds silu's result before the multiply, and the product, as torch's two ops
// round theirs
template <typename T>
inline void silu_mul8(const T* gate, const T* up, T* out) {
  v8 activated = silu8(load8(gate));
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    T rounded_silu[8];
    store8(activated, rounded_silu);
    activated = load8(rounded_silu);
  }
  store8(activated * load8(up), out);
}

// one row, 8 columns at a time; the last few through 8-lane copies, so that every column takes the
// same operations
template <typename T>
void silu_mul_row(const T* gate, const T* up, int64_t columns, T* out) {
  int64_t k = 0;
  for (; k + 8 <= columns; k += 8) silu_mul8(gate + k, up + k, out + k);
  if (k == columns) return;
  const int64_t count = columns - k;
  T g[8] = {}, u[8] = {}, o[8];
  std::memcpy(g, gate + k, count * sizeof(T));
  std::memcpy(u, up + k, count * sizeof(T));
  silu_mul8(g, u, o);
  std::memcpy(out + k, o, count * sizeof(T));
}

template <typename T>
void silu_mul_rows(const T* both, int64_t rows, int64_t columns, T* out) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(columns, 1));  // a thread's share
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_mul_row(both + r * 2 * columns, both + r * 2 * columns + columns, columns, out + r * columns);
  });
}

at::Tensor silu_and_mul(const at::Tensor& both) {
  TORCH_CHECK(both.dim() == 2 && both.size(1) % 2 == 0 && both.is_contiguous() && both.device().is_cpu() &&
                  (both.scalar_type() == at::kFloat || both.scalar_type() == at::kBFloat16),
              "silu_and_mul: both [rows, 2 * intermediate], contiguous float32 or bfloat16 on CPU");
  const int64_t rows = both.size(0), columns = both.size(1) / 2;
  at::Tensor out = at::empty({rows, columns}, both.options());
  if (both.scalar_type() == at::kFloat)
    silu_mul_rows(both.data_ptr<float>(), rows, columns, out.data_ptr<float>());
  else
    silu_mul_rows(both.data_ptr<at::BFloat16>(), rows, columns, out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual=None) -> (Tensor, Tensor)");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("rotary_with_plan(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.impl("rotary_with_plan", c10::DispatchKey::CPU, &rotary_with_plan);
  m.def("rotary_plan(Tensor positions, Tensor cache, ScalarType dtype) -> (Tensor, Tensor)");
  m.impl("rotary_plan", c10::DispatchKey::CPU, &rotary_plan);
  m.def("store_kvcache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("store_kvcache", c10::DispatchKey::CPU, &store_kvcache);
  m.def("silu_and_mul(Tensor both) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
}
