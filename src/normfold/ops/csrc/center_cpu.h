// In-place centering of many tensors in one call (center_cpu.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace normfold {

// t <- t - mean(t) along dims[i] (negative counts from the end) for every tensors[i], the mean per contiguous
// groups[i] elements of that dim (none: the whole dim). Every dim and group is checked before any tensor changes
// (c10::ValueError), and so is that no inference tensor is updated outside inference_mode. Returns the indices
// of the tensors left for the caller: those not on the CPU, not contiguous, or of another dtype than
// float32/float64.
std::vector<int64_t> center_(std::vector<at::Tensor> tensors, const std::vector<int64_t>& dims,
                             const std::vector<std::optional<int64_t>>& groups);

}  // namespace normfold
