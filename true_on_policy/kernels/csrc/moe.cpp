// The library's MoE experts: ops.moe_experts without sharding in one call, on the bf16 dot path
// (moe_experts) or the fma-chain path (moe_experts_chain).
#include "bf16_dot.h"
#include "fma_chain.h"
#include "library.h"

namespace {

// The arguments both native MoE paths take, checked: hidden [T, H], top_k_index [T, k], and per expert a
// contiguous gate_up [2I, H] and down [H, I] of hidden's dtype. Returns I.
int64_t checked_experts(const char* op, const at::Tensor& hidden, const at::Tensor& chosen,
                        const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down) {
  const auto dtype = hidden.scalar_type();
  const int64_t E = gate_up.size();
  TORCH_CHECK(hidden.dim() == 2 && chosen.dim() == 2 && chosen.size(0) == hidden.size(0) && E > 0 &&
                  down.size() == static_cast<size_t>(E) && gate_up[0].dim() == 2,
              op, ": hidden [T, H], top_k_index [T, k], and per expert a gate_up and a down, got ", hidden.sizes(),
              ", ", chosen.sizes(), ", ", E, " gate_up and ", down.size(), " down");
  const int64_t H = hidden.size(1), I = gate_up[0].size(0) / 2;
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(gate_up[e].scalar_type() == dtype && down[e].scalar_type() == dtype && gate_up[e].is_contiguous() &&
                    down[e].is_contiguous() && gate_up[e].sizes() == at::IntArrayRef({2 * I, H}) &&
                    down[e].sizes() == at::IntArrayRef({H, I}),
                op, ": expert ", e, "'s weights are not contiguous ", dtype, " [2I, H] and [H, I] with I = ", I,
                " and H = ", H, ", got ", gate_up[e].sizes(), " ", gate_up[e].scalar_type(), " and ", down[e].sizes(),
                " ", down[e].scalar_type());
  return I;
}

// The (token, slot) pairs of top_k_index [T, k] (slot = t * k + j) grouped by expert, token order inside an
// expert (the torch code's stable sort): expert e's pairs are order[start[e]:start[e + 1]].
std::pair<std::vector<int64_t>, std::vector<int64_t>> expert_pairs(const at::Tensor& chosen, int64_t E) {
  const int64_t n_pairs = chosen.numel();
  const int64_t* ids = chosen.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0), order(n_pairs);
  for (int64_t i = 0; i < n_pairs; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "moe_experts: expert id ", ids[i], " of ", E, " experts");
    ++start[ids[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < n_pairs; ++i) order[fill[ids[i]]++] = i;
  return {std::move(start), std::move(order)};
}

#if defined(__AVX512BF16__)
// moe_experts' scratch per item: the sums, and one (expert, column group)'s gate and up [count, kDotGroup],
// grown as needed.
struct DotExpertBuffers {
  std::vector<float> sums;
  std::vector<at::BFloat16> gate, up;
};

// One item of moe_experts' gate_up round: columns g * kDotGroup.. of gate and of up for the expert's count rows x
// (its weight w16, packed), then act = silu_mul_run(gate, up) into the expert's activation rows (act, I apart).
void dot_gate_up_group(const DotRows& x, const uint16_t* w16, const DotPack& pack, int64_t g, int64_t gu_groups,
                       int64_t count, int64_t k_chunk, int64_t gate_up_leaves, DotExpertBuffers& buf, at::BFloat16* act,
                       int64_t I) {
  if (count == 0) return;
  if (buf.gate.size() < static_cast<size_t>(count * kDotGroup))
    buf.gate.resize(count * kDotGroup), buf.up.resize(count * kDotGroup);
  for (int half = 0; half < 2; ++half) {
    const int64_t b = g + half * gu_groups;  // the pack's group: gate rows first, then up rows
    at::BFloat16* dst = half == 0 ? buf.gate.data() : buf.up.data();
    dot_group(x, w16, pack.group_panels(b), pack.group_exponents(b), b * kDotGroup, kDotGroup, k_chunk,
              gate_up_leaves, true, buf.sums.data(),
              [&](int64_t r, const float* row) { to_bf16(row, dst + r * kDotGroup, kDotGroup); });
  }
  for (int64_t first = 0; first < count * kDotGroup; first += kSiluRun) {  // in place in gate
    at::BFloat16* run = buf.gate.data() + first;
    silu_mul_run(run, buf.up.data() + first, run, std::min(kSiluRun, count * kDotGroup - first));
  }
  for (int64_t r = 0; r < count; ++r) std::copy_n(buf.gate.data() + r * kDotGroup, kDotGroup, act + r * I);
}

// ops.moe_experts for bf16 hidden [T, H] without sharding, every expert's weights packed (pack_dot_weight):
// per expert its (token, slot) pairs in token order, x = hidden rows, down(silu_mul(gate, up)) with
// gate, up = linear(x, gate_up) -- the dot path's bits and epilogues, as the torch code's calls compute them
// -- in four rounds of items: the experts' rows gathered; (expert, column group) of gate and up with the
// activation; the activations' pairs; (expert, column group) of down, written to the pairs' slots.
// Returns [T * top_k, H] bf16 in slot order.
at::Tensor moe_experts(const at::Tensor& hidden_in, const at::Tensor& top_k_index, const std::vector<at::Tensor>& gate_up,
                       const std::vector<at::Tensor>& down, const std::vector<std::vector<at::Tensor>>& gate_up_packs,
                       const std::vector<std::vector<at::Tensor>>& down_packs, int64_t k_chunk, int64_t gate_up_leaves,
                       int64_t down_leaves) {
  const auto hidden = hidden_in.contiguous();
  const auto chosen = top_k_index.to(at::kLong).contiguous();
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16, "moe_experts: bf16 hidden, got ", hidden.scalar_type());
  const int64_t I = checked_experts("moe_experts", hidden, chosen, gate_up, down);
  const int64_t E = gate_up.size(), T = hidden.size(0), H = hidden.size(1), top_k = chosen.size(1);
  TORCH_CHECK(gate_up_packs.size() == static_cast<size_t>(E) && down_packs.size() == static_cast<size_t>(E),
              "moe_experts: packs for ", gate_up_packs.size(), " and ", down_packs.size(), " of ", E, " experts");
  TORCH_CHECK(I % kDotGroup == 0 && H % 2 == 0 && I % 2 == 0 && (H / 2) % gate_up_leaves == 0 && (I / 2) % down_leaves == 0,
              "moe_experts: an intermediate size ", I, " that is a multiple of ", kDotGroup, " and even leaves");
  std::vector<const uint16_t*> gu16(E), dn16(E);
  std::vector<DotPack> gu_pack(E), dn_pack(E);
  for (int64_t e = 0; e < E; ++e) {
    gu16[e] = reinterpret_cast<const uint16_t*>(gate_up[e].data_ptr<at::BFloat16>());
    dn16[e] = reinterpret_cast<const uint16_t*>(down[e].data_ptr<at::BFloat16>());
    gu_pack[e] = dot_pack_of(gate_up_packs[e], 2 * I, H);
    dn_pack[e] = dot_pack_of(down_packs[e], H, I);
  }
  const int64_t n_pairs = T * top_k;
  std::vector<int64_t> start, order;
  std::tie(start, order) = expert_pairs(chosen, E);
  auto opts = hidden.options();
  auto x = at::empty({n_pairs, H}, opts), act = at::empty({n_pairs, I}, opts);
  auto* x16 = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* a16 = reinterpret_cast<uint16_t*>(act.data_ptr<at::BFloat16>());
  std::vector<uint32_t> xs(n_pairs * H / 2), as(n_pairs * I / 2);
  std::vector<DotRows> x_rows(E), a_rows(E);
  const auto* h16 = reinterpret_cast<const uint16_t*>(hidden.data_ptr<at::BFloat16>());
  auto none = [] { return 0; };
  for_each_item(E, none, [&](int, int64_t e) {  // each expert's rows and their pairs
    const int64_t first = start[e], count = start[e + 1] - first;
    for (int64_t i = 0; i < count; ++i)
      std::copy_n(h16 + (order[first + i] / top_k) * H, H, x16 + (first + i) * H);
    const Exponents xe = pack_pairs(reinterpret_cast<const uint32_t*>(x16 + first * H), count * H / 2,
                                    xs.data() + first * H / 2);
    x_rows[e] = DotRows{x16 + first * H, xs.data() + first * H / 2, count, H, xe};
  });
  const int64_t gu_groups = I / kDotGroup, dn_groups = (H + kDotGroup - 1) / kDotGroup;
  auto make = [&] {
    return DotExpertBuffers{std::vector<float>(kDotRows * kDotGroup * std::max(gate_up_leaves, down_leaves)), {}, {}};
  };
  for_each_item(E * gu_groups, make, [&](DotExpertBuffers& buf, int64_t item) {
    const int64_t e = item / gu_groups, g = item % gu_groups;
    dot_gate_up_group(x_rows[e], gu16[e], gu_pack[e], g, gu_groups, start[e + 1] - start[e], k_chunk, gate_up_leaves,
                      buf, reinterpret_cast<at::BFloat16*>(a16) + start[e] * I + g * kDotGroup, I);
  });
  for_each_item(E, none, [&](int, int64_t e) {  // the activations' pairs
    const int64_t first = start[e], count = start[e + 1] - first;
    const Exponents ae = pack_pairs(reinterpret_cast<const uint32_t*>(a16 + first * I), count * I / 2,
                                    as.data() + first * I / 2);
    a_rows[e] = DotRows{a16 + first * I, as.data() + first * I / 2, count, I, ae};
  });
  auto out = at::empty({n_pairs, H}, opts);
  auto* o16 = out.data_ptr<at::BFloat16>();
  for_each_item(E * dn_groups, make, [&](DotExpertBuffers& buf, int64_t item) {
    const int64_t e = item / dn_groups, b = item % dn_groups, n0 = b * kDotGroup, nn = std::min(kDotGroup, H - n0);
    if (start[e + 1] == start[e]) return;
    dot_group(a_rows[e], dn16[e], dn_pack[e].group_panels(b), dn_pack[e].group_exponents(b), n0, nn, k_chunk,
              down_leaves, true, buf.sums.data(),
              [&](int64_t r, const float* row) { to_bf16(row, o16 + order[start[e] + r] * H + n0, nn); });
  });
  return out;
}
#else
at::Tensor moe_experts(const at::Tensor&, const at::Tensor&, const std::vector<at::Tensor>&,
                       const std::vector<at::Tensor>&, const std::vector<std::vector<at::Tensor>>&,
                       const std::vector<std::vector<at::Tensor>>&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "moe_experts: this library was built without AVX512-BF16 (bf16_dot_built() is False)");
}
#endif

}  // namespace

