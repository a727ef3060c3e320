// The library's norms: ops.fixed_sum and ops.rms_norm (inference), each row's sum the fixed pairwise tree.
#include "common.h"
#include "fixed_tree.h"
#include "library.h"

namespace {
using fixed_tree::pow2_at_least;
using fixed_tree::tree_sum;
}  // namespace

// ops.fixed_sum: the sum over the last dim (keepdim) as the fixed pairwise tree.
at::Tensor fixed_sum(const at::Tensor& x_in) {
  check_cpu_float(x_in, "fixed_sum");
  const auto x = x_in.contiguous();
  const int64_t n = x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = 1;
  auto out = at::empty(sizes, x.options());
  const int64_t rows = out.numel(), width = pow2_at_least(n);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for_rows(rows, width, [&](int64_t lo, int64_t hi, float* buf) {
    for (int64_t r = lo; r < hi; ++r) {
      std::copy(src + r * n, src + (r + 1) * n, buf);
      dst[r] = tree_sum(buf, n, width);
    }
  });
  return out;
}

// ops.rms_norm (inference): weight * (h / sqrt(fixed_sum(h*h) / n + eps)).to(x.dtype), h = fp32 x.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu(), "rms_norm: needs a CPU tensor, got one on ", x.device());
  const auto h = x.to(at::kFloat).contiguous();
  const int64_t n = h.size(-1), width = pow2_at_least(n);
  auto sizes = h.sizes().vec();
  sizes.back() = 1;
  auto root = at::empty(sizes, h.options());
  const int64_t rows = root.numel();
  const float* src = h.data_ptr<float>();
  float* rt = root.data_ptr<float>();
  const float fn = static_cast<float>(n), feps = static_cast<float>(eps);
  for_rows(rows, width, [&](int64_t lo, int64_t hi, float* buf) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* row = src + r * n;
      for (int64_t i = 0; i < n; ++i) buf[i] = row[i] * row[i];
      rt[r] = tree_sum(buf, n, width) / fn + feps;
    }
  });
  root.sqrt_();  // torch's sqrt kernel, as ops.rms_norm calls it: its bits, not the IEEE square root's
  auto normed = at::empty_like(h);
  float* dst = normed.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      for (int64_t i = 0; i < n; ++i) dst[r * n + i] = src[r * n + i] / rt[r];
  });
  return weight * normed.to(x.scalar_type());  // torch's cast (round to nearest even) and promotion
}

void register_norms(pybind11::module& m) {
  m.def("fixed_sum", &fixed_sum, "ops.fixed_sum for an fp32 CPU tensor");
  m.def("rms_norm", &rms_norm, "ops.rms_norm (inference) for a CPU tensor");
}
