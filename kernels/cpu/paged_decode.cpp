// Decode attention over the paged KV cache on CPU: one query per sequence, keys and values read
// in place from their blocks (no gather), float32 accumulation, one task per (sequence, kv head)
// spread over torch's intra-op threads. kernels/reference.py's paged_attention_decode is the
// oracle (tests/test_cpu_kernels.py).
//
// Shapes:
//   q:            [num_seqs, num_heads, head_dim]
//   k/v cache:    [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables: [num_seqs, max_blocks] int32
//   seq_lens:     [num_seqs] int32, keys of each sequence (its current token included)
//   sliding_window: 0, or the keys the query sees (the last ones, its own included)
//   returns       [num_seqs, num_heads, head_dim], q's dtype

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "float8.h"

namespace {

using namespace conveyor_float8;

inline float to_float(float x) { return x; }

inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void store(float* out, float x) { *out = x; }
inline void store(at::BFloat16* out, float x) { *out = at::BFloat16(x); }

// One row of keys or values in float32: bf16 rows are widened once, float32 rows are used as is.
template <typename T>
inline const float* widen(const T* row, int64_t head_dim, float* buffer) {
  for (int64_t d = 0; d < head_dim; ++d) buffer[d] = to_float(row[d]);
  return buffer;
}

template <>
inline const float* widen<float>(const float* row, int64_t, float*) {
  return row;
}

struct Layout {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t block_stride;  // elements between blocks of the cache
  float scale;
  int64_t sliding_window;  // 0: none
};

// Keys [first, seq_len) are attended: the last sliding_window of them, or all.
inline int64_t first_key(int64_t seq_len, const Layout& l) {
  return l.sliding_window > 0 ? std::max<int64_t>(seq_len - l.sliding_window, 0) : 0;
}

// AVX-512 instructions under -march=native and plain loops elsewhere.
typedef float v8 __attribute__((vector_size(32), aligned(4)));

// Two accumulators: the FMA chains interleave instead of waiting on each other.
inline float dot(const float* a, const float* b, int64_t n) {
  if (n % 16 == 0) {
    const v8* x = reinterpret_cast<const v8*>(a);
    const v8* y = reinterpret_cast<const v8*>(b);
    v8 even = {}, odd = {};
    for (int64_t j = 0; j < n / 8; j += 2) {
      even += x[j] * y[j];
      odd += x[j + 1] * y[j + 1];
    }
    return sum_lanes(even + odd);
  }
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t d = 0; d < n; ++d) total += a[d] * b[d];
  return total;
}

inline void add_scaled(float* acc, const float* x, float p, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * x[d];
}

constexpr int64_t kChunk = 32;  // tokens whose rows stay in L1 while a group's heads use them

// Scratch of one thread: query [num_heads, head_dim] (scaled, float32), scores [num_heads,
// longest], acc [num_heads, head_dim], row [num_kv_heads * head_dim] (one widened token),
// inverse [num_heads], offsets [longest].
struct Scratch {
  std::vector<float> query, scores, acc, row, inverse;
  std::vector<int64_t> offsets;  // [longest]: where each token's row starts in the caches
  std::vector<float> chunk;  // [kChunk, head_dim]: a chunk of bfloat16 rows, widened
  std::vector<int64_t> chunk_offsets;  // [kChunk]: i * head_dim
  Scratch(const Layout& l, int64_t longest)
      : query(l.num_heads * l.head_dim), scores(l.num_heads * std::max<int64_t>(longest, 1)),
        acc(l.num_heads * l.head_dim), row(l.num_kv_heads * l.head_dim), inverse(l.num_heads),
        offsets(std::max<int64_t>(longest, 1)), chunk(kChunk * l.head_dim), chunk_offsets(kChunk) {
    for (int64_t i = 0; i < kChunk; ++i) chunk_offsets[i] = i * l.head_dim;
  }
};

