// The library's linears: ops._padded_linear_forward on its three paths (the torch code's aten calls, the fma
// chains, the bf16 dot product), the weight packs they read, and the products native.py checks at load.
#include "bf16_dot.h"
#include "fma_chain.h"
#include "library.h"

namespace {

at::Tensor pack_chain_weight(const at::Tensor& weight_in, int64_t parts) {
  const auto weight = weight_in.contiguous();
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && parts >= 1 &&
                  weight.size(0) % parts == 0,
              "pack_chain_weight: an fp32 or bf16 weight [N, K] with N a multiple of ", parts, " parts, got ",
              weight.sizes(), " ", dtype);
  const int64_t K = weight.size(1), rows = weight.size(0) / parts, groups = (rows + kGroupRows - 1) / kGroupRows;
  auto pack = at::empty({parts, groups, kMaxBlocks, K, kLanes}, weight.options());
  for_each_item(parts * groups, [] { return 0; }, [&](int, int64_t item) {
    const int64_t q = item / groups, r0 = q * rows + item % groups * kGroupRows;
    const int64_t nn = std::min(kGroupRows, (q + 1) * rows - r0);
    if (dtype == at::kFloat)
      chain_pack_group(weight.data_ptr<float>() + r0 * K, nn, K, pack.data_ptr<float>() + item * K * kGroupRows);
    else
      chain_pack_group(weight.data_ptr<at::BFloat16>() + r0 * K, nn, K,
                       pack.data_ptr<at::BFloat16>() + item * K * kGroupRows);
  });
  return pack;
}

#if defined(__AVX512BF16__)
std::vector<at::Tensor> pack_dot_weight(const at::Tensor& weight_in) {
  TORCH_CHECK(weight_in.scalar_type() == at::kBFloat16 && weight_in.dim() == 2 && weight_in.size(1) % 2 == 0,
              "pack_dot_weight: a bf16 weight [N, K] with K even, got ", weight_in.scalar_type(), " ", weight_in.sizes());
  const auto weight = weight_in.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1), pairs = K / 2;
  const int64_t group = kDotGroup, groups = (N + group - 1) / group;
  auto panels = at::zeros({groups, kDotPanels * pairs * kLanes}, weight.options().dtype(at::kInt));
  auto exponents = at::empty({groups, 2}, weight.options().dtype(at::kInt));
  const auto* w32 = reinterpret_cast<const uint32_t*>(weight.data_ptr<at::BFloat16>());
  auto* p = reinterpret_cast<uint32_t*>(panels.data_ptr<int32_t>());
  int32_t* e = exponents.data_ptr<int32_t>();
  at::parallel_for(0, groups, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t n0 = b * group;
      const Exponents we = pack_group(w32, pairs, n0, std::min(group, N - n0), p + b * kDotPanels * pairs * kLanes);
      e[2 * b] = we.lo, e[2 * b + 1] = we.hi;
    }
  });
  return {panels, exponents};
}
#else
std::vector<at::Tensor> pack_dot_weight(const at::Tensor&) {
  TORCH_CHECK(false, "pack_dot_weight: this library was built without AVX512-BF16 (bf16_dot_built() is False)");
}
#endif

// The dot path's product of bf16 x [M, K] and weight [N, K] with (guarded) or without dot_exact's guard.
at::Tensor dot_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t k_chunk, int64_t leaves, bool guarded) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  weight.dim() == 2 && x.size(1) == weight.size(1) && (x.size(1) / leaves) % 2 == 0,
              "dot_matmul: bf16 x [M, K] and weight [N, K], even leaves");
  auto out = at::empty({x.size(0), weight.size(0)}, x.options().dtype(at::kFloat));
  dot_product_tree(x.contiguous(), weight.contiguous(), k_chunk, leaves, LinearOut{out.data_ptr<float>(), false, nullptr},
                   guarded);
  return out;
}

}  // namespace

