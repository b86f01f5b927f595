// In-place centering of many tensors in one call: t <- t - mean(t) along one dim, the mean taken per
// contiguous group of that dim.
//
// CBWC trained by projection applies P = I - 11^T/m twice per optimizer step to each centered tensor
// (its gradient before clipping, the tensor after the optimizer step). In PyTorch that is a mean, a
// subtraction and a copy per tensor; for the dozen small tensors of a small model the dispatcher and
// Python overhead of those ops cost more than their arithmetic (about 1% of a training step of a 64-wide
// GPT). Here it is one call for all of them.
//
// Layout: a contiguous tensor with shape (..., n, ...) centered along dim d, in groups of g elements
// (g = n for the whole dim), is viewed as (outer, g, inner): outer = prod(shape[:d]) * (n / g),
// inner = prod(shape[d+1:]). Each (g, inner) block is centered over its g rows:
//   inner == 1  a contiguous run of g elements: sum, then subtract sum / g.
//   inner > 1   column sums over the g rows of length inner (a row at a time, so the loops run along
//               contiguous memory), then subtract each column's sum / g from its g entries.
// Sums are accumulated in double (float inputs too): the mean's error stays at the rounding of one
// subtraction, whatever g is.
#include "center_cpu.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <vector>

namespace normfold {
namespace {

// Sum of n contiguous elements in double, eight independent accumulators (a single one would serialise
// on the add's latency).
template <typename T>
double sum_contiguous(const T* p, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += static_cast<double>(p[i + k]);
  }
  for (; i < n; ++i) acc[0] += static_cast<double>(p[i]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Center columns [c0, c1) of one (g, inner) block over its g rows (all of it when inner == 1).
template <typename T>
void center_block(T* block, int64_t g, int64_t inner, int64_t c0, int64_t c1, std::vector<double>& acc,
                  std::vector<T>& mean) {
  if (inner == 1) {
    const T m = static_cast<T>(sum_contiguous(block, g) / static_cast<double>(g));
    for (int64_t i = 0; i < g; ++i) block[i] -= m;
    return;
  }
  const int64_t width = c1 - c0;
  acc.assign(width, 0.0);
  for (int64_t r = 0; r < g; ++r) {
    const T* row = block + r * inner + c0;
    for (int64_t j = 0; j < width; ++j) acc[j] += static_cast<double>(row[j]);
  }
  mean.resize(width);
  for (int64_t j = 0; j < width; ++j) mean[j] = static_cast<T>(acc[j] / static_cast<double>(g));
  for (int64_t r = 0; r < g; ++r) {
    T* row = block + r * inner + c0;
    for (int64_t j = 0; j < width; ++j) row[j] -= mean[j];
  }
}

constexpr int64_t kChunkColumns = 512;      // columns per task of a large matrix centered along dim 0
constexpr int64_t kGrainElements = 1 << 16;  // below this much work per task, threads cost more than they save

template <typename T>
void center_one(at::Tensor& t, int64_t dim, int64_t group) {
  if (t.numel() == 0) return;
  const int64_t n = t.size(dim);
  const int64_t g = group > 0 ? group : n;
  int64_t inner = 1;
  for (int64_t k = dim + 1; k < t.dim(); ++k) inner *= t.size(k);
  const int64_t blocks = t.numel() / (g * inner);
  T* base = t.data_ptr<T>();
  const int64_t chunks = inner == 1 ? 1 : (inner + kChunkColumns - 1) / kChunkColumns;
  const int64_t chunk = inner == 1 ? 1 : (inner + chunks - 1) / chunks;
  const int64_t task_elements = g * (inner == 1 ? 1 : chunk);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(task_elements, 1));
  at::parallel_for(0, blocks * chunks, grain, [&](int64_t begin, int64_t end) {
    std::vector<double> acc;
    std::vector<T> mean;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, c = task % chunks;
      const int64_t c0 = inner == 1 ? 0 : c * chunk;
      center_block<T>(base + b * g * inner, g, inner, c0, std::min(inner, c0 + chunk), acc, mean);
    }
  });
}

}  // namespace

std::vector<int64_t> center_(std::vector<at::Tensor> tensors, const std::vector<int64_t>& dims,
                             const std::vector<std::optional<int64_t>>& groups) {
  TORCH_CHECK_VALUE(tensors.size() == dims.size() && dims.size() == groups.size(),
                    "center_: expected as many dims and groups as tensors, got ", tensors.size(), " tensors, ",
                    dims.size(), " dims, ", groups.size(), " groups");
  // check every argument before changing anything (the messages are normfold.ops.centering's)
  std::vector<int64_t> dim(tensors.size()), group(tensors.size()), skipped;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t rank = t.dim();
    TORCH_CHECK_VALUE(dims[i] >= -rank && dims[i] < rank, "dim must be in [", -rank, ", ", rank, ") for a ", rank,
                      "-D tensor, got ", dims[i]);
    dim[i] = dims[i] < 0 ? dims[i] + rank : dims[i];
    const int64_t n = t.size(dim[i]);
    TORCH_CHECK_VALUE(!groups[i].has_value() || (*groups[i] > 0 && n % *groups[i] == 0),
                      "group must be a positive divisor of the size ", n, " of dim ", dim[i], ", got ",
                      groups[i].has_value() ? *groups[i] : 0);
    group[i] = groups[i].value_or(0);
    TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(), "center_: tensor ", i,
                " is an inference tensor: an in-place update to it needs inference_mode");
    const bool plain = t.device().is_cpu() && t.is_contiguous() &&
                       (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
    if (!plain) skipped.push_back(static_cast<int64_t>(i));
  }
  size_t next_skipped = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (next_skipped < skipped.size() && skipped[next_skipped] == static_cast<int64_t>(i)) {
      ++next_skipped;
      continue;
    }
    tensors[i].unsafeGetTensorImpl()->bump_version();  // an in-place write, as autograd's checks must see it
    if (tensors[i].scalar_type() == at::kFloat) {
      center_one<float>(tensors[i], dim[i], group[i]);
    } else {
      center_one<double>(tensors[i], dim[i], group[i]);
    }
  }
  return skipped;
}

}  // namespace normfold
