// A sampling op's per-row settings (temperature, min-p, penalties): shared by sampling.cpp and
// penalties.cpp.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace conveyor_rows {

// a [rows] float32 setting's values, or `otherwise` for each row where it is absent
inline std::vector<float> floats_of(const c10::optional<at::Tensor>& t, int64_t rows, float otherwise, const char* op,
                                    const char* name) {
  if (!t) return std::vector<float>(rows, otherwise);
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == rows, op, ": ", name, " [rows] float32");
  const at::Tensor c = t->contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + rows);
}

}  // namespace conveyor_rows
