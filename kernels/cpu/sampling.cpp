// Tokens drawn from tempered logits without a [rows, vocab] tensor (runtime/sampling/ops.py's
// draw_tempered, its oracle the softmax and ops.draw_from_probs):
//
// draw_tempered(logits [rows, >= vocab] float32 or bfloat16, vocab, temperature [rows] float32,
//               min_p [rows] float32 or none, uniforms [rows] float32 in [0, 1)) -> ids [rows] int64
//
// A row's weights are p_i = e^((l_i - max l) / T) over its first `vocab` columns, less those
// below min_p (the best token's weight is 1, so min-p compares p_i itself), and its token the
// inverse CDF at its uniform in the two levels of ops.draw_from_probs: float32 sums of blocks of
// kBlock columns, their running total in float64, then the running total inside the block the
// uniform lands in, rescaled to that block's sum; never a column of no weight, and a row without
// weight (all -inf, NaN) gets column 0. A row's weights are the same bits wherever the row sits
// in a batch (rows are independent; the weights of a block are computed alike in both passes).
// Why: the softmax path made three float32 tensors of the logits' size a step (the float32 copy,
// the division by the temperature, the softmax). At 32 rows of Qwen's 151,936 tokens (Zen 4, 2
// threads) the sampler took a median 4.6 ms a step on the server's engine thread and 17 ms on a
// main thread (offline), whose freed pages went back to the kernel and were faulted in again each
// step; with this kernel 2.3 and 1.6 ms.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 1024;  // ops.CDF_BLOCK
constexpr float kLowest = -87.33654f;  // e^x below this is no normal float: taken as 0

inline float value_of(float v) { return v; }
inline float value_of(c10::BFloat16 v) { return static_cast<float>(v); }

#ifdef __AVX2__
constexpr int kLanes = 8;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

// e^x for x <= 0 (Cephes' expf polynomial, relative error about 1e-7); 0 below kLowest and for -inf
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(kLowest), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kLowest));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(below, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
}
#endif

// weights[i - begin] for columns [begin, end) of a row; returns their float32 sum
template <typename T>
float weights_of(const T* row, int64_t begin, int64_t end, float best, float inverse_t, float min_p,
                 float* weights) {
  int64_t i = begin;
  float sum = 0.f;
#ifdef __AVX2__
  __m256 sums = _mm256_setzero_ps();
  const __m256 top = _mm256_set1_ps(best), scale = _mm256_set1_ps(inverse_t), floor = _mm256_set1_ps(min_p);
  for (; i + kLanes <= end; i += kLanes) {
    __m256 p = exp_nonpositive(_mm256_mul_ps(_mm256_sub_ps(load8(row + i), top), scale));
    p = _mm256_and_ps(p, _mm256_cmp_ps(p, floor, _CMP_GE_OQ));  // NaN and min-p's drops: 0
    _mm256_storeu_ps(weights + (i - begin), p);
    sums = _mm256_add_ps(sums, p);
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, sums);
  for (float lane : lanes) sum += lane;
#endif
  for (; i < end; ++i) {
    const float x = (value_of(row[i]) - best) * inverse_t;
    float p = x < kLowest ? 0.f : std::exp(x);
    p = p >= min_p ? p : 0.f;
    weights[i - begin] = p;
    sum += p;
  }
  return sum;
}

template <typename T>
float largest(const T* row, int64_t vocab) {
  int64_t i = 0;
  float best = -INFINITY;
#ifdef __AVX2__
  __m256 tops = _mm256_set1_ps(-INFINITY);
  for (; i + kLanes <= vocab; i += kLanes) tops = _mm256_max_ps(tops, load8(row + i));
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, tops);
  for (float lane : lanes) best = std::max(best, lane);
#endif
  for (; i < vocab; ++i) best = std::max(best, value_of(row[i]));
  return best;
}

// the first index whose running total is above target; n where none is
template <typename Values>
int64_t first_above(const Values& running, int64_t n, double target) {
  return std::upper_bound(running, running + n, target) - running;
}

template <typename T>
int64_t draw_row(const T* row, int64_t vocab, float temperature, float min_p, float uniform) {
  const float best = largest(row, vocab), inverse_t = 1.f / temperature;
  if (!std::isfinite(best)) return 0;
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  std::vector<float> weights(kBlock);
  std::vector<double> running(blocks);  // [blocks], the blocks' running total
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    total += weights_of(row, b * kBlock, std::min(vocab, (b + 1) * kBlock), best, inverse_t, min_p, weights.data());
    running[b] = total;
  }
  if (!(total > 0.0) || !std::isfinite(total)) return 0;
  const double target = static_cast<double>(uniform) * total;
  const int64_t chosen = std::min(first_above(running.data(), blocks, target), blocks - 1);
  const int64_t begin = chosen * kBlock, end = std::min(vocab, begin + kBlock);
  const double block_mass = chosen ? running[chosen] - running[chosen - 1] : running[0];
  const double landed = running[chosen] - block_mass;
  const double share = std::clamp((target - landed) / block_mass, 0.0, 1.0);
  weights_of(row, begin, end, best, inverse_t, min_p, weights.data());
  std::vector<double> inside(end - begin);
  double sum = 0.0;
  int64_t last_positive = 0;
  for (int64_t i = 0; i < end - begin; ++i) {
    sum += weights[i];
    inside[i] = sum;
    if (weights[i] > 0.f) last_positive = i;
  }
  const int64_t picked = first_above(inside.data(), end - begin, share * sum);
  return begin + (picked < end - begin ? picked : last_positive);
}

at::Tensor draw_tempered(const at::Tensor& logits, int64_t vocab, const at::Tensor& temperature,
                         const c10::optional<at::Tensor>& min_p, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "draw_tempered: logits [rows, >= vocab] float32 or bfloat16 on CPU, columns contiguous");
  const int64_t rows = logits.size(0);
  TORCH_CHECK(vocab > 0 && vocab <= logits.size(1), "draw_tempered: vocab ", vocab, " past the logits");
  for (const at::Tensor* t : {&temperature, &uniforms})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == rows, "draw_tempered: [rows] float32 settings");
  TORCH_CHECK(!min_p || (min_p->scalar_type() == at::kFloat && min_p->numel() == rows),
              "draw_tempered: min_p [rows] float32");
  const at::Tensor t = temperature.contiguous(), u = uniforms.contiguous();
  const at::Tensor floors = min_p ? min_p->contiguous() : at::zeros({rows}, t.options());
  at::Tensor ids = at::empty({rows}, logits.options().dtype(at::kLong));
  const float *ts = t.data_ptr<float>(), *us = u.data_ptr<float>(), *fs = floors.data_ptr<float>();
  int64_t* out = ids.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  const auto draw_all = [&](const auto* base) {
    at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) out[r] = draw_row(base + r * stride, vocab, ts[r], fs[r], us[r]);
    });
  };
  if (logits.scalar_type() == at::kFloat)
    draw_all(logits.data_ptr<float>());
  else
    draw_all(logits.data_ptr<at::BFloat16>());
  return ids;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("draw_tempered(Tensor logits, int vocab, Tensor temperature, Tensor? min_p, Tensor uniforms) -> Tensor");
  m.impl("draw_tempered", c10::DispatchKey::CPU, &draw_tempered);
}