// Calls visit(t - first, keys_or_values_of_token_t) for t in [first, seq_len): all kv heads of
// a token are one contiguous row of the cache, read once for every query head.
template <typename T, typename Visit>
inline void for_each_token(const T* cache, const int32_t* table, int64_t first, int64_t seq_len,
                           const Layout& l, float* row, Visit visit) {
  const int64_t width = l.num_kv_heads * l.head_dim;
  for (int64_t b = first / l.block_size, start = b * l.block_size; start < seq_len;
       ++b, start += l.block_size) {
    const T* block = cache + table[b] * l.block_stride;
    const int64_t count = std::min(l.block_size, seq_len - start);
    for (int64_t i = std::max<int64_t>(first - start, 0); i < count; ++i)
      visit(start + i - first, widen(block + i * width, width, row));
  }
}

// All query heads of one sequence over its keys [first, end), any head_dim.
template <typename T>
void attend_sequence_any_dim(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                     int64_t first, int64_t end, const Layout& l, T* out, Scratch& s) {
  const int64_t heads = l.num_heads, dim = l.head_dim, group = heads / l.num_kv_heads;
  const int64_t seq_len = end - first;  // keys attended
  for (int64_t i = 0; i < heads * dim; ++i) s.query[i] = to_float(q[i]) * l.scale;
  float* scores = s.scores.data();
  for_each_token(k_cache, table, first, end, l, s.row.data(), [&](int64_t t, const float* keys) {
    for (int64_t h = 0; h < heads; ++h)
      scores[h * seq_len + t] = dot(s.query.data() + h * dim, keys + (h / group) * dim, dim);
  });
  for (int64_t h = 0; h < heads; ++h) {
    float* row = scores + h * seq_len;
    const float best = *std::max_element(row, row + seq_len);
    float total = 0.f;
    for (int64_t t = 0; t < seq_len; ++t) total += (row[t] = std::exp(row[t] - best));
    const float inverse = 1.f / total;
    for (int64_t t = 0; t < seq_len; ++t) row[t] *= inverse;
  }
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  for_each_token(v_cache, table, first, end, l, s.row.data(), [&](int64_t t, const float* values) {
    for (int64_t h = 0; h < heads; ++h)
      add_scaled(s.acc.data() + h * dim, values + (h / group) * dim, scores[h * seq_len + t], dim);
  });
  for (int64_t i = 0; i < heads * dim; ++i) store(out + i, s.acc[i]);
}

// ---- head_dim a multiple of 8 (bfloat16 rows widened a chunk at a time): 8 keys per vector of
// scores (read once for all the query heads of their kv head), a vector exp, the weighted values summed in registers over
// chunks of tokens that stay in L1. 2.2x faster than the per-token path at head_dim 16, 1.1x at
// 64 (where both wait on memory), the same at 128 (measured on Zen 3, one thread).


typedef int32_t i8 __attribute__((vector_size(32)));

// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in one vector.
inline v8 sum8(const v8 (&a)[8]) {
#if defined(__AVX__)
  const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
  const __m256 t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
  const __m256 t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return (v8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                           _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = sum_lanes(a[i]);
  return out;
#endif
}

// Scores of 8 tokens (rows at cache + offsets[0..7]) against one query head: one vector.
template <typename T>
inline v8 scores8(const float* query, const T* cache, const int64_t* offsets, int64_t dim) {
  v8 acc[8] = {};
  for (int64_t d = 0; d < dim; d += 8) {
    const v8 q = load8(query + d);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] += q * load8(cache + offsets[j] + d);
  }
  return sum8(acc);
}

// out[0..8N) += sum over t of p[t] * values[t][0 .. 8N) (rows at cache + offsets[t]), the sums
// in registers.
template <int N, typename T>
inline void weighted_sum(const float* p, const T* cache, const int64_t* offsets, int64_t count,
                         float* out) {
  v8 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = load8(out + 8 * i);
  for (int64_t t = 0; t < count; ++t) {
    const T* row = cache + offsets[t];
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) acc[i] += p[t] * load8(row + 8 * i);
  }
  for (int i = 0; i < N; ++i) *reinterpret_cast<v8*>(out + 8 * i) = acc[i];
}

