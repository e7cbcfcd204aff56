// One decoder layer of a decode step (Llama, Qwen2, Mistral; Gemma 3 in gemma_decode_layer) in one
// call: the same ops, in the same order, as the layer over runtime/models/layers.py's modules
// (runtime/models/llama.py's, gemma3.py's), called through the dispatcher from here instead of
// from Python. The projections take the GGUF matmul the modules would take at this step's row
// count (`matmul`: quant_dot_int8 or quant_dot for a few rows, quant_gemm_int8, quant_gemm_int16
// or quant_gemm for a full batch; runtime/models/cpu_kernels.py decides). A SmolLM2 decode step
// makes about 25 small calls a layer; from Python each costs microseconds of interpreter and
// binding, which came to a third of the step (measured: 5-6 ms of 13-17). The results are bit for
// bit the unfused layer's (tests/test_decode_layer.py): every number comes from the same kernels.
//
// Shapes (T tokens, all decode queries; H heads, KV kv heads, D head_dim):
//   x [T, hidden], residual [T, hidden] or none (the first layer), in the model's dtype
//   a projection: its parts' GGUF blocks [rows_i, row_bytes_i] uint8 and their ggml types; the
//     parts' outputs side by side make it (q/k/v, gate/up: fused at load)
//   cos, sin [T, 1, D] (kernels/reference.py's RotaryPlan); k/v cache [blocks, block_size, KV, D]
//   slots [T] int64; block_tables [T, max_blocks] int32; seq_lens [T] int32
//   returns (the MLP's output [T, hidden], x + residual before the post-attention norm's sum)

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

using Tensor = at::Tensor;

template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Matmul = c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t)>;

// the GGUF matmul of that name: every one takes (x, blocks, ggml type, out, in)
const Matmul& matmul_named(c10::string_view name) {
  using Signature = Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t);
  static const Matmul dot = typed_op<Signature>("conveyor_cpu::quant_dot");
  static const Matmul floats = typed_op<Signature>("conveyor_cpu::quant_matmul");
  static const Matmul int8 = typed_op<Signature>("conveyor_cpu::quant_gemm_int8");
  static const Matmul int8_dots = typed_op<Signature>("conveyor_cpu::quant_dot_int8");
  static const Matmul int16 = typed_op<Signature>("conveyor_cpu::quant_gemm_int16");
  static const Matmul tiles = typed_op<Signature>("conveyor_cpu::quant_gemm");
  if (name == "quant_dot") return dot;
  if (name == "quant_matmul") return floats;
  if (name == "quant_gemm_int8") return int8;
  if (name == "quant_dot_int8") return int8_dots;
  if (name == "quant_gemm_int16") return int16;
  TORCH_CHECK(name == "quant_gemm", "decode_layer: no GGUF matmul named ", name);
  return tiles;
}

std::tuple<Tensor, Tensor> rms_norm(const Tensor& x, const Tensor& weight, double eps,
                                    const c10::optional<Tensor>& residual) {
  static const auto op = typed_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, double,
                                                             const c10::optional<Tensor>&)>("conveyor_cpu::rms_norm");
  auto [out, sum] = op.call(x, weight, eps, residual);
  return {out, residual ? sum : x};  // without residual, x is the sum
}

// x [T, in] @ the projection's parts, side by side, plus the bias where there is one
Tensor project(const Matmul& matmul, const Tensor& x, const std::vector<Tensor>& parts, c10::IntArrayRef types,
               const c10::optional<Tensor>& bias) {
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "decode_layer: one ggml type per part");
  const int64_t in = x.size(1);
  std::vector<Tensor> outs;
  outs.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) outs.push_back(matmul.call(x, parts[i], types[i], parts[i].size(0), in));
  Tensor y = outs.size() == 1 ? outs[0] : at::cat(outs, -1);
  return bias ? y + bias->to(y.scalar_type()) : y;
}

struct Projection {
  std::vector<Tensor> parts;
  c10::IntArrayRef types;
};