// n values of a weight as fp32: an fp32 weight where it is, a bf16 one widened into scratch (exact).
template <typename T>
const float* as_fp32(const T* w, int64_t n, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return w;
  } else {
    scratch.resize(n);
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + kLanes <= n; i += kLanes) _mm512_storeu_si512(scratch.data() + i, load_fp32x16(w + i));
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(scratch.data() + i, load_fp32x8(w + i));
#endif
    for (; i < n; ++i) scratch[i] = static_cast<float>(w[i]);
    return scratch.data();
  }
}

// An expert's gate and up sums (len <= kSiluRun each) through the gate_up linear's epilogue (one cast to T)
// and silu_mul_run in T; the activation written over gate, widened to fp32 (exact) for the down product.
template <typename T>
void gate_up_activation(float* gate, const float* up, int64_t len) {
  if constexpr (std::is_same_v<T, float>) {
    silu_mul_run(gate, up, gate, len);
  } else {
    T g[kSiluRun], u[kSiluRun];
    to_bf16(gate, g, len), to_bf16(up, u, len);
    silu_mul_run(g, u, g, len);
    for (int64_t i = 0; i < len; ++i) gate[i] = static_cast<float>(g[i]);
  }
}

namespace {

// chain_experts' scratch per item.
struct ChainBuffers {
  std::vector<float> up, weight;  // up's sums (down: the output's); a bf16 weight block widened
  PanelScratch panel;
};

// One call of chain_experts (below): its weights, the experts' (token, slot) pairs, and per expert its rows x[e]
// and activations act[e] -- few rows: [count, H] and [count, I]; else its rows as columns, [H, lanes] and
// [I, lanes] with zero-padded lanes; fp32 (T widened).
template <typename T>
struct ChainExperts {
  static constexpr int64_t kBlock = kGroupRows, kLaneBlock = kMaxBlocks * kLanes;  // weight rows per item (a pack's group); lanes per pass
  const std::vector<at::Tensor>& gate_up;
  const std::vector<at::Tensor>& down;
  const std::vector<at::Tensor>& gate_up_packs;
  const std::vector<at::Tensor>& down_packs;
  int64_t k_chunk, gate_up_leaves, down_leaves, E, H, top_k, I;
  bool packed;
  int64_t few_rows;  // an expert of up to few_rows rows runs its rows against weight panels (chain_pack_rows with packs)
  std::vector<int64_t> start, order;
  std::vector<std::vector<float>> x, act;
  int64_t gu_blocks, dn_blocks;