// A linear's input x [..., k] as rows [m, k], and the sizes [..., n] of its output.
struct LinearRows {
  at::Tensor rows;
  int64_t m, k, n;
  std::vector<int64_t> out_sizes;
};

LinearRows linear_rows(const at::Tensor& x, const at::Tensor& weight, int64_t leaves) {
  const int64_t k = x.size(-1), n = weight.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  LinearRows r{x.reshape({-1, k}), 0, k, n, std::move(out_sizes)};
  r.m = r.rows.size(0);
  TORCH_CHECK(r.m == 0 || (leaves >= 1 && (leaves & (leaves - 1)) == 0 && k % leaves == 0), "linear: K = ", k,
              " does not split into ", leaves, " equal leaves (a power of two)");
  return r;
}

// ops.linear_epilogue on the fp32 products out [m, n], shaped as the input's rows.
at::Tensor linear_epilogue(at::Tensor out, const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                           const LinearRows& r) {
  if (bias.has_value() && bias->defined()) out = out + bias->to(at::kFloat);
  if (out_dtype != at::kFloat) out = out.to(out_dtype);
  return out.view(r.out_sizes);
}

// ops._padded_linear_forward on the dot path (native.bf16_dot_lib checked it): bf16 x @ weight.T read as bf16
// by the dot-product instruction -- the fma chains of the widened operands -- the epilogue written by the kernel.
at::Tensor linear_dot(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      at::ScalarType out_dtype, int64_t k_chunk, int64_t leaves,
                      const c10::optional<std::vector<at::Tensor>>& pack) {
  const LinearRows r = linear_rows(x, weight, leaves);
  if (r.m == 0) return at::zeros(r.out_sizes, x.options().dtype(out_dtype));
  TORCH_CHECK(r.rows.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  (r.k / leaves) % 2 == 0 && k_chunk % 2 == 0,
              "linear: the dot path takes bf16 operands whose leaves and chunks are even, got ", r.rows.scalar_type(),
              " x ", weight.scalar_type(), ", K = ", r.k, ", ", leaves, " leaves, chunk ", k_chunk);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "linear: the dot path writes fp32 or bf16, got ",
              out_dtype);
  const auto b = bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == r.n, "linear: a bias of ", b.numel(), " for ", r.n, " output features");
  auto out = at::empty({r.m, r.n}, x.options().dtype(out_dtype));
  const DotPack packed = pack ? dot_pack_of(*pack, r.n, r.k) : DotPack{};
  dot_product_tree(r.rows.contiguous(), weight.contiguous(), k_chunk, leaves,
                   LinearOut{out.data_ptr(), out_dtype == at::kBFloat16, b.defined() ? b.data_ptr<float>() : nullptr},
                   true, pack ? &packed : nullptr);
  return out.view(r.out_sizes);
}

