// The bf16 dot path: bf16 products on AVX512-BF16's vdpbf16ps (the linears and the bf16 MoE experts), and
// where a linear writes its rows.
#pragma once
#include "common.h"

namespace {

// ---- bf16 linears on the dot-product instruction (AVX512-BF16) ----
// vdpbf16ps adds two bf16 products to an fp32 lane, the high half's first, each add rounded to nearest:
// two steps of an fma chain, as a product of two bf16 is exact in fp32. With each k pair's halves
// swapped (k = 2p in the high half) it computes fma_chain_rows' chain over k = 0, 1, ... on the
// fp32-widened operands -- the same bits, read as bf16 -- except that it flushes denormal inputs and
// results to zero (checked at load: native.bf16_dot_lib). dot_exact says when no denormal can occur;
// where it cannot say so, the columns are computed as std::fma chains of the widened values.

// Biased exponents of a set of bf16 values: the smallest of the nonzero ones (255 if none), the largest.
struct Exponents {
  int lo = 255, hi = 0;
  void add(const Exponents& o) { lo = std::min(lo, o.lo); hi = std::max(hi, o.hi); }
};

// No denormal, infinity or NaN among the operands (exponent fields 1..254), and every product a multiple
// of 2^(lo_a + lo_b - 268) >= 2^-126: then every partial sum -- a multiple of it, rounded or not -- is
// zero or normal, and flushing never happens.
bool dot_exact(const Exponents& a, const Exponents& b) {
  return a.lo >= 1 && b.lo >= 1 && a.hi <= 254 && b.hi <= 254 && a.lo + b.lo >= 142;
}

// One entry of ops.matmul_tree on bf16 operands, as std::fma chains (the columns dot_exact does not cover).
float spec_entry(const uint16_t* x, const uint16_t* w, int64_t k, int64_t k_chunk, int64_t leaves, float* leaf) {
  const int64_t width = k / leaves;
  for (int64_t j = 0; j < leaves; ++j) {
    float sum = 0.0f;
    for (int64_t c0 = j * width; c0 < (j + 1) * width; c0 += k_chunk) {
      float acc = 0.0f;
      for (int64_t i = c0; i < std::min((j + 1) * width, c0 + k_chunk); ++i) acc = std::fma(widen(x[i]), widen(w[i]), acc);
      sum = c0 == j * width ? acc : sum + acc;
    }
    leaf[j] = sum;
  }
  tree_combine_in_place(leaf, leaves, 1);
  return leaf[0];
}

// A weight's panels laid out once (pack_dot_weight): group b's kDotPanels panels at panels + b * kDotPanels
// * pairs * 16 (pack_panel's layout), its values' exponents at exponents[2b], [2b + 1].
constexpr int kDotPanels = 2;  // 16-column panels per group (one thread's unit of work)
constexpr int64_t kDotGroup = kDotPanels * kLanes;  // columns per group
struct DotPack {
  const uint32_t* panels;
  const int32_t* exponents;
  int64_t pairs;  // K / 2 of the weight [N, K]
  const uint32_t* group_panels(int64_t b) const { return panels + b * kDotPanels * pairs * kLanes; }
  Exponents group_exponents(int64_t b) const { return Exponents{exponents[2 * b], exponents[2 * b + 1]}; }
};

// The pointers of pack_dot_weight's tensors, checked to be those of a weight [N, K].
DotPack dot_pack_of(const std::vector<at::Tensor>& pack, int64_t N, int64_t K) {
  const int64_t groups = (N + kDotGroup - 1) / kDotGroup;
  TORCH_CHECK(pack.size() == 2 && pack[0].scalar_type() == at::kInt && pack[1].scalar_type() == at::kInt &&
                  pack[0].is_contiguous() && pack[1].is_contiguous() &&
                  pack[0].sizes() == at::IntArrayRef({groups, kDotPanels * (K / 2) * kLanes}) &&
                  pack[1].sizes() == at::IntArrayRef({groups, 2}),
              "linear: the pack (", pack.size(), " tensors) is not pack_dot_weight's of a weight [", N, ", ", K, "]");
  return {reinterpret_cast<const uint32_t*>(pack[0].data_ptr<int32_t>()), pack[1].data_ptr<int32_t>(), K / 2};
}

// A linear's output row: ops.linear_epilogue of fp32 sums (+ fp32 bias, then one cast to T).
void store_row(const float* sums, const float* bias, int64_t n, float* out) {
  for (int64_t c = 0; c < n; ++c) out[c] = bias ? sums[c] + bias[c] : sums[c];
}
void store_row(const float* sums, const float* bias, int64_t n, at::BFloat16* out) {
  if (!bias) return to_bf16(sums, out, n);
  float row[kDotPanels * kLanes];  // n <= one group's columns
  for (int64_t c = 0; c < n; ++c) row[c] = sums[c] + bias[c];
  to_bf16(row, out, n);
}

// Where a linear writes: out [M, N] fp32 or bf16, and the fp32 bias of its columns (nullptr: none).
struct LinearOut {
  void* data;
  bool bf16;
  const float* bias;
  void row(const float* sums, int64_t r, int64_t n0, int64_t nn, int64_t N) const {
    const float* b = bias ? bias + n0 : nullptr;
    if (bf16)
      store_row(sums, b, nn, static_cast<at::BFloat16*>(data) + r * N + n0);
    else
      store_row(sums, b, nn, static_cast<float*>(data) + r * N + n0);
  }
};

#if defined(__AVX512BF16__)
constexpr bool kDotBuilt = true;

// 16 rows of 16 dwords -> 16 columns (r[j] = dword j of every row), each dword's halves swapped.
void transpose_swapped(__m512i r[16]) {
  transpose_16x16(r);
  for (int i = 0; i < 16; ++i) r[i] = _mm512_rol_epi32(r[i], 16);
}

void add_exponents(__m512i v, __m512i& lo, __m512i& hi) {
  const __m512i e = _mm512_and_si512(_mm512_srli_epi16(v, 7), _mm512_set1_epi16(0xFF));
  lo = _mm512_mask_min_epu16(lo, _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x7FFF)), lo, e);
  hi = _mm512_max_epu16(hi, e);
}