  ChainExperts(const at::Tensor& hidden, const at::Tensor& chosen, const std::vector<at::Tensor>& gate_up_,
               const std::vector<at::Tensor>& down_, const std::vector<at::Tensor>& gate_up_packs_,
               const std::vector<at::Tensor>& down_packs_, int64_t k_chunk_, int64_t gate_up_leaves_,
               int64_t down_leaves_)
      : gate_up(gate_up_), down(down_), gate_up_packs(gate_up_packs_), down_packs(down_packs_), k_chunk(k_chunk_),
        gate_up_leaves(gate_up_leaves_), down_leaves(down_leaves_), E(gate_up_.size()), H(hidden.size(1)),
        top_k(chosen.size(1)), I(gate_up_[0].size(0) / 2), packed(!gate_up_packs_.empty()),
        few_rows(packed ? chain_pack_rows(hidden.scalar_type()) : kFewRows), x(E), act(E),
        gu_blocks((I + kBlock - 1) / kBlock), dn_blocks((H + kBlock - 1) / kBlock) {
    std::tie(start, order) = expert_pairs(chosen, E);
  }
  int64_t count(int64_t e) const { return start[e + 1] - start[e]; }
  int64_t lanes(int64_t e) const { return round_up(count(e), kLanes); }

  // expert e's rows of hidden (h) into x[e], and act[e] zeroed
  void gather(const T* h, int64_t e) {
    const int64_t n = count(e), l = lanes(e);
    if (n == 0) return;
    const bool few = n <= few_rows;
    x[e].assign(H * (few ? n : l), 0.0f), act[e].assign(I * (few ? n : l), 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      const T* row = h + order[start[e] + t] / top_k * H;
      if (few)
        std::copy(row, row + H, x[e].data() + t * H);
      else
        for (int64_t j = 0; j < H; ++j) x[e][j * l + t] = static_cast<float>(row[j]);
    }
  }

