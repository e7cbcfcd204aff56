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
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "float8.h"
#include "row_settings.h"

namespace {

using namespace conveyor_float8;
using conveyor_rows::floats_of;

constexpr int64_t kBlock = 1024;  // ops.CDF_BLOCK
constexpr float kLowest = -87.f;  // e^x below this is taken as 0, as float8.h's exp8 takes it

inline float value_of(float v) { return v; }
inline float value_of(c10::BFloat16 v) { return static_cast<float>(v); }

#ifdef __AVX2__
constexpr int kLanes = 8;
#endif

template <typename T>
float largest(const T* row, int64_t vocab) {
  int64_t i = 0;
  float best = -INFINITY;
#ifdef __AVX2__
  __m256 tops = _mm256_set1_ps(-INFINITY);
  for (; i + kLanes <= vocab; i += kLanes) tops = _mm256_max_ps(tops, (__m256)load8(row + i));
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, tops);
  for (float lane : lanes) best = std::max(best, lane);
#endif
  for (; i < vocab; ++i) best = std::max(best, value_of(row[i]));
  return best;
}

// w[i] = e^((l_i - best) / T) for the row's first `vocab` columns (NaN: 0)
template <typename T>
void weights_of(const T* row, int64_t vocab, float best, float inverse_t, float* w) {
  int64_t i = 0;
#ifdef __AVX2__
  for (; i + kLanes <= vocab; i += kLanes) {
    const v8 p = exp8((load8(row + i) - best) * inverse_t);
    *reinterpret_cast<v8*>(w + i) = (v8)((i8)p & (p >= 0.f));  // NaN: 0
  }
#endif
  for (; i < vocab; ++i) {
    const float x = (value_of(row[i]) - best) * inverse_t;
    w[i] = x < kLowest || !(x <= 0.f) ? 0.f : std::exp(x);
  }
}

// the float32 sum of n weights, kLanes partial sums first: the same bits for the same block
float block_sum(const float* w, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef __AVX2__
  __m256 sums = _mm256_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) sums = _mm256_add_ps(sums, _mm256_loadu_ps(w + i));
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, sums);
  for (float lane : lanes) sum += lane;
#endif
  for (; i < n; ++i) sum += w[i];
  return sum;
}

// The last token a filter keeps, in the order top-k and top-p read the tokens: weight descending,
// then token id ascending (ties: the torch path's topk may order them otherwise)
struct Boundary {
  float weight;
  int32_t id;
  bool keeps(float w, int32_t i) const { return w > weight || (w == weight && i <= id); }
};

inline uint32_t bits_of(float w) {
  uint32_t bits;
  std::memcpy(&bits, &w, 4);
  return bits;  // ordered as the weights are, weights being >= 0
}

// fn(i) for each i in [begin, end) where test holds of w[i]: test(v) over kLanes weights at a time
// (a lane mask), test_one(x) over the rest
template <typename Test, typename TestOne, typename Fn>
void for_each_where(const float* w, int64_t begin, int64_t end, Test test, TestOne test_one, Fn fn) {
  int64_t i = begin;
#ifdef __AVX2__
  for (; i + kLanes <= end; i += kLanes) {
    for (int mask = _mm256_movemask_ps(test(_mm256_loadu_ps(w + i))); mask; mask &= mask - 1)
      fn(i + __builtin_ctz(mask));
  }
#endif
  for (; i < end; ++i)
    if (test_one(w[i])) fn(i);
}

// the weights' sum, float32 blocks of kBlock added in float64 (as inverse_cdf adds them)
double mass_of(const float* w, int64_t vocab) {
  double mass = 0.0;
  for (int64_t b = 0; b < vocab; b += kBlock) mass += block_sum(w + b, std::min(kBlock, vocab - b));
  return mass;
}

// The bucket of keys[] (running totals, highest key first) where the running total reaches
// target, `before` raised by the buckets above it; the last non-empty one where none does
int bucket_reaching(const double* sums, int keys, double target, double& before) {
  int chosen = 0;
  for (int k = keys - 1; k >= 0; --k) {
    if (sums[k] == 0.0) continue;
    chosen = k;
    if (before + sums[k] >= target) return k;
    before += sums[k];
  }
  before -= sums[chosen];
  return chosen;
}