template <typename T>
inline void weighted_sum_any(const float* p, const T* cache, const int64_t* offsets, int64_t count,
                             int64_t dim, float* out) {
  for (int64_t d = 0; d < dim;) {  // 8 vectors at a time, then what is left
    const int64_t left = (dim - d) / 8;
    if (left >= 8) weighted_sum<8>(p, cache + d, offsets, count, out + d), d += 64;
    else if (left >= 4) weighted_sum<4>(p, cache + d, offsets, count, out + d), d += 32;
    else if (left >= 2) weighted_sum<2>(p, cache + d, offsets, count, out + d), d += 16;
    else weighted_sum<1>(p, cache + d, offsets, count, out + d), d += 8;
  }
}

// Softmax of one head's scores in place, unnormalised; returns 1 / their sum.
inline float softmax_unnormalised(float* row, int64_t n) {
  const int64_t whole = n / 8 * 8;
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) best = std::max(best, row[t]);
  float total = 0.f;
  v8 sums = {};
  for (int64_t t = 0; t < whole; t += 8) {
    const v8 e = exp8(load8(row + t) - best);
    *reinterpret_cast<v8*>(row + t) = e;
    sums += e;
  }
  for (int64_t t = whole; t < n; ++t) total += (row[t] = std::exp(row[t] - best));
  return 1.f / (total + sum_lanes(sums));
}

// Rows [t0, t0 + count) of one kv head's keys or values as float32 rows: in place for float32
// caches (*offsets: where each starts), widened once into `chunk` for bfloat16 (every query
// head of the kv head reads them; a conversion at each read cost 2.5x float32's time).
template <typename T>
inline const float* chunk_rows(const T* cache, const int64_t* offsets, int64_t count, int64_t dim,
                               float* chunk, const int64_t* chunk_offsets, const int64_t** rows_at) {
  if constexpr (std::is_same<T, float>::value) {
    *rows_at = offsets;
    return cache;
  } else {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t d = 0; d < dim; d += 8)
        *reinterpret_cast<v8*>(chunk + i * dim + d) = load8(cache + offsets[i] + d);
    *rows_at = chunk_offsets;
    return chunk;
  }
}

// Scores of the query heads of kv head `kv` of one sequence (head_dim a multiple of 8), 8 keys at
// a time, chunk by chunk, then their softmax, unnormalised (s.inverse: 1 / each head's sum).
template <typename T>
void group_scores(const T* q, const T* k_cache, int64_t seq_len, int64_t kv, const Layout& l, Scratch& s) {
  const int64_t dim = l.head_dim, group = l.num_heads / l.num_kv_heads;
  const int64_t h0 = kv * group, h1 = h0 + group;
  const int64_t* offsets = s.offsets.data();  // offsets[i]: key first + i
  for (int64_t i = h0 * dim; i < h1 * dim; ++i) s.query[i] = to_float(q[i]) * l.scale;
  float* scores = s.scores.data();  // [heads, seq_len]
  for (int64_t t0 = 0; t0 < seq_len; t0 += kChunk) {
    const int64_t count = std::min(kChunk, seq_len - t0), whole = count / 8 * 8;
    const int64_t* at;
    const float* keys = chunk_rows(k_cache + kv * dim, offsets + t0, count, dim, s.chunk.data(),
                                   s.chunk_offsets.data(), &at);
    for (int64_t t = 0; t < whole; t += 8)
      for (int64_t h = h0; h < h1; ++h)
        *reinterpret_cast<v8*>(scores + h * seq_len + t0 + t) = scores8(s.query.data() + h * dim, keys, at + t, dim);
    for (int64_t t = whole; t < count; ++t)
      for (int64_t h = h0; h < h1; ++h) {
        float total = 0.f;
        for (int64_t d = 0; d < dim; ++d) total += s.query[h * dim + d] * keys[at[t] + d];
        scores[h * seq_len + t0 + t] = total;
      }
  }
  for (int64_t h = h0; h < h1; ++h) s.inverse[h] = softmax_unnormalised(scores + h * seq_len, seq_len);
}