  // item (expert, block of intermediate features) of gate and up, with the activation written over the gate
  void gate_up_block(ChainBuffers& buf, int64_t item) {
    const int64_t e = item / gu_blocks, j0 = item % gu_blocks * kBlock, rows = std::min(kBlock, I - j0), n = count(e);
    if (n == 0) return;
    const T* w = gate_up[e].data_ptr<T>();
    if (n <= few_rows) {  // gate into act[e] [n, I], up [n, rows]; the activation over each row's block
      buf.up.resize(n * rows);
      float* gate = act[e].data() + j0;
      if (packed) {  // the pack's group j0 / 64 of the gate part, and of the up part after it
        const T* group = gate_up_packs[e].data_ptr<T>() + item % gu_blocks * H * kGroupRows;
        few_rows_times_group(x[e].data(), H, n, group, H, rows, k_chunk, gate_up_leaves, gate, I, buf.panel.sums);
        few_rows_times_group(x[e].data(), H, n, group + gu_blocks * H * kGroupRows, H, rows, k_chunk, gate_up_leaves,
                             buf.up.data(), rows, buf.panel.sums);
      } else {
        few_rows_times_weight(x[e].data(), H, n, w + j0 * H, H, rows, H, k_chunk, gate_up_leaves, gate, I, buf.panel);
        few_rows_times_weight(x[e].data(), H, n, w + (I + j0) * H, H, rows, H, k_chunk, gate_up_leaves, buf.up.data(),
                              rows, buf.panel);
      }
      for (int64_t t = 0; t < n; ++t) gate_up_activation<T>(gate + t * I, buf.up.data() + t * rows, rows);
      return;
    }
    const int64_t l = lanes(e);
    buf.up.resize(rows * l);
    float* gate = act[e].data() + j0 * l;  // the activation is written over its gate
    for (int half = 0; half < 2; ++half) {
      const float* wf = as_fp32(w + (half * I + j0) * H, rows * H, buf.weight);
      float* sums = half == 0 ? gate : buf.up.data();
      for (int64_t n0 = 0; n0 < l; n0 += kLaneBlock)  // the lanes in blocks that stay in cache across the rows
        fma_chain_tree_rows(wf, H, 1, rows, x[e].data() + n0, l, H, std::min(kLaneBlock, l - n0), k_chunk,
                            gate_up_leaves, sums + n0, l);
    }
    for (int64_t first = 0; first < rows * l; first += kSiluRun)
      gate_up_activation<T>(gate + first, buf.up.data() + first, std::min(kSiluRun, rows * l - first));
  }