// The first of the tokens `ids` (weights > 0), in that order, where the running total of their
// weights (by_mass) or of their count, from `before`, reaches target; the last where none does.
// A radix select: the tokens bucketed by 12 bits of their weight at a time from bit `shift` + 12
// down, until the bucket holding the boundary is small enough to sort.
Boundary boundary_in(const float* w, std::vector<int32_t>& ids, double before, double target, bool by_mass,
                     int shift) {
  std::vector<double> sums(4096);
  for (; shift >= 8 && ids.size() > 64; shift -= 12) {
    const auto key = [&](int32_t i) { return (bits_of(w[i]) >> shift) & 0xFFF; };
    std::fill(sums.begin(), sums.end(), 0.0);
    for (int32_t i : ids) sums[key(i)] += by_mass ? w[i] : 1.0;
    const uint32_t chosen = bucket_reaching(sums.data(), 4096, target, before);
    ids.erase(std::remove_if(ids.begin(), ids.end(), [&](int32_t i) { return key(i) != chosen; }), ids.end());
  }
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); });
  for (int32_t i : ids) {
    before += by_mass ? w[i] : 1.0;
    if (before >= target) return {w[i], i};
  }
  return {w[ids.back()], ids.back()};
}

// The same over every token with a weight (> 0): the first 12 bits bucketed in one pass over w
// (weights <= 1: 1,017 keys; two tables so that equal keys in a row do not wait on each other)
Boundary boundary_of_all(const float* w, int64_t vocab, double target, bool by_mass, std::vector<int32_t>& ids) {
  constexpr int kKeys = 1024;
  std::vector<double> sums(2 * kKeys);
  for (int64_t i = 0; i < vocab; ++i)
    if (w[i] > 0.f) sums[(i & 1) * kKeys + (bits_of(w[i]) >> 20)] += by_mass ? w[i] : 1.0;
  for (int k = 0; k < kKeys; ++k) sums[k] += sums[kKeys + k];
  double before = 0.0;
  const uint32_t chosen = bucket_reaching(sums.data(), kKeys, target, before);
  ids.clear();
  const auto in_bucket = [chosen](float x) { return x > 0.f && bits_of(x) >> 20 == chosen; };
#ifdef __AVX2__
  const auto in_bucket8 = [chosen](__m256 v) {
    const __m256i keys = _mm256_srli_epi32(_mm256_castps_si256(v), 20);
    const __m256 same = _mm256_castsi256_ps(_mm256_cmpeq_epi32(keys, _mm256_set1_epi32(static_cast<int>(chosen))));
    return _mm256_and_ps(same, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ));
  };
#else
  const auto in_bucket8 = nullptr;
#endif
  for_each_where(w, 0, vocab, in_bucket8, in_bucket, [&](int64_t i) { ids.push_back(static_cast<int32_t>(i)); });
  return boundary_in(w, ids, before, target, by_mass, 8);
}

struct RowSettings {
  float temperature, min_p, top_p, uniform;
  int64_t top_k;  // vocab or more: no cut
};

// w of the tokens a boundary drops set to 0
void keep_through(float* w, int64_t vocab, Boundary last) {
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 floor = _mm256_set1_ps(last.weight);
  for (; i + kLanes <= vocab; i += kLanes) {
    const __m256 v = _mm256_loadu_ps(w + i);
    _mm256_storeu_ps(w + i, _mm256_and_ps(v, _mm256_cmp_ps(v, floor, _CMP_GE_OQ)));
  }
#endif
  for (; i < vocab; ++i) w[i] = w[i] >= last.weight ? w[i] : 0.f;
  const auto tie = [&](float x) { return x == last.weight; };  // after the boundary's token id
#ifdef __AVX2__
  const auto tie8 = [&](__m256 v) { return _mm256_cmp_ps(v, floor, _CMP_EQ_OQ); };
#else
  const auto tie8 = nullptr;
#endif
  for_each_where(w, last.id + 1, vocab, tie8, tie, [&](int64_t j) { w[j] = 0.f; });
}

// Top-k, then top-p over the mass top-k leaves (the torch path's keep_top_k_top_p): w of the
// tokens they drop set to 0
void cut_top_k_top_p(float* w, int64_t vocab, const RowSettings& s) {
  thread_local std::vector<int32_t> ids;
  const bool top_p = s.top_p < 1.f;
  const auto is_positive = [](float x) { return x > 0.f; };
#ifdef __AVX2__
  const auto positive8 = [](__m256 v) { return _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ); };
#else
  const auto positive8 = nullptr;
#endif
  int64_t positive = vocab;
  if (s.top_k < vocab) {
    positive = 0;
    for_each_where(w, 0, vocab, positive8, is_positive, [&](int64_t) { ++positive; });
  }
  if (s.top_k >= positive) {
    if (top_p) {
      const double mass = mass_of(w, vocab);
      keep_through(w, vocab, boundary_of_all(w, vocab, static_cast<double>(s.top_p) * mass, true, ids));
    }
    return;
  }
  keep_through(w, vocab, boundary_of_all(w, vocab, static_cast<double>(s.top_k), false, ids));
  if (!top_p) return;
  ids.clear();
  for_each_where(w, 0, vocab, positive8, is_positive, [&](int64_t i) { ids.push_back(static_cast<int32_t>(i)); });
  const double mass = mass_of(w, vocab);
  keep_through(w, vocab, boundary_in(w, ids, 0.0, static_cast<double>(s.top_p) * mass, true, 20));
}