// out's heads of kv head `kv`: the values weighted by group_scores' weights, summed in registers
// over chunks of tokens that stay in L1
template <typename T>
void group_values(const T* v_cache, int64_t seq_len, int64_t kv, const Layout& l, T* out, Scratch& s) {
  const int64_t dim = l.head_dim, group = l.num_heads / l.num_kv_heads;
  const int64_t h0 = kv * group, h1 = h0 + group;
  const float* scores = s.scores.data();
  std::fill(s.acc.begin() + h0 * dim, s.acc.begin() + h1 * dim, 0.f);
  for (int64_t t0 = 0; t0 < seq_len; t0 += kChunk) {
    const int64_t count = std::min(kChunk, seq_len - t0);
    const int64_t* at;
    const float* values = chunk_rows(v_cache + kv * dim, s.offsets.data() + t0, count, dim, s.chunk.data(),
                                     s.chunk_offsets.data(), &at);
    for (int64_t h = h0; h < h1; ++h)
      weighted_sum_any(scores + h * seq_len + t0, values, at, count, dim, s.acc.data() + h * dim);
  }
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t d = 0; d < dim; ++d) store(out + h * dim + d, s.acc[h * dim + d] * s.inverse[h]);
}

// One sequence's query heads of kv heads [kv0, kv1).
template <typename T>
void attend_sequence(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                     int64_t end, const Layout& l, int64_t kv0, int64_t kv1, T* out, Scratch& s) {
  const int64_t first = first_key(end, l), seq_len = end - first;  // keys attended
  if (l.head_dim % 8 != 0) {
    if (kv0 == 0) attend_sequence_any_dim(q, k_cache, v_cache, table, first, end, l, out, s);
    return;  // all its heads at once, by the sequence's first task
  }
  const int64_t width = l.num_kv_heads * l.head_dim;
  for (int64_t t = first; t < end; ++t)
    s.offsets[t - first] = table[t / l.block_size] * l.block_stride + (t % l.block_size) * width;
  // every key of the task's kv heads, then every value: a token's row holds all its kv heads
  for (int64_t kv = kv0; kv < kv1; ++kv) group_scores(q, k_cache, seq_len, kv, l, s);
  for (int64_t kv = kv0; kv < kv1; ++kv) group_values(v_cache, seq_len, kv, l, out, s);
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const Layout& l,
            at::Tensor& out) {
  const int64_t num_seqs = q.size(0), stride = l.num_heads * l.head_dim;
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k_cache.data_ptr<T>();
  const T* v_data = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* out_data = out.data_ptr<T>();
  int64_t longest = num_seqs ? *std::max_element(lens, lens + num_seqs) : 0;
  if (l.sliding_window > 0) longest = std::min(longest, l.sliding_window);
  // tasks: (sequence, kv head), so that one long sequence keeps every thread busy too
  const int64_t kv_heads = l.num_kv_heads;
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(l, longest);
    for (int64_t task = begin; task < end;) {
      const int64_t seq = task / kv_heads, kv0 = task % kv_heads;
      const int64_t kv1 = std::min(kv_heads, kv0 + (end - task));
      attend_sequence<T>(q_data + seq * stride, k_data, v_data, tables + seq * l.max_blocks,
                         lens[seq], l, kv0, kv1, out_data + seq * stride, scratch);
      task += kv1 - kv0;
    }
  });
}

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [seqs, heads, dim], cache 4-d expected");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k and v caches differ in shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "head_dim mismatch or heads not a multiple of kv heads");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "one block table row and one length per sequence");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be 0 (none) or positive");
  const at::Tensor query = q.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty_like(query);
  const Layout layout{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), tables.size(1),
                      k_cache.stride(0), static_cast<float>(scale), sliding_window};
  if (q.scalar_type() == at::kFloat) {
    decode<float>(query, k_cache, v_cache, tables, lens, layout, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode<at::BFloat16>(query, k_cache, v_cache, tables, lens, layout, out);
  } else {
    TORCH_CHECK(false, "paged_attention_decode: float32 or bfloat16 expected, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(conveyor_cpu, m) {
  m.def("paged_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int sliding_window=0) -> Tensor");
  m.impl("paged_attention_decode", c10::DispatchKey::CPU, &paged_attention_decode);
}