  // item (expert, block of output features) of down, written to the pairs' slots of o
  void down_block(ChainBuffers& buf, int64_t item, T* o) {
    const int64_t e = item / dn_blocks, n0 = item % dn_blocks * kBlock, rows = std::min(kBlock, H - n0), n = count(e);
    if (n == 0) return;
    const T* w = down[e].data_ptr<T>() + n0 * I;
    std::vector<float>& sums = buf.up;
    if (n <= few_rows) {
      sums.resize(n * rows);
      if (packed)
        few_rows_times_group(act[e].data(), I, n, down_packs[e].data_ptr<T>() + item % dn_blocks * I * kGroupRows, I,
                             rows, k_chunk, down_leaves, sums.data(), rows, buf.panel.sums);
      else
        few_rows_times_weight(act[e].data(), I, n, w, I, rows, I, k_chunk, down_leaves, sums.data(), rows, buf.panel);
      for (int64_t t = 0; t < n; ++t) store_row(sums.data() + t * rows, nullptr, rows, o + order[start[e] + t] * H + n0);
      return;
    }
    const int64_t l = lanes(e);
    sums.resize(rows * l);
    const float* wf = as_fp32(w, rows * I, buf.weight);
    for (int64_t l0 = 0; l0 < l; l0 += kLaneBlock)
      fma_chain_tree_rows(wf, I, 1, rows, act[e].data() + l0, l, I, std::min(kLaneBlock, l - l0), k_chunk, down_leaves,
                          sums.data() + l0, l);
    for (int64_t t = 0; t < n; ++t)  // one cast to T, as the linear's epilogue
      for (int64_t i = 0; i < rows; ++i) o[order[start[e] + t] * H + n0 + i] = static_cast<T>(sums[i * l + t]);
  }
};

}  // namespace