// The chain path's products for more rows than one block of lanes: the input rows times the weight transposed
// once per call into column-block panels, in items of (row block, column block).
at::Tensor chain_many_rows(const LinearRows& r, const at::Tensor& weight, int64_t k_chunk, int64_t leaves) {
  const int64_t m = r.m, k = r.k, n = r.n, n16 = round_up(n, kLanes);
  const auto xf = r.rows.to(at::kFloat).contiguous();
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const auto w = bf16 ? weight.contiguous() : weight.to(at::kFloat).contiguous();
  constexpr int64_t kBlockRows = 16 * kMaxRows, kBlockCols = kMaxBlocks * kLanes;
  const int64_t col_blocks = (n16 + kBlockCols - 1) / kBlockCols;
  // weight^T as [k, 16] strips (weight_panel, bf16 widened), a column block's 4 strips together: a tile reads
  // each strip as one stream (chain_pack_group's layout), where rows of the whole transpose would alias in L1
  auto wt = at::empty({col_blocks, kMaxBlocks, k, kLanes}, xf.options());
  float* ws = wt.data_ptr<float>();
  for_each_item(n16 / kLanes, [] { return 0; }, [&](int, int64_t p) {
    const int64_t row = p * kLanes, rows_in = std::min(kLanes, n - row);
    float* panel = ws + p * k * kLanes;
    if (bf16)
      weight_panel(w.data_ptr<at::BFloat16>() + row * k, k, rows_in, k, panel, kLanes);
    else
      weight_panel(w.data_ptr<float>() + row * k, k, rows_in, k, panel, kLanes);
  });
  auto out = at::empty({m, n16}, xf.options());
  const float* xs = xf.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for_each_item((m + kBlockRows - 1) / kBlockRows * col_blocks, [] { return 0; }, [&](int, int64_t item) {
    const int64_t r0 = item / col_blocks * kBlockRows, b = item % col_blocks, n0 = b * kBlockCols;
    fma_chain_tree_rows(xs + r0 * k, k, 1, std::min(kBlockRows, m - r0), ws + b * k * kBlockCols, kLanes, k,
                        std::min(kBlockCols, n16 - n0), k_chunk, leaves, o + r0 * n16 + n0, n16, k * kLanes);
  });
  return n16 != n ? out.narrow(1, 0, n) : out;
}

// The chain path's products for up to chain_pack_rows rows against the weight's chain pack (few_rows_times_group).
at::Tensor chain_packed_rows(const LinearRows& r, const at::Tensor& weight, int64_t k_chunk, int64_t leaves,
                             const std::vector<at::Tensor>& pack) {
  const int64_t m = r.m, k = r.k, n = r.n, groups = (n + kGroupRows - 1) / kGroupRows;
  const auto& p = pack[0];
  TORCH_CHECK(pack.size() == 1 && p.scalar_type() == weight.scalar_type() && p.is_contiguous() &&
                  p.sizes() == at::IntArrayRef({1, groups, kMaxBlocks, k, kLanes}),
              "linear: a chain pack must be pack_chain_weight(weight, 1) of the weight ", weight.sizes(), " ",
              weight.scalar_type(), ", got ", pack.size(), " tensors, the first ", p.sizes(), " ", p.scalar_type());
  const auto xf = r.rows.to(at::kFloat).contiguous();
  auto out = at::empty({m, n}, xf.options());
  for_each_item(groups, [] { return std::vector<float>(); }, [&](std::vector<float>& sums, int64_t g) {
    const int64_t nn = std::min(kGroupRows, n - g * kGroupRows), offset = g * k * kGroupRows;
    float* c = out.data_ptr<float>() + g * kGroupRows;
    if (p.scalar_type() == at::kFloat)
      few_rows_times_group(xf.data_ptr<float>(), k, m, p.data_ptr<float>() + offset, k, nn, k_chunk, leaves, c, n, sums);
    else
      few_rows_times_group(xf.data_ptr<float>(), k, m, p.data_ptr<at::BFloat16>() + offset, k, nn, k_chunk, leaves, c,
                           n, sums);
  });
  return out;
}

// The chain path's products for up to kFewRows rows broadcast against the weight's panels (few_rows_times_weight).
at::Tensor chain_few_rows(const LinearRows& r, const at::Tensor& weight, int64_t k_chunk, int64_t leaves) {
  const int64_t m = r.m, k = r.k, n = r.n;
  // a bf16 weight is widened into the panels: an fp32 copy of it would cost more than the products
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const auto xf = r.rows.to(at::kFloat).contiguous(), w = bf16 ? weight.contiguous() : weight.to(at::kFloat).contiguous();
  auto out = at::empty({m, n}, xf.options());
  constexpr int64_t kFeatures = kMaxBlocks * kLanes;  // output features per item: one panel group
  for_each_item((n + kFeatures - 1) / kFeatures, [] { return PanelScratch(); }, [&](PanelScratch& scratch, int64_t item) {
    const int64_t n0 = item * kFeatures, nn = std::min(kFeatures, n - n0);
    float* c = out.data_ptr<float>() + n0;
    if (bf16)
      few_rows_times_weight(xf.data_ptr<float>(), k, m, w.data_ptr<at::BFloat16>() + n0 * k, k, nn, k, k_chunk, leaves,
                            c, n, scratch);
    else
      few_rows_times_weight(xf.data_ptr<float>(), k, m, w.data_ptr<float>() + n0 * k, k, nn, k, k_chunk, leaves, c, n,
                            scratch);
  });
  return out;
}