// the first index whose running total is above target; n where none is
template <typename Values>
int64_t first_above(const Values& running, int64_t n, double target) {
  return std::upper_bound(running, running + n, target) - running;
}

// The inverse CDF of weights w [vocab] at uniform, in two levels; -1 where they have no mass
int64_t inverse_cdf(const float* w, int64_t vocab, float uniform) {
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  std::vector<double> running(blocks);  // [blocks], the blocks' running total
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    total += block_sum(w + b * kBlock, std::min(kBlock, vocab - b * kBlock));
    running[b] = total;
  }
  if (!(total > 0.0) || !std::isfinite(total)) return -1;
  const double target = static_cast<double>(uniform) * total;
  const int64_t chosen = std::min(first_above(running.data(), blocks, target), blocks - 1);
  const int64_t begin = chosen * kBlock, end = std::min(vocab, begin + kBlock);
  const double block_mass = chosen ? running[chosen] - running[chosen - 1] : running[0];
  const double landed = running[chosen] - block_mass;
  const double share = std::clamp((target - landed) / block_mass, 0.0, 1.0);
  std::vector<double> inside(end - begin);
  double sum = 0.0;
  int64_t last_positive = 0;
  for (int64_t i = 0; i < end - begin; ++i) {
    sum += w[begin + i];
    inside[i] = sum;
    if (w[begin + i] > 0.f) last_positive = i;
  }
  const int64_t picked = first_above(inside.data(), end - begin, share * sum);
  return begin + (picked < end - begin ? picked : last_positive);
}

template <typename T>
int64_t draw_row(const T* row, int64_t vocab, const RowSettings& s, std::vector<float>& w) {
  const float best = largest(row, vocab);
  if (!std::isfinite(best)) return 0;
  w.resize(vocab);
  weights_of(row, vocab, best, 1.f / s.temperature, w.data());
  if (s.top_k < vocab || s.top_p < 1.f) cut_top_k_top_p(w.data(), vocab, s);
  if (s.min_p > 0.f)  // the best token's weight is 1: min-p compares a weight itself
    for (int64_t i = 0; i < vocab; ++i) w[i] = w[i] >= s.min_p ? w[i] : 0.f;
  return std::max<int64_t>(0, inverse_cdf(w.data(), vocab, s.uniform));
}

at::Tensor draw_tempered(const at::Tensor& logits, int64_t vocab, const at::Tensor& temperature,
                         const c10::optional<at::Tensor>& min_p, const c10::optional<at::Tensor>& top_k,
                         const c10::optional<at::Tensor>& top_p, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "draw_tempered: logits [rows, >= vocab] float32 or bfloat16 on CPU, columns contiguous");
  const int64_t rows = logits.size(0);
  TORCH_CHECK(vocab > 0 && vocab <= logits.size(1) && vocab < INT32_MAX, "draw_tempered: vocab ", vocab,
              " past the logits");
  TORCH_CHECK(!top_k || (top_k->scalar_type() == at::kLong && top_k->numel() == rows),
              "draw_tempered: top_k [rows] int64");
  const char* op = "draw_tempered";
  const std::vector<float> ts = floats_of(temperature, rows, 1.f, op, "temperature");
  const std::vector<float> us = floats_of(uniforms, rows, 0.f, op, "uniforms");
  const std::vector<float> floors = floats_of(min_p, rows, 0.f, op, "min_p"), ps = floats_of(top_p, rows, 1.f, op, "top_p");
  const at::Tensor ks = top_k ? top_k->contiguous() : at::full({rows}, vocab, logits.options().dtype(at::kLong));
  const int64_t* k = ks.data_ptr<int64_t>();
  at::Tensor ids = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out = ids.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  const auto draw_all = [&](const auto* base) {
    at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
      thread_local std::vector<float> weights;  // [vocab]
      for (int64_t r = first; r < last; ++r) {
        const RowSettings s{ts[r], floors[r], ps[r], us[r], k[r] > 0 ? k[r] : vocab};
        out[r] = draw_row(base + r * stride, vocab, s, weights);
      }
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
  m.def(
      "draw_tempered(Tensor logits, int vocab, Tensor temperature, Tensor? min_p, Tensor? top_k, Tensor? top_p, "
      "Tensor uniforms) -> Tensor");
  m.impl("draw_tempered", c10::DispatchKey::CPU, &draw_tempered);
}
