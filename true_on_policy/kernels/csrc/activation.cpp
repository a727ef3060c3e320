// The library's activation: ops.silu_mul (inference) in one pass.
#include "common.h"
#include "library.h"

// ops.silu_mul (inference) in one pass: silu_mul_run over runs of each row. Gate and up are read through
// their row strides (vLLM hands in halves of one gate_up row).
template <typename T>
void silu_mul_rows(const T* gate, int64_t gate_row, const T* up, int64_t up_row, T* out, int64_t rows, int64_t n) {
  const int64_t runs = (n + kSiluRun - 1) / kSiluRun;
  at::parallel_for(0, rows * runs, 2, [&](int64_t lo, int64_t hi) {
    for (int64_t unit = lo; unit < hi; ++unit) {
      const int64_t r = unit / runs, first = (unit % runs) * kSiluRun;
      silu_mul_run(gate + r * gate_row + first, up + r * up_row + first, out + r * n + first,
                   std::min(kSiluRun, n - first));
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_in, const at::Tensor& up_in) {
  TORCH_CHECK(gate_in.sizes() == up_in.sizes() && gate_in.scalar_type() == up_in.scalar_type() &&
                  (gate_in.scalar_type() == at::kFloat || gate_in.scalar_type() == at::kBFloat16) && gate_in.dim() >= 1,
              "silu_mul: gate and up of one shape and dtype (fp32 or bf16), got ", gate_in.sizes(), " ",
              gate_in.scalar_type(), " and ", up_in.sizes(), " ", up_in.scalar_type());
  const int64_t n = gate_in.size(-1), rows = n ? gate_in.numel() / n : 0;
  // [rows, n] views with unit inner stride where the leading dims allow, else contiguous copies
  auto as_rows = [&](const at::Tensor& x) {
    auto view = x.dim() == 2 ? x : (x.is_contiguous() ? x.reshape({rows, n}) : x.contiguous().view({rows, n}));
    return view.stride(1) == 1 ? view : view.contiguous();
  };
  const auto gate = as_rows(gate_in), up = as_rows(up_in);
  auto out = at::empty(up_in.sizes(), up_in.options());
  if (rows == 0 || n == 0) return out;
  if (up.scalar_type() == at::kFloat)
    silu_mul_rows(gate.data_ptr<float>(), gate.stride(0), up.data_ptr<float>(), up.stride(0), out.data_ptr<float>(),
                  rows, n);
  else
    silu_mul_rows(gate.data_ptr<at::BFloat16>(), gate.stride(0), up.data_ptr<at::BFloat16>(), up.stride(0),
                  out.data_ptr<at::BFloat16>(), rows, n);
  return out;
}

void register_activation(pybind11::module& m) {
  m.def("silu_mul", &silu_mul, "ops.silu_mul (inference) for CPU tensors");
}