// The chain path's products for up to one block of lanes of rows, computed transposed (weight rows times the
// input rows as columns).
at::Tensor chain_transposed(const LinearRows& r, const at::Tensor& weight, int64_t k_chunk, int64_t leaves) {
  const int64_t m = r.m, k = r.k, n = r.n, lanes = round_up(m, kLanes);
  const auto xf = r.rows.to(at::kFloat).contiguous(), w = weight.to(at::kFloat).contiguous();
  std::vector<float> xt(k * lanes, 0.0f), st(n * lanes);
  const float* xs = xf.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k; ++j) xt[j * lanes + i] = xs[i * k + j];
  constexpr int64_t kFeatures = 8 * kMaxRows;  // output features per item: each entry is its own chain
  for_each_item((n + kFeatures - 1) / kFeatures, [] { return 0; }, [&](int, int64_t item) {
    const int64_t n0 = item * kFeatures, nn = std::min(kFeatures, n - n0);
    fma_chain_tree_rows(w.data_ptr<float>() + n0 * k, k, 1, nn, xt.data(), lanes, k, lanes, k_chunk, leaves,
                        st.data() + n0 * lanes, lanes);
  });
  auto out = at::empty({m, n}, xf.options());
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) o[i * n + j] = st[j * lanes + i];
  return out;
}

// ops._padded_linear_forward on the chain path (N >= 12, native.fma_chain_lib checked it): the same entries as
// fma chains, with no tile to pad -- chain_many_rows, chain_packed_rows (where the weight's chain pack is given),
// chain_few_rows or chain_transposed by the number of rows.
at::Tensor linear_chain(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        at::ScalarType out_dtype, int64_t k_chunk, int64_t leaves,
                        const c10::optional<std::vector<at::Tensor>>& pack) {
  const LinearRows r = linear_rows(x, weight, leaves);
  if (r.m == 0) return at::zeros(r.out_sizes, x.options().dtype(out_dtype));
  at::Tensor out;
  if (r.m > kMaxBlocks * kLanes)
    out = chain_many_rows(r, weight, k_chunk, leaves);
  else if (pack && r.m <= chain_pack_rows(weight.scalar_type()))
    out = chain_packed_rows(r, weight, k_chunk, leaves, *pack);
  else if (r.m <= kFewRows)
    out = chain_few_rows(r, weight, k_chunk, leaves);
  else
    out = chain_transposed(r, weight, k_chunk, leaves);
  return linear_epilogue(out, bias, out_dtype, r);
}