// q or k [T, heads, D] (a view of the q/k/v projection): each head's vector normalised, as
// Gemma's q/k norms (runtime/models/layers.py's RMSNorm over kernels/native_layer_ops.py). Gemma's
// norms, (1 + w) folded at load in float32, take rms_norm as any: over bfloat16 rows the kernel
// computes in float32 and rounds once (kernels/cpu/layer_ops.cpp).
Tensor head_norm(const Tensor& x, const Tensor& folded, double eps) {
  auto [out, unused] = rms_norm(x.contiguous().reshape({-1, x.size(-1)}), folded, eps, c10::nullopt);
  return out.view(x.sizes());
}

struct QkNorms {  // Gemma's; none for Llama-style layers
  c10::optional<Tensor> q, k;
  double eps = 0.0;
};

Tensor attention(const Matmul& matmul, const Tensor& h, const Projection& qkv, const c10::optional<Tensor>& qkv_bias,
                 const Projection& o, const QkNorms& norms, int64_t heads, int64_t kv_heads, int64_t dim,
                 const Tensor& cos, const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                 const Tensor& block_tables, const Tensor& seq_lens, double scale, int64_t sliding_window) {
  static const auto rotary = typed_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                 const Tensor&)>("conveyor_cpu::rotary_with_plan");
  static const auto store = typed_op<void(const Tensor&, const Tensor&, Tensor, Tensor, const Tensor&)>(
      "conveyor_cpu::store_kvcache");
  static const auto decode = typed_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                             const Tensor&, double, int64_t)>("conveyor_cpu::paged_attention_decode");
  const int64_t tokens = h.size(0), q_size = heads * dim, kv_size = kv_heads * dim;
  const Tensor mixed = project(matmul, h, qkv.parts, qkv.types, qkv_bias);  // [T, q_size + 2 kv_size]
  Tensor q = mixed.narrow(1, 0, q_size).view({tokens, heads, dim});
  Tensor k = mixed.narrow(1, q_size, kv_size).view({tokens, kv_heads, dim});
  const Tensor v = mixed.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, dim});
  if (norms.q) {
    q = head_norm(q, *norms.q, norms.eps);
    k = head_norm(k, *norms.k, norms.eps);
  }
  auto [q_rot, k_rot] = rotary.call(q, k, cos, sin);
  store.call(k_rot, v, k_cache, v_cache, slots);
  const Tensor out = decode.call(q_rot, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window);
  return project(matmul, out.reshape({tokens, q_size}), o.parts, o.types, c10::nullopt);
}

// down(act(gate) * up), gate and up the two halves of one projection [T, 2 I]; act SiLU or gelu-tanh
Tensor gated_mlp(const Matmul& matmul, const Tensor& h, const Projection& gate_up, const Projection& down,
                 bool gelu_tanh) {
  static const auto silu_and_mul = typed_op<Tensor(const Tensor&)>("conveyor_cpu::silu_and_mul");
  const Tensor both = project(matmul, h, gate_up.parts, gate_up.types, c10::nullopt);  // a new tensor
  if (!gelu_tanh) return project(matmul, silu_and_mul.call(both), down.parts, down.types, c10::nullopt);
  const int64_t intermediate = both.size(1) / 2;
  const Tensor gate = both.narrow(1, 0, intermediate), up = both.narrow(1, intermediate, intermediate);
  return project(matmul, at::gelu(gate, "tanh") * up, down.parts, down.types, c10::nullopt);
}

std::tuple<Tensor, Tensor> decode_layer(
    const Tensor& x, const c10::optional<Tensor>& residual, const Tensor& input_norm, const Tensor& post_norm,
    double eps, std::vector<Tensor> qkv_parts, c10::IntArrayRef qkv_types, const c10::optional<Tensor>& qkv_bias,
    std::vector<Tensor> o_parts, c10::IntArrayRef o_types, std::vector<Tensor> gate_up_parts,
    c10::IntArrayRef gate_up_types, std::vector<Tensor> down_parts, c10::IntArrayRef down_types, int64_t heads,
    int64_t kv_heads, int64_t head_dim, const Tensor& cos, const Tensor& sin, const Tensor& k_cache,
    const Tensor& v_cache, const Tensor& slots, const Tensor& block_tables, const Tensor& seq_lens, double scale,
    int64_t sliding_window, c10::string_view matmul_name) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "decode_layer: x [tokens, hidden] on CPU");
  const Matmul& matmul = matmul_named(matmul_name);
  auto [h, sum] = rms_norm(x, input_norm, eps, residual);
  const Tensor attended =
      attention(matmul, h, {std::move(qkv_parts), qkv_types}, qkv_bias, {std::move(o_parts), o_types}, QkNorms{},
                heads, kv_heads, head_dim, cos, sin, k_cache, v_cache, slots, block_tables, seq_lens, scale,
                sliding_window);
  auto [h2, sum2] = rms_norm(attended, post_norm, eps, sum);
  return {gated_mlp(matmul, h2, {std::move(gate_up_parts), gate_up_types}, {std::move(down_parts), down_types},
                    /*gelu_tanh=*/false),
          sum2};
}