// ops.moe_experts for hidden [T, H] and weights of one dtype T (fp32, or bf16 where the dot path is not
// built or checked) without sharding: per expert its (token, slot) pairs in token order,
// down(silu_mul(gate, up)) with gate, up = linear(x, gate_up) -- each linear's entries the fma chains of its
// chain path on the fp32-widened operands, its output cast to T -- in three rounds of items: the experts'
// rows; (expert, block of intermediate features) of gate and up with the activation; (expert, block of
// output features) of down, written to the pairs' slots. An expert of few rows (few_rows below) computes them
// against its weights' panels -- laid out in the call (few_rows_times_weight), or read from the experts' chain
// packs (pack_chain_weight: gate_up in two parts, down in one); one of more, transposed (weight rows times the
// expert's rows as 16-lane columns; the activation is elementwise, so it runs on the transposed values).
// Returns [T * top_k, H].
template <typename T>
at::Tensor chain_experts(const at::Tensor& hidden, const at::Tensor& chosen, const std::vector<at::Tensor>& gate_up,
                         const std::vector<at::Tensor>& down, const std::vector<at::Tensor>& gate_up_packs,
                         const std::vector<at::Tensor>& down_packs, int64_t k_chunk, int64_t gate_up_leaves,
                         int64_t down_leaves) {
  ChainExperts<T> call(hidden, chosen, gate_up, down, gate_up_packs, down_packs, k_chunk, gate_up_leaves, down_leaves);
  const T* h = hidden.data_ptr<T>();
  for_each_item(call.E, [] { return 0; }, [&](int, int64_t e) { call.gather(h, e); });
  for_each_item(call.E * call.gu_blocks, [] { return ChainBuffers(); },
                [&](ChainBuffers& buf, int64_t item) { call.gate_up_block(buf, item); });
  at::Tensor out = at::empty({hidden.size(0) * call.top_k, call.H}, hidden.options());
  T* o = out.data_ptr<T>();
  for_each_item(call.E * call.dn_blocks, [] { return ChainBuffers(); },
                [&](ChainBuffers& buf, int64_t item) { call.down_block(buf, item, o); });
  return out;
}

// chain_experts of hidden's dtype, the arguments checked (packs: none, or every expert's).
at::Tensor moe_experts_chain(const at::Tensor& hidden_in, const at::Tensor& top_k_index,
                             const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down,
                             const std::vector<at::Tensor>& gate_up_packs, const std::vector<at::Tensor>& down_packs,
                             int64_t k_chunk, int64_t gate_up_leaves, int64_t down_leaves) {
  const auto hidden = hidden_in.contiguous();
  const auto chosen = top_k_index.to(at::kLong).contiguous();
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "moe_experts_chain: fp32 or bf16 hidden, got ", dtype);
  const int64_t I = checked_experts("moe_experts_chain", hidden, chosen, gate_up, down);
  const int64_t E = gate_up.size(), H = hidden.size(1);
  TORCH_CHECK(H % gate_up_leaves == 0 && I % down_leaves == 0, "moe_experts_chain: H = ", H, " and I = ", I,
              " in ", gate_up_leaves, " and ", down_leaves, " equal leaves");
  const bool packed = !gate_up_packs.empty();
  TORCH_CHECK(!packed || (gate_up_packs.size() == static_cast<size_t>(E) && down_packs.size() == static_cast<size_t>(E)),
              "moe_experts_chain: packs for ", gate_up_packs.size(), " and ", down_packs.size(), " of ", E, " experts");
  const int64_t gu_groups = (I + kGroupRows - 1) / kGroupRows, dn_groups = (H + kGroupRows - 1) / kGroupRows;
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(!packed || (gate_up_packs[e].scalar_type() == dtype && down_packs[e].scalar_type() == dtype &&
                            gate_up_packs[e].is_contiguous() && down_packs[e].is_contiguous() &&
                            gate_up_packs[e].sizes() == at::IntArrayRef({2, gu_groups, kMaxBlocks, H, kLanes}) &&
                            down_packs[e].sizes() == at::IntArrayRef({1, dn_groups, kMaxBlocks, I, kLanes})),
                "moe_experts_chain: expert ", e, "'s packs ", gate_up_packs[e].sizes(), " and ", down_packs[e].sizes(),
                " are not pack_chain_weight's of its weights (gate_up in 2 parts)");  // built only on failure
  if (dtype == at::kFloat)
    return chain_experts<float>(hidden, chosen, gate_up, down, gate_up_packs, down_packs, k_chunk, gate_up_leaves,
                                down_leaves);
  return chain_experts<at::BFloat16>(hidden, chosen, gate_up, down, gate_up_packs, down_packs, k_chunk, gate_up_leaves,
                                     down_leaves);
}

void register_moe(pybind11::module& m) {
  m.def("moe_experts_chain", &moe_experts_chain, "ops.moe_experts (fp32 or bf16, unsharded) on the chain path in one call");
  m.def("moe_experts", &moe_experts, "ops.moe_experts (bf16, unsharded, packed) in one call");
}