Exponents reduce_exponents(__m512i lo, __m512i hi) {
  alignas(64) uint16_t l[32], h[32];
  _mm512_store_si512(l, lo);
  _mm512_store_si512(h, hi);
  Exponents e;
  for (int i = 0; i < 32; ++i) e.lo = std::min<int>(e.lo, l[i]), e.hi = std::max<int>(e.hi, h[i]);
  return e;
}

// The panel of weight rows n0..n0+nn (nn <= 16) for the dot product: panel[p * 16 + i] = pair p of row n0 + i,
// halves swapped (rows past nn: 0), and the exponents of the rows' values.
Exponents pack_panel(const uint32_t* w, int64_t pairs, int64_t nn, uint32_t* panel) {
  __m512i lo = _mm512_set1_epi16(0xFF), hi = _mm512_setzero_si512();
  for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
    const int64_t count = std::min<int64_t>(16, pairs - p0);
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    __m512i r[16];
    for (int i = 0; i < 16; ++i) {
      if (i < nn) _mm_prefetch(reinterpret_cast<const char*>(w + i * pairs + p0 + 64), _MM_HINT_T0);  // 16 streams
      r[i] = i < nn ? _mm512_maskz_loadu_epi32(mask, w + i * pairs + p0) : _mm512_setzero_si512();
      add_exponents(r[i], lo, hi);
    }
    transpose_swapped(r);
    for (int64_t j = 0; j < count; ++j) _mm512_storeu_si512(panel + (p0 + j) * 16, r[j]);
  }
  return reduce_exponents(lo, hi);
}

// The kDotPanels panels of weight rows n0..n0+nn (nn <= kDotPanels * 16) into panel (pack_panel's layout,
// panel q at panel + q * pairs * 16), and the exponents of the rows' values.
Exponents pack_group(const uint32_t* w, int64_t pairs, int64_t n0, int64_t nn, uint32_t* panel) {
  Exponents e;
  for (int64_t q = 0; q * kLanes < nn; ++q)
    e.add(pack_panel(w + (n0 + q * kLanes) * pairs, pairs, std::min(kLanes, nn - q * kLanes),
                     panel + q * pairs * kLanes));
  return e;
}

// xs[i] = pair i of x with its halves swapped (the broadcast operand), and the exponents of x's values.
Exponents pack_pairs(const uint32_t* x, int64_t pairs, uint32_t* xs) {
  __m512i lo = _mm512_set1_epi16(0xFF), hi = _mm512_setzero_si512();
  for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, pairs - p0)) - 1);
    const __m512i v = _mm512_maskz_loadu_epi32(mask, x + p0);
    add_exponents(v, lo, hi);
    _mm512_mask_storeu_epi32(xs + p0, mask, _mm512_rol_epi32(v, 16));
  }
  return reduce_exponents(lo, hi);
}

// One leaf -- pairs [first, last) -- of rows r0..r0+MR (xs) times NP 16-column panels (panel q at panel
// + q * pairs * 16): its chunk_pairs chunks' chains (from 0) added in order into sum[i * NP * 16 + column].
// MR * NP independent chains hide the instruction's latency.
template <int MR, int NP>
void dot_leaf(const uint32_t* xs, int64_t pairs, const uint32_t* panel, int64_t first, int64_t last,
              int64_t chunk_pairs, float* sum) {
  constexpr int64_t W = NP * kLanes;
  for (int64_t c0 = first; c0 < last; c0 += chunk_pairs) {
    const int64_t c1 = std::min(last, c0 + chunk_pairs);
    __m512 acc[MR][NP];
    for (int i = 0; i < MR; ++i)
      for (int q = 0; q < NP; ++q) acc[i][q] = _mm512_setzero_ps();
    for (int64_t p = c0; p < c1; ++p) {
      __m512bh w[NP];
      for (int q = 0; q < NP; ++q) w[q] = (__m512bh)_mm512_loadu_si512(panel + (q * pairs + p) * kLanes);
      for (int i = 0; i < MR; ++i) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(xs[i * pairs + p]));
        for (int q = 0; q < NP; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], b, w[q]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int q = 0; q < NP; ++q) {
        float* dst = sum + i * W + q * kLanes;
        _mm512_storeu_ps(dst, c0 == first ? acc[i][q] : _mm512_add_ps(_mm512_loadu_ps(dst), acc[i][q]));
      }
  }
}