// Gemma 3's layer (runtime/models/gemma3.py): four unit-offset norms, two around attention and two
// around the MLP, q/k norms before rope, a gelu-tanh gated MLP. norms: input, post-attention,
// pre-feedforward and post-feedforward, each (1 + w) in float32.
std::tuple<Tensor, Tensor> gemma_decode_layer(
    const Tensor& x, const c10::optional<Tensor>& residual, std::vector<Tensor> norms, const Tensor& q_norm,
    const Tensor& k_norm, double eps, std::vector<Tensor> qkv_parts, c10::IntArrayRef qkv_types,
    std::vector<Tensor> o_parts, c10::IntArrayRef o_types, std::vector<Tensor> gate_up_parts,
    c10::IntArrayRef gate_up_types, std::vector<Tensor> down_parts, c10::IntArrayRef down_types, int64_t heads,
    int64_t kv_heads, int64_t head_dim, const Tensor& cos, const Tensor& sin, const Tensor& k_cache,
    const Tensor& v_cache, const Tensor& slots, const Tensor& block_tables, const Tensor& seq_lens, double scale,
    int64_t sliding_window, c10::string_view matmul_name) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "gemma_decode_layer: x [tokens, hidden] on CPU");
  TORCH_CHECK(norms.size() == 4, "gemma_decode_layer: four norms");
  const Matmul& matmul = matmul_named(matmul_name);
  auto [h, sum] = rms_norm(x, norms[0], eps, residual);
  const Tensor attended =
      attention(matmul, h, {std::move(qkv_parts), qkv_types}, c10::nullopt, {std::move(o_parts), o_types},
                QkNorms{q_norm, k_norm, eps}, heads, kv_heads, head_dim, cos, sin, k_cache, v_cache, slots,
                block_tables, seq_lens, scale, sliding_window);
  auto [h2, unused] = rms_norm(attended, norms[1], eps, c10::nullopt);
  auto [h3, sum2] = rms_norm(h2, norms[2], eps, sum);
  const Tensor mlp = gated_mlp(matmul, h3, {std::move(gate_up_parts), gate_up_types},
                               {std::move(down_parts), down_types}, /*gelu_tanh=*/true);
  auto [out, unused2] = rms_norm(mlp, norms[3], eps, c10::nullopt);
  return {out, sum2};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def(
      "decode_layer(Tensor x, Tensor? residual, Tensor input_norm, Tensor post_norm, float eps, "
      "Tensor[] qkv_parts, int[] qkv_types, Tensor? qkv_bias, Tensor[] o_parts, int[] o_types, "
      "Tensor[] gate_up_parts, int[] gate_up_types, Tensor[] down_parts, int[] down_types, int heads, "
      "int kv_heads, int head_dim, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slots, Tensor block_tables, Tensor seq_lens, float scale, int sliding_window, str matmul) -> "
      "(Tensor, Tensor)");
  m.impl("decode_layer", c10::DispatchKey::CPU, &decode_layer);
  m.def(
      "gemma_decode_layer(Tensor x, Tensor? residual, Tensor[] norms, Tensor q_norm, Tensor k_norm, float eps, "
      "Tensor[] qkv_parts, int[] qkv_types, Tensor[] o_parts, int[] o_types, Tensor[] gate_up_parts, "
      "int[] gate_up_types, Tensor[] down_parts, int[] down_types, int heads, int kv_heads, int head_dim, "
      "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor block_tables, "
      "Tensor seq_lens, float scale, int sliding_window, str matmul) -> (Tensor, Tensor)");
  m.impl("gemma_decode_layer", c10::DispatchKey::CPU, &gemma_decode_layer);
}