// ops._padded_linear_forward as its torch code computes it: x @ weight.T over row tiles of tile_rows, K split in
// `leaves` equal leaves (each in k_chunk chunks whose fp32 partials are added in order) combined by the pairwise
// tree (ops.matmul_tree); the same aten calls as the Python code, minus its dispatch.
at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        at::ScalarType out_dtype, int64_t tile_rows, int64_t k_chunk, int64_t leaves) {
  const LinearRows r = linear_rows(x, weight, leaves);
  if (r.m == 0) return at::zeros(r.out_sizes, x.options().dtype(out_dtype));
  const int64_t m = r.m, k = r.k, n = r.n, tiles = (m + tile_rows - 1) / tile_rows;
  at::Tensor a;
  if (tiles * tile_rows != m) {  // zero rows appended; one copy does the fp32 cast too
    a = at::zeros({tiles * tile_rows, k}, x.options().dtype(at::kFloat));
    a.narrow(0, 0, m).copy_(r.rows);
  } else {
    a = r.rows.to(at::kFloat);
  }
  a = a.view({tiles, tile_rows, k});
  const auto w = weight.to(at::kFloat);
  const auto b = w.is_contiguous() ? w.as_strided({tiles, k, n}, {0, 1, k})  // W^T per tile, no copy
                                   : w.t().unsqueeze(0).expand({tiles, k, n});
  auto leaf_product = [&](int64_t first, int64_t width) {  // ops.matmul_tiles over k in [first, first + width)
    if (width <= k_chunk) return at::bmm(a.narrow(2, first, width), b.narrow(1, first, width));
    at::Tensor acc;
    for (int64_t start = first; start < first + width; start += k_chunk) {
      const int64_t len = std::min(k_chunk, first + width - start);
      auto part = at::bmm(a.narrow(2, start, len), b.narrow(1, start, len));
      acc = acc.defined() ? acc + part : part;
    }
    return acc;
  };
  const int64_t width = k / leaves;
  std::vector<std::pair<int64_t, at::Tensor>> stack;  // (leaves below, sum), as ops.matmul_tree
  for (int64_t first = 0; first < k; first += width) {
    auto part = leaf_product(first, width);
    int64_t size = 1;
    while (!stack.empty() && stack.back().first == size) {
      part = stack.back().second + part;
      stack.pop_back();
      size *= 2;
    }
    stack.emplace_back(size, part);
  }
  return linear_epilogue(stack.front().second.view({tiles * tile_rows, n}).narrow(0, 0, m), bias, out_dtype, r);
}

// a @ b for fp32 matrices a [M, K], b [K, N] as fma_chain_rows computes it (one k chunk): what
// native.fma_chain_lib holds equal to at::bmm on this machine before the fused attention runs.
at::Tensor chain_matmul(const at::Tensor& a_in, const at::Tensor& b_in) {
  check_cpu_float(a_in, "chain_matmul");
  check_cpu_float(b_in, "chain_matmul");
  TORCH_CHECK(a_in.dim() == 2 && b_in.dim() == 2 && a_in.size(1) == b_in.size(0), "chain_matmul: a [M, K] @ b [K, N]");
  const int64_t M = a_in.size(0), K = a_in.size(1), N = b_in.size(1), N16 = round_up(N, kLanes);
  const auto a = a_in.contiguous();
  auto bt = at::zeros({K, N16}, a.options());
  bt.narrow(1, 0, N).copy_(b_in);
  auto c = at::empty({M, N16}, a.options());
  std::vector<float> part(kMaxRows * N16);
  fma_chain_rows(a.data_ptr<float>(), K, 1, M, bt.data_ptr<float>(), N16, K, N16, std::max<int64_t>(K, 1),
                 c.data_ptr<float>(), N16, part.data());
  return c.narrow(1, 0, N).contiguous();
}

void register_linear(pybind11::module& m) {
  m.def("linear_dot", &linear_dot, "ops._padded_linear_forward on the dot path (bf16, AVX512-BF16)");
  m.def("linear_chain", &linear_chain, "ops._padded_linear_forward on the chain path (MKL's fma chains)");
  m.def("linear_tiles", &linear_tiles, "ops._padded_linear_forward as its torch code's aten calls");
  m.def("pack_chain_weight", &pack_chain_weight, "a weight [N, K] laid out once for few rows on the chain path");
  m.def("dot_matmul", &dot_matmul, "the dot path's product, with or without its denormal guard");
  m.def("pack_dot_weight", &pack_dot_weight, "a bf16 weight's dot-path panels and their exponents, laid out once");
  m.def("chain_matmul", &chain_matmul, "a @ b as the fused attention's fma chains compute it");
}