using DotLeaf = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t, int64_t, float*);
constexpr int kDotRows = 12;  // x kDotPanels: 24 accumulators, 2 weight vectors, 1 broadcast: 27 of 32 zmm

template <int... MR>
constexpr std::array<std::array<DotLeaf, kDotPanels>, kDotRows> dot_kernels(std::integer_sequence<int, MR...>) {
  return {{{dot_leaf<MR + 1, 1>, dot_leaf<MR + 1, 2>}...}};
}
constexpr auto kDotKernels = dot_kernels(std::make_integer_sequence<int, kDotRows>{});

// A bf16 matrix x [M, K] (contiguous) as the dot product reads it: its pairs with halves swapped (the
// broadcast operand) and its values' exponents.
struct DotRows {
  const uint16_t* x16;
  const uint32_t* xs;
  int64_t M, K;
  Exponents xe;
};

// Columns n0..n0+nn (nn <= one group) of ops.matmul_tree(x, weight^T), weight [N, K] bf16 (w16) with the
// group's panels `panel` and exponents `we`: each row's fp32 sums handed to emit(r, sums) -- the dot products
// where dot_exact holds (or !guarded), else spec_entry. sums: kDotRows * group * max(leaves, 1) floats.
template <typename Emit>
void dot_group(const DotRows& x, const uint16_t* w16, const uint32_t* panel, Exponents we, int64_t n0, int64_t nn,
               int64_t k_chunk, int64_t leaves, bool guarded, float* sums, Emit emit) {
  const int64_t K = x.K, pairs = K / 2, width = pairs / leaves, np = (nn + kLanes - 1) / kLanes, w = np * kLanes;
  if (guarded && !dot_exact(x.xe, we)) {
    for (int64_t r = 0; r < x.M; ++r) {
      float row[kDotPanels * kLanes];
      for (int64_t c = 0; c < nn; ++c) row[c] = spec_entry(x.x16 + r * K, w16 + (n0 + c) * K, K, k_chunk, leaves, sums);
      emit(r, row);
    }
    return;
  }
  for (int64_t r0 = 0; r0 < x.M; r0 += kDotRows) {
    const int64_t mr = std::min<int64_t>(kDotRows, x.M - r0);
    for (int64_t j = 0; j < leaves; ++j)
      kDotKernels[mr - 1][np - 1](x.xs + r0 * pairs, pairs, panel, j * width, (j + 1) * width, k_chunk / 2,
                                  sums + j * mr * w);
    tree_combine_in_place(sums, leaves, mr * w);
    for (int64_t i = 0; i < mr; ++i) emit(r0 + i, sums + i * w);
  }
}

// ops.matmul_tree of bf16 x [M, K] and weight [N, K] (both contiguous), then the linear's epilogue, into out:
// per group of kDotPanels 16-column panels (an item of for_each_item), dot_group (guarded = false: the dot
// products everywhere, for the test that shows what the guard is for).
void dot_product_tree(const at::Tensor& x, const at::Tensor& weight, int64_t k_chunk, int64_t leaves,
                      const LinearOut& out, bool guarded = true, const DotPack* pack = nullptr) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), pairs = K / 2;
  const auto* x16 = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w16 = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  std::vector<uint32_t> xs(M * pairs);
  const DotRows rows{x16, xs.data(), M, K, pack_pairs(reinterpret_cast<const uint32_t*>(x16), M * pairs, xs.data())};
  struct Buffers {
    std::vector<uint32_t> own;  // the group's panels, unless packed
    std::vector<float> sums;
  };
  auto make = [&] {
    return Buffers{std::vector<uint32_t>(pack ? 0 : kDotPanels * pairs * kLanes),
                   std::vector<float>(std::max<int64_t>(leaves, 1) * kDotRows * kDotGroup)};
  };
  for_each_item((N + kDotGroup - 1) / kDotGroup, make, [&](Buffers& buf, int64_t b) {
    const int64_t n0 = b * kDotGroup, nn = std::min(kDotGroup, N - n0);
    const uint32_t* panel = pack ? pack->group_panels(b) : buf.own.data();
    const Exponents we = pack ? pack->group_exponents(b)
                              : pack_group(reinterpret_cast<const uint32_t*>(w16), pairs, n0, nn, buf.own.data());
    dot_group(rows, w16, panel, we, n0, nn, k_chunk, leaves, guarded, buf.sums.data(),
              [&](int64_t r, const float* sums) { out.row(sums, r, n0, nn, N); });
  });
}

#else
constexpr bool kDotBuilt = false;
void dot_product_tree(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const LinearOut&, bool = true,
                      const DotPack* = nullptr) {
  TORCH_CHECK(false, "linear: this library was built without AVX512-BF16 (bf16_dot_built() is False)");
}
#endif

}  // namespace
