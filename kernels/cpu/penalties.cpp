// The sampler's penalties on CPU, without the torch path's [rows, vocab] temporaries (its oracle:
// tests/test_draw_tempered.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "row_settings.h"

namespace {

using conveyor_rows::floats_of;

// Repetition (prompt and output), frequency and presence (output) penalties, in place on the
// rows of logits [num_rows, vocab] float32 that `rows` names: only the tokens a row has seen
// change, each by the torch path's float32 operations in its order (ops.apply_penalty_inputs,
// bit for bit: no fused multiply-add). The torch path builds eight [rows, vocab] tensors: at 32
// rows of Qwen's vocab the sampler took a median 28-32 ms a step with a penalty, 2.7 without.
// ids: [num_penalised, longest] int64, padded with -1.
__attribute__((optimize("fp-contract=off"))) void penalise_row(float* v, int64_t vocab, const int64_t* prompt,
                                                                 int64_t prompt_len, const int64_t* output,
                                                                 int64_t output_len, float repetition, float frequency,
                                                                 float presence) {
  thread_local std::vector<int32_t> counts, touched;
  thread_local std::vector<uint8_t> seen;
  if (static_cast<int64_t>(seen.size()) < vocab) {
    seen.assign(vocab, 0);
    counts.assign(vocab, 0);
  }
  touched.clear();
  const auto see = [&](int64_t t) {
    if (t < 0 || t >= vocab) return false;
    if (!seen[t]) touched.push_back(static_cast<int32_t>(t));
    seen[t] = 1;
    return true;
  };
  for (int64_t k = 0; k < output_len; ++k)
    if (see(output[k])) ++counts[output[k]];
  for (int64_t k = 0; k < prompt_len; ++k) see(prompt[k]);
  for (int32_t t : touched) {
    float x = v[t];
    x = x > 0.f ? x / repetition : x * repetition;
    const float product = frequency * static_cast<float>(counts[t]);
    x = x - product;
    x = x - presence * (counts[t] > 0 ? 1.f : 0.f);
    v[t] = x;
    seen[t] = 0;
    counts[t] = 0;
  }
}

void apply_penalties_(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& prompt_ids,
                      const at::Tensor& output_ids, const at::Tensor& repetition, const at::Tensor& frequency,
                      const at::Tensor& presence) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.scalar_type() == at::kFloat,
              "apply_penalties_: logits [rows, vocab] float32, contiguous, on CPU");
  const int64_t penalised = rows.numel(), vocab = logits.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kLong && prompt_ids.scalar_type() == at::kLong &&
                  output_ids.scalar_type() == at::kLong && prompt_ids.dim() == 2 && output_ids.dim() == 2 &&
                  prompt_ids.size(0) == penalised && output_ids.size(0) == penalised,
              "apply_penalties_: rows [n] and ids [n, longest] int64");
  const at::Tensor rs = rows.contiguous(), prompts = prompt_ids.contiguous(), outputs = output_ids.contiguous();
  const char* op = "apply_penalties_";
  const std::vector<float> rep = floats_of(repetition, penalised, 1.f, op, "repetition");
  const std::vector<float> freq = floats_of(frequency, penalised, 0.f, op, "frequency");
  const std::vector<float> pres = floats_of(presence, penalised, 0.f, op, "presence");
  const int64_t* r = rs.data_ptr<int64_t>();
  for (int64_t j = 0; j < penalised; ++j)
    TORCH_CHECK(r[j] >= 0 && r[j] < logits.size(0), "apply_penalties_: row ", r[j], " past the logits");
  float* base = logits.data_ptr<float>();
  const int64_t prompt_len = prompts.size(1), output_len = outputs.size(1);
  at::parallel_for(0, penalised, 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j)
      penalise_row(base + r[j] * vocab, vocab, prompts.data_ptr<int64_t>() + j * prompt_len, prompt_len,
                   outputs.data_ptr<int64_t>() + j * output_len, output_len, rep[j], freq[j], pres[j]);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def(
      "apply_penalties_(Tensor(a!) logits, Tensor rows, Tensor prompt_ids, Tensor output_ids, Tensor repetition, "
      "Tensor frequency, Tensor presence) -> ()");
  m.impl("apply_penalties_", c10::DispatchKey::CPU, &apply_penalties_);
}
