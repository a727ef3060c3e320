// The CPU fast path of five consistent kernels (true_on_policy/kernels/ops.py is the specification).
//
// Each function computes exactly the bits of its torch code in ops.py, with one C++ call instead of
// 10-50 Python-dispatched ops: the same correctly rounded fp32 + - * / in the same order, torch's own
// kernels where its bits are not IEEE's (sqrt and exp are MKL VML's; sqrt is 0.7 ulp off on some
// inputs; exp is called directly where native.exp_is_torchs checked it), at::bmm for the linears, and
// for attention's products the fma chain MKL's GEMM computes on this path (checked at load:
// native.fma_chain_lib); bf16 linears compute those chains on AVX512-BF16's dot-product instruction
// (checked at load: native.bf16_dot_lib). Built with -ffp-contract=off and without -ffast-math: no other
// FMA contraction, no reassociation.
//
// One source per op family (norms, activation, linear, moe, attention, gated_delta, gated_delta_layer), each
// registering its own functions (library.h); this one holds the module and the library's own functions.
#include "bf16_dot.h"
#include "library.h"

namespace {

bool use_vml_exp(bool on) {
  g_vml_exp = on && VMSEXP_ != nullptr;
  return g_vml_exp;
}

// exp_in_place on a copy of a 1-d fp32 tensor (what native.exp_is_torchs compares with torch.exp).
at::Tensor exp_fp32(const at::Tensor& x) {
  check_cpu_float(x, "exp_fp32");
  auto out = x.contiguous().clone();
  exp_in_place(out.data_ptr<float>(), out.numel());
  return out;
}

bool bf16_dot_built() { return kDotBuilt; }

}  // namespace

// The number of threads an at::parallel_for over n items runs on: 1 in a library built without OpenMP,
// whose at::parallel_for (header-only) is then a serial loop.
int64_t parallel_threads(int64_t n) {
  std::atomic<int64_t> chunks{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { ++chunks; });
  return chunks.load();
}

// The constants the ops' dispatch reads (native.constants), by name: the C++ is their one source.
std::map<std::string, int64_t> constants() { return {{"dot_group", kDotGroup}}; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("parallel_threads", &parallel_threads, "threads an at::parallel_for over n items runs on");
  m.def("constants", &constants, "the library's layout constants the ops' dispatch reads, by name");
  m.def("bf16_dot_built", &bf16_dot_built, "whether linear's dot path (AVX512-BF16) was compiled");
  m.def("use_vml_exp", &use_vml_exp, "use VML's exp (checked to be torch.exp's bits) where it is linked");
  m.def("exp_fp32", &exp_fp32, "exp of an fp32 tensor as the fused attention computes it");
  register_norms(m);
  register_activation(m);
  register_linear(m);
  register_moe(m);
  register_attention(m);
  register_gated_delta(m);
  register_gated_delta_layer(m);
}
