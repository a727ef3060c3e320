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
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fixed_tree.h"

namespace {

using fixed_tree::pow2_at_least;
using fixed_tree::tree_sum;

void check_cpu_float(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, op, ": needs an fp32 CPU tensor, got ",
              x.scalar_type(), " on ", x.device());
}

// fn(first_row, last_row, buf) over row ranges, each thread with its own tree buffer
template <typename Fn>
void for_rows(int64_t rows, int64_t width, Fn fn) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(width, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(width);
    fn(lo, hi, buf.data());
  });
}

// fn(state, item) for items 0..n-1, handed to the threads one at a time (an atomic counter), each thread with
// its own state = make(): a thread the OS deschedules (vLLM's engine loop shares the cores) holds up only
// its current item, not a fixed share of the work. An item writes only its own outputs, in a fixed order:
// the bits do not depend on which thread runs it.
template <typename Make, typename Fn>
void for_each_item(int64_t n, Make make, Fn fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    auto state = make();
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(state, i);
  });
}

// The product MKL's fp32 GEMM computes on torch's BLAS path (R * K * N >= ops.BLAS_MIN_WORK, R >= 4,
// N >= 12): each entry an fma chain over k = 0, 1, ... from 0 (measured; native.fma_chain_lib checks
// it at load). ops.matmul_tiles splits k into chunks whose chain results are added in order.
constexpr int64_t kLanes = 16;  // columns per register block; N, ldb and ldc are multiples of it

#if defined(__AVX512F__)
// 16 rows of 16 dwords -> 16 columns: r[j] = dword j of every row.
void transpose_16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // rows 4g..4g+3: u[4g + c] holds, in 128-bit lane l, column 4l + c
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // the 4 x 4 transpose of 128-bit lanes across u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}
#endif

// A weight's values as fp32 vector registers: fp32 loaded, bf16 widened (exact: its bits, shifted)
#if defined(__AVX512F__)
inline __m512i load_fp32x16(const float* p) { return _mm512_loadu_si512(p); }
inline __m512i load_fp32x16(const at::BFloat16* p) {
  return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
}
#elif defined(__AVX2__)
inline __m256 load_fp32x8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_fp32x8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

// c[0:MR, 0:NB*16] of the product, over k in [k0, k1): MR x NB register blocks of 16 independent chains;
// a[i, k] is a[i * a_row + k * a_k] (a_k = 1: row-major; a_row = 1: a transposed operand read in place);
// bt fp32, or bf16 widened as read (a weight's chain pack); column n at bt[n / 16 * ldblock + k * ldb + n % 16]
// (ldblock = 16: rows of bt; a chain pack's 16-column strips are K * 16 apart, read as concurrent streams)
#if defined(__AVX512F__)
template <int MR, int NB, typename TB>
void chain_tile(const float* a, int64_t a_row, int64_t a_k, const TB* bt, int64_t ldb, int64_t ldblock, int64_t k0,
                int64_t k1, float* c, int64_t ldc) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int nb = 0; nb < NB; ++nb) acc[i][nb] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m512 b[NB];
    for (int nb = 0; nb < NB; ++nb) b[nb] = _mm512_castsi512_ps(load_fp32x16(bt + nb * ldblock + k * ldb));
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i * a_row + k * a_k]);
      for (int nb = 0; nb < NB; ++nb) acc[i][nb] = _mm512_fmadd_ps(ai, b[nb], acc[i][nb]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int nb = 0; nb < NB; ++nb) _mm512_storeu_ps(c + i * ldc + nb * kLanes, acc[i][nb]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// 16 ymm registers: G 16-column blocks at a time (MR x 2G <= 12 accumulators), enough chains in flight to hide
// the fma latency where MR is small
template <int MR, int G, typename TB>
void chain_blocks(const float* a, int64_t a_row, int64_t a_k, const TB* bt, int64_t ldb, int64_t ldblock, int64_t k0,
                  int64_t k1, float* c, int64_t ldc) {
  __m256 acc[MR][2 * G];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 2 * G; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m256 b[2 * G];
    for (int v = 0; v < 2 * G; ++v) b[v] = load_fp32x8(bt + v / 2 * ldblock + k * ldb + 8 * (v % 2));
    for (int i = 0; i < MR; ++i) {
      const __m256 ai = _mm256_set1_ps(a[i * a_row + k * a_k]);
      for (int v = 0; v < 2 * G; ++v) acc[i][v] = _mm256_fmadd_ps(ai, b[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 2 * G; ++v) _mm256_storeu_ps(c + i * ldc + 8 * v, acc[i][v]);
}
template <int MR, int NB, typename TB>
void chain_tile(const float* a, int64_t a_row, int64_t a_k, const TB* bt, int64_t ldb, int64_t ldblock, int64_t k0,
                int64_t k1, float* c, int64_t ldc) {
  constexpr int G = std::min(NB, std::max(1, 6 / MR));
  int nb = 0;
  for (; nb + G <= NB; nb += G)
    chain_blocks<MR, G, TB>(a, a_row, a_k, bt + nb * ldblock, ldb, ldblock, k0, k1, c + nb * kLanes, ldc);
  if constexpr (NB % G != 0)
    chain_blocks<MR, NB % G, TB>(a, a_row, a_k, bt + nb * ldblock, ldb, ldblock, k0, k1, c + nb * kLanes, ldc);
}
#else
template <int MR, int NB, typename TB>
void chain_tile(const float* a, int64_t a_row, int64_t a_k, const TB* bt, int64_t ldb, int64_t ldblock, int64_t k0,
                int64_t k1, float* c, int64_t ldc) {
  for (int i = 0; i < MR; ++i)
    for (int64_t n = 0; n < NB * kLanes; ++n) {
      float acc = 0.0f;
      for (int64_t k = k0; k < k1; ++k)
        acc = std::fma(a[i * a_row + k * a_k], static_cast<float>(bt[n / kLanes * ldblock + k * ldb + n % kLanes]), acc);
      c[i * ldc + n] = acc;
    }
}
#endif

template <typename TB>
using ChainTile = void (*)(const float*, int64_t, int64_t, const TB*, int64_t, int64_t, int64_t, int64_t, float*,
                           int64_t);
constexpr int kMaxRows = 6, kMaxBlocks = 4;  // one tile: up to 6 rows x 4 x 16 columns (24 of 32 zmm registers)

template <typename TB, int... MR>
constexpr std::array<std::array<ChainTile<TB>, kMaxBlocks>, kMaxRows> chain_tiles(std::integer_sequence<int, MR...>) {
  return {{{chain_tile<MR + 1, 1, TB>, chain_tile<MR + 1, 2, TB>, chain_tile<MR + 1, 3, TB>, chain_tile<MR + 1, 4, TB>}...}};
}
template <typename TB>
constexpr auto kChainTiles = chain_tiles<TB>(std::make_integer_sequence<int, kMaxRows>{});

// c[i, n] = sum_k a[i, k] * bt[k, n] for i < M, n < N, k < K, each entry MKL's way (above); a[i, k] at
// a[i * a_row + k * a_k]; bt's 16-column blocks ldblock apart (chain_tile). part: scratch of kMaxRows * N floats for
// the partial products of k chunks after the first.
template <typename TB>
void fma_chain_rows(const float* a, int64_t a_row, int64_t a_k, int64_t M, const TB* bt, int64_t ldb, int64_t K,
                    int64_t N, int64_t k_chunk, float* c, int64_t ldc, float* part, int64_t ldblock = kLanes) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t mr = std::min<int64_t>(kMaxRows, M - m0);
    for (int64_t k0 = 0; k0 < K; k0 += k_chunk) {
      const int64_t k1 = std::min(K, k0 + k_chunk);
      float* dst = k0 == 0 ? c + m0 * ldc : part;
      const int64_t ldd = k0 == 0 ? ldc : N;
      for (int64_t n0 = 0; n0 < N; n0 += kMaxBlocks * kLanes) {
        const int64_t nb = std::min<int64_t>(kMaxBlocks, (N - n0) / kLanes);
        kChainTiles<TB>[mr - 1][nb - 1](a + m0 * a_row, a_row, a_k, bt + n0 / kLanes * ldblock, ldb, ldblock, k0, k1,
                                        dst + n0, ldd);
      }
      if (k0 > 0)
        for (int64_t i = 0; i < mr; ++i)
          for (int64_t n = 0; n < N; ++n) c[(m0 + i) * ldc + n] = c[(m0 + i) * ldc + n] + part[i * N + n];
    }
  }
}

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// ops.tree_combine in place over leaves buffers of `len` floats each (buf[j] at buf + j * len): adjacent
// pairs first, the sum lands in buf[0]. For a power-of-two count this is the stack order of the Python code.
void tree_combine_in_place(float* buf, int64_t leaves, int64_t len) {
  for (int64_t step = 1; step < leaves; step *= 2)
    for (int64_t j = 0; j + step < leaves; j += 2 * step) {
      float* dst = buf + j * len;
      const float* src = buf + (j + step) * len;
      for (int64_t i = 0; i < len; ++i) dst[i] = dst[i] + src[i];
    }
}

// ops.matmul_tree's entries as fma chains: K split into `leaves` equal leaves, each fma_chain_rows (its
// k chunks added in order), the leaves combined by the pairwise tree -- per block of kMaxRows rows of a.
template <typename TB>
void fma_chain_tree_rows(const float* a, int64_t a_row, int64_t a_k, int64_t M, const TB* bt, int64_t ldb,
                         int64_t K, int64_t N, int64_t k_chunk, int64_t leaves, float* c, int64_t ldc,
                         int64_t ldblock = kLanes) {
  std::vector<float> part(kMaxRows * N);
  if (leaves == 1) {
    fma_chain_rows(a, a_row, a_k, M, bt, ldb, K, N, k_chunk, c, ldc, part.data(), ldblock);
    return;
  }
  const int64_t width = K / leaves;
  std::vector<float> leaf(leaves * kMaxRows * N);
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t mr = std::min<int64_t>(kMaxRows, M - m0);
    for (int64_t j = 0; j < leaves; ++j)
      fma_chain_rows(a + m0 * a_row + j * width * a_k, a_row, a_k, mr, bt + j * width * ldb, ldb, width, N, k_chunk,
                     leaf.data() + j * kMaxRows * N, N, part.data(), ldblock);
    tree_combine_in_place(leaf.data(), leaves, kMaxRows * N);
    for (int64_t i = 0; i < mr; ++i) std::copy(leaf.data() + i * N, leaf.data() + (i + 1) * N, c + (m0 + i) * ldc);
  }
}

// wt[k * ldp + j] = w[j * ldw + k] for j < rows (<= 16) and k < K, 0 for j >= rows: 16 rows of a weight (fp32,
// or bf16 widened) as a fp32 panel of its transpose (copies: no bit changes)
template <typename T>
void weight_panel(const T* w, int64_t ldw, int64_t rows, int64_t K, float* wt, int64_t ldp) {
  int64_t k0 = 0;
#if defined(__AVX512F__)
  if (rows == kLanes)
    for (; k0 + kLanes <= K; k0 += kLanes) {
      __m512i r[16];
      for (int64_t j = 0; j < kLanes; ++j) r[j] = load_fp32x16(w + j * ldw + k0);
      transpose_16x16(r);
      for (int64_t d = 0; d < kLanes; ++d) _mm512_storeu_si512(wt + (k0 + d) * ldp, r[d]);
    }
#elif defined(__AVX2__)
  if (rows == kLanes)
    for (; k0 + 8 <= K; k0 += 8)
      for (int64_t half = 0; half < 2; ++half) {  // rows 8 * half .. + 7: an 8 x 8 transpose
        __m256 r[8], t[8];
        for (int j = 0; j < 8; ++j) r[j] = load_fp32x8(w + (8 * half + j) * ldw + k0);
        for (int j = 0; j < 8; j += 2) {
          t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
          t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
        }
        for (int g = 0; g < 8; g += 4) {
          r[g] = _mm256_shuffle_ps(t[g], t[g + 2], _MM_SHUFFLE(1, 0, 1, 0));
          r[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], _MM_SHUFFLE(3, 2, 3, 2));
          r[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], _MM_SHUFFLE(1, 0, 1, 0));
          r[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], _MM_SHUFFLE(3, 2, 3, 2));
        }
        for (int d = 0; d < 4; ++d) {  // k0 + d from the low 128 bits, k0 + 4 + d from the high
          _mm256_storeu_ps(wt + (k0 + d) * ldp + 8 * half, _mm256_permute2f128_ps(r[d], r[4 + d], 0x20));
          _mm256_storeu_ps(wt + (k0 + 4 + d) * ldp + 8 * half, _mm256_permute2f128_ps(r[d], r[4 + d], 0x31));
        }
      }
#endif
  for (int64_t k = k0; k < K; ++k)
    for (int64_t j = 0; j < kLanes; ++j) wt[k * ldp + j] = j < rows ? static_cast<float>(w[j * ldw + k]) : 0.0f;
}

// A weight [N, K]'s chain pack [parts, groups, 4, K, 16]: the weight in `parts` equal row blocks (an expert's gate
// and up rows), each as groups of kGroupRows rows, each group as 4 strips of 16 rows of its transpose:
// pack[q][g][b][k][j] = block q's row 64 g + 16 b + j's value k (0 past the block's rows), in the weight's dtype (a
// bf16 pack is widened as the chain tiles read it). A tile reads a group's 4 strips as concurrent streams, which a
// core reads faster than one stream of the same bytes (stock vLLM-CPU's vec micro-GEMM packs [N/16, K, 16] for the
// same reason). Built once per weight load (pack_chain_weight): few rows then read the weight as laid out, where
// few_rows_times_weight lays it out in every call.
constexpr int64_t kGroupRows = kMaxBlocks * kLanes;

template <typename T>
void chain_pack_group(const T* w, int64_t rows, int64_t K, T* group) {
  for (int64_t k0 = 0; k0 < K; k0 += kLanes)  // 16 values of a row at a time: one cache line read per row
    for (int64_t j = 0; j < kGroupRows; ++j)
      for (int64_t k = k0; k < std::min(K, k0 + kLanes); ++k)
        group[j / kLanes * K * kLanes + k * kLanes + j % kLanes] = j < rows ? w[j * K + k] : T(0);
}

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

// fma_chain_tree_rows's entries for few rows x [M, K] (x[i * ldx + k]) and the nn <= kGroupRows weight rows of
// one group (chain_pack_group's layout, fp32 or bf16): the weight rows' chains fill the vector lanes, where x's
// few rows would leave them empty. c[i * ldc + j] for j < nn; sums: a buffer the caller keeps.
template <typename TB>
void few_rows_times_group(const float* x, int64_t ldx, int64_t M, const TB* group, int64_t K, int64_t nn,
                          int64_t k_chunk, int64_t leaves, float* c, int64_t ldc, std::vector<float>& sums) {
  const int64_t width = round_up(nn, kLanes);
  sums.resize(M * width);
  fma_chain_tree_rows(x, ldx, 1, M, group, kLanes, K, width, k_chunk, leaves, sums.data(), width, K * kLanes);
  for (int64_t i = 0; i < M; ++i) std::copy(sums.data() + i * width, sums.data() + i * width + nn, c + i * ldc);
}

// few_rows_times_group over weight rows w [N, K] (w[n * ldw + k], fp32 or bf16 widened) laid out in this call,
// one group at a time (weight_panel); c[i * ldc + n]; scratch: buffers the caller keeps.
constexpr int64_t kFewRows = 4;  // up to this many rows, a linear's rows are broadcast against weight panels

// Up to this many rows a product reads its weight's chain pack (few_rows_times_group) when it has one. More fp32
// rows read the weight as it is (transposed, the rows as lanes): the pack's tiles read a group once per kMaxRows
// rows, the transposed product reads the weight once. bf16's would widen every weight block first.
constexpr int64_t kFp32PackRows = 8;
int64_t chain_pack_rows(at::ScalarType weight_dtype) { return weight_dtype == at::kFloat ? kFp32PackRows : kGroupRows; }
struct PanelScratch {
  std::vector<float> panel, sums;
};
template <typename T>
void few_rows_times_weight(const float* x, int64_t ldx, int64_t M, const T* w, int64_t ldw, int64_t N, int64_t K,
                           int64_t k_chunk, int64_t leaves, float* c, int64_t ldc, PanelScratch& s) {
  s.panel.resize(K * kGroupRows);
  for (int64_t n0 = 0; n0 < N; n0 += kGroupRows) {
    const int64_t nn = std::min(kGroupRows, N - n0);
    for (int64_t p = 0; p < nn; p += kLanes)
      weight_panel(w + (n0 + p) * ldw, ldw, std::min(kLanes, nn - p), K, s.panel.data() + p * K, kLanes);
    few_rows_times_group(x, ldx, M, s.panel.data(), K, nn, k_chunk, leaves, c + n0, ldc, s.sums);
  }
}

// torch.exp's fp32 bits where this torch has MKL: ATen's vml::vexp calls VML's vmsExp with high accuracy,
// denormals kept and errors ignored on every contiguous run, and VML's result is elementwise. Resolved
// weakly (a torch without MKL lacks it) and used only once native.exp_is_torchs has checked it
// (use_vml_exp); otherwise exp_in_place calls at::exp.
extern "C" void VMSEXP_(const int* n, const float* a, float* r, const long long* mode) __attribute__((weak));
constexpr long long kVmlTorchMode = 0x2 /* HA */ | 0x140000 /* FTZDAZ_OFF */ | 0x100 /* ERRMODE_IGNORE */;
std::atomic<bool> g_vml_exp{false};

bool use_vml_exp(bool on) {
  g_vml_exp = on && VMSEXP_ != nullptr;
  return g_vml_exp;
}

void exp_in_place(float* x, int64_t n) {
  if (n <= 0) return;
  if (g_vml_exp) {
    const int count = static_cast<int>(n);
    VMSEXP_(&count, x, x, &kVmlTorchMode);
  } else {
    at::from_blob(x, {n}, at::TensorOptions().dtype(at::kFloat)).exp_();
  }
}

// exp_in_place on a copy of a 1-d fp32 tensor (what native.exp_is_torchs compares with torch.exp).
at::Tensor exp_fp32(const at::Tensor& x) {
  check_cpu_float(x, "exp_fp32");
  auto out = x.contiguous().clone();
  exp_in_place(out.data_ptr<float>(), out.numel());
  return out;
}

// ---- bf16 linears on the dot-product instruction (AVX512-BF16) ----
// vdpbf16ps adds two bf16 products to an fp32 lane, the high half's first, each add rounded to nearest:
// two steps of an fma chain, as a product of two bf16 is exact in fp32. With each k pair's halves
// swapped (k = 2p in the high half) it computes fma_chain_rows' chain over k = 0, 1, ... on the
// fp32-widened operands -- the same bits, read as bf16 -- except that it flushes denormal inputs and
// results to zero (checked at load: native.bf16_dot_lib). dot_exact says when no denormal can occur;
// where it cannot say so, the columns are computed as std::fma chains of the widened values.

float widen(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// dst[i] = at::BFloat16(src[i]) for i < n: c10's round to nearest even, 16 at a time. A NaN becomes 0x7FC0, as
// c10 writes it (torch's vectorized cast writes 0xFFFF): a NaN's payload is the one thing it may not share.
void to_bf16(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF), nan = _mm512_set1_epi32(0x7FC0);
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}

// ops.silu_mul's bits on one run of len <= kSiluRun values (the one activation of silu_mul and moe_experts):
// h = fp32 gate, e = exp(-h) (exp_in_place), silu = h / (1 + e) rounded to T, out = silu * up rounded once to
// T, as ATen multiplies. out may be gate (each value is read before it is written).
constexpr int64_t kSiluRun = 1024;  // values per exp call
template <typename T>
void silu_mul_run(const T* g, const T* u, T* o, int64_t len) {
  float e[kSiluRun];
  for (int64_t i = 0; i < len; ++i) e[i] = -static_cast<float>(g[i]);
  exp_in_place(e, len);
  for (int64_t i = 0; i < len; ++i) e[i] = static_cast<float>(g[i]) / (1.0f + e[i]);
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < len; ++i) o[i] = e[i] * u[i];
  } else {  // silu and the product each rounded to bf16
    to_bf16(e, o, len);
    for (int64_t i = 0; i < len; ++i) e[i] = static_cast<float>(o[i]) * static_cast<float>(u[i]);
    to_bf16(e, o, len);
  }
}

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
DotPack dot_pack_of(const std::vector<at::Tensor>& pack, int64_t N, int64_t K);

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
  struct Buffers {
    std::vector<float> sums;
    std::vector<at::BFloat16> gate, up;  // one (expert, column group)'s [count, kDotGroup], grown as needed
  };
  auto make = [&] {
    return Buffers{std::vector<float>(kDotRows * kDotGroup * std::max(gate_up_leaves, down_leaves)), {}, {}};
  };
  for_each_item(E * gu_groups, make, [&](Buffers& buf, int64_t item) {
    // columns g*32.. of gate and of up, then act = silu_mul_run(gate, up)
    const int64_t e = item / gu_groups, g = item % gu_groups, count = start[e + 1] - start[e];
    if (count == 0) return;
    if (buf.gate.size() < static_cast<size_t>(count * kDotGroup))
      buf.gate.resize(count * kDotGroup), buf.up.resize(count * kDotGroup);
    for (int half = 0; half < 2; ++half) {
      const int64_t b = g + half * gu_groups;  // the pack's group: gate rows first, then up rows
      at::BFloat16* dst = half == 0 ? buf.gate.data() : buf.up.data();
      dot_group(x_rows[e], gu16[e], gu_pack[e].group_panels(b), gu_pack[e].group_exponents(b), b * kDotGroup,
                kDotGroup, k_chunk, gate_up_leaves, true, buf.sums.data(),
                [&](int64_t r, const float* row) { to_bf16(row, dst + r * kDotGroup, kDotGroup); });
    }
    for (int64_t first = 0; first < count * kDotGroup; first += kSiluRun) {  // in place in gate
      at::BFloat16* run = buf.gate.data() + first;
      silu_mul_run(run, buf.up.data() + first, run, std::min(kSiluRun, count * kDotGroup - first));
    }
    for (int64_t r = 0; r < count; ++r)
      std::copy_n(buf.gate.data() + r * kDotGroup, kDotGroup,
                  reinterpret_cast<at::BFloat16*>(a16) + (start[e] + r) * I + g * kDotGroup);
  });
  for_each_item(E, none, [&](int, int64_t e) {  // the activations' pairs
    const int64_t first = start[e], count = start[e + 1] - first;
    const Exponents ae = pack_pairs(reinterpret_cast<const uint32_t*>(a16 + first * I), count * I / 2,
                                    as.data() + first * I / 2);
    a_rows[e] = DotRows{a16 + first * I, as.data() + first * I / 2, count, I, ae};
  });
  auto out = at::empty({n_pairs, H}, opts);
  auto* o16 = out.data_ptr<at::BFloat16>();
  for_each_item(E * dn_groups, make, [&](Buffers& buf, int64_t item) {
    const int64_t e = item / dn_groups, b = item % dn_groups, n0 = b * kDotGroup, nn = std::min(kDotGroup, H - n0);
    if (start[e + 1] == start[e]) return;
    dot_group(a_rows[e], dn16[e], dn_pack[e].group_panels(b), dn_pack[e].group_exponents(b), n0, nn, k_chunk,
              down_leaves, true, buf.sums.data(),
              [&](int64_t r, const float* row) { to_bf16(row, o16 + order[start[e] + r] * H + n0, nn); });
  });
  return out;
}

#else
constexpr bool kDotBuilt = false;
void dot_product_tree(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const LinearOut&, bool = true,
                      const DotPack* = nullptr) {
  TORCH_CHECK(false, "linear: this library was built without AVX512-BF16 (bf16_dot_built() is False)");
}
std::vector<at::Tensor> pack_dot_weight(const at::Tensor&) {
  TORCH_CHECK(false, "pack_dot_weight: this library was built without AVX512-BF16 (bf16_dot_built() is False)");
}
at::Tensor moe_experts(const at::Tensor&, const at::Tensor&, const std::vector<at::Tensor>&,
                       const std::vector<at::Tensor>&, const std::vector<std::vector<at::Tensor>>&,
                       const std::vector<std::vector<at::Tensor>>&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "moe_experts: this library was built without AVX512-BF16 (bf16_dot_built() is False)");
}
#endif

bool bf16_dot_built() { return kDotBuilt; }

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

// row[b] = -inf where hidden[b] (selection), and the row's maximum (NaN if an entry is NaN, as amax).
// A maximum of numbers is exact in any order; only the sign of a zero maximum may differ from amax's,
// which no output sees (it is subtracted and exponentiated, or added to log(l) != -0).
float select_and_max(float* row, const bool* hidden, int64_t n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t b = 0;
  float m = neg_inf;
  bool nan = false;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(neg_inf);
  const __m512 ninf = _mm512_set1_ps(neg_inf);
  __mmask16 nans = 0;
  for (; b + kLanes <= n; b += kLanes) {
    const __m128i flags = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hidden + b));
    const __mmask16 hide = _mm_test_epi8_mask(flags, flags);
    const __m512 v = _mm512_mask_blend_ps(hide, _mm512_loadu_ps(row + b), ninf);
    _mm512_storeu_ps(row + b, v);
    nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  m = _mm512_reduce_max_ps(mv);
  nan = nans != 0;
#endif
  for (; b < n; ++b) {
    if (hidden[b]) row[b] = neg_inf;
    nan = nan || std::isnan(row[b]);
    if (row[b] > m) m = row[b];
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// Queries [S, Hq, Tq, D], fp32 or bf16, read through their strides (D's stride 1).
struct Queries {
  const char* data;
  bool bf16;
  int64_t s_q, h_q, t_q;
  explicit Queries(const at::Tensor& q)
      : data(static_cast<const char*>(q.data_ptr())), bf16(q.scalar_type() == at::kBFloat16), s_q(q.stride(0)),
        h_q(q.stride(1)), t_q(q.stride(2)) {
    TORCH_CHECK((q.scalar_type() == at::kFloat || bf16) && q.dim() == 4 && q.stride(3) == 1,
                "attention: queries fp32 or bf16 [S, Hq, Tq, D] with unit stride in D, got ", q.scalar_type(), " ",
                q.sizes(), " strides ", q.strides());
  }
  // dst[d] = fp32 query (s, head, t, d) * scale, for d < D (the torch code's fp32 q * fp32 scaling)
  void scaled(int64_t s, int64_t head, int64_t t, int64_t D, float scale, float* dst) const {
    const int64_t at = s * s_q + head * h_q + t * t_q;
    if (bf16) {
      const auto* src = reinterpret_cast<const uint16_t*>(data) + at;
      for (int64_t d = 0; d < D; ++d) dst[d] = widen(src[d]) * scale;
    } else {
      const auto* src = reinterpret_cast<const float*>(data) + at;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
    }
  }
};

// The tile rows of query head group h: row = position * rep + head within the group (ops._heads_to_tiles),
// scaled -- zero rows after the real ones.
void scaled_query_rows(const Queries& q, int64_t Tq, int64_t D, int64_t rep, int64_t s, int64_t h,
                       int64_t first_row, int64_t n, float scale, float* dst, int64_t ld) {
  const int64_t rows = Tq * rep;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t row = first_row + r;
    float* out = dst + r * ld;
    if (row >= rows)
      std::fill(out, out + D, 0.0f);
    else
      q.scaled(s, h * rep + row % rep, row / rep, D, scale, out);
  }
}

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
  const int64_t E = gate_up.size(), tokens = hidden.size(0), H = hidden.size(1), top_k = chosen.size(1);
  const int64_t I = gate_up[0].size(0) / 2;
  const bool packed = !gate_up_packs.empty();
  // an expert of up to few_rows rows runs its rows against weight panels (chain_pack_rows with packs)
  const int64_t few_rows = packed ? chain_pack_rows(hidden.scalar_type()) : kFewRows;
  std::vector<int64_t> start, order;
  std::tie(start, order) = expert_pairs(chosen, E);
  // few rows, expert e's rows x[e] [count, H] and activations act[e] [count, I]; else its rows as columns,
  // x[e] [H, lanes] and act[e] [I, lanes] with zero-padded lanes; fp32 (T widened)
  const auto count = [&](int64_t e) { return start[e + 1] - start[e]; };
  const auto lanes = [&](int64_t e) { return round_up(count(e), kLanes); };
  std::vector<std::vector<float>> x(E), act(E);
  const T* h = hidden.data_ptr<T>();
  for_each_item(E, [] { return 0; }, [&](int, int64_t e) {
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
  });
  // weight rows per item (a pack's group); lanes per pass
  constexpr int64_t kBlock = kGroupRows, kLaneBlock = kMaxBlocks * kLanes;
  struct Buffers {
    std::vector<float> up, weight;  // up's sums (down: the output's); a bf16 weight block widened
    PanelScratch panel;
  };
  const int64_t gu_blocks = (I + kBlock - 1) / kBlock, dn_blocks = (H + kBlock - 1) / kBlock;
  for_each_item(E * gu_blocks, [] { return Buffers(); }, [&](Buffers& buf, int64_t item) {
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
  });
  auto out = at::empty({tokens * top_k, H}, hidden.options());
  T* o = out.data_ptr<T>();
  for_each_item(E * dn_blocks, [] { return Buffers(); }, [&](Buffers& buf, int64_t item) {
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
  });
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

// ops._attention_kernel without faults, fused: per (sequence, kv head) and query tile, the online softmax
// over the tile's blocks in order -- scores, running maximum, p, PV and the rescaled accumulator of one
// (tile, block) pair at a time, in cache -- each score and PV entry the fma chain MKL computes (above), each
// exp torch's (exp_in_place); keys and values read through their strides once per (sequence, kv head).
// The output is in q's dtype. with_probs (training) also returns the backward's probabilities
// p * exp(ref - lse) per pair [G, R, B] (rows >= live unused), as the torch code saves them, and the
// output's tile rows [S, Hkv, tiles, live, D] (ops._heads_to_tiles of the fp32 output); the output is
// then fp32.
// Attention's keys and values, fp32 or bf16 (widened as read: exact), either [S, Hkv, Tk, D] read through
// their strides, or vLLM's paged cache [blocks, Hkv, block_size, D] (keys and values) where slot t of
// sequence s is the row at element offset slot_rows[s, t] (its block's and its offset's strides).
struct KeyValues {
  const char* k;
  const char* v;
  bool bf16;
  const int64_t* slot_rows = nullptr;
  at::Tensor rows_holder;
  int64_t heads, slots, dim, s_k, s_v, t_k, t_v, h_k, h_v, d_k, d_v;

  KeyValues(const at::Tensor& k_in, const at::Tensor& v_in, const c10::optional<at::Tensor>& slot_rows_in)
      : k(static_cast<const char*>(k_in.data_ptr())), v(static_cast<const char*>(v_in.data_ptr())) {
    TORCH_CHECK(k_in.scalar_type() == v_in.scalar_type() &&
                    (k_in.scalar_type() == at::kFloat || k_in.scalar_type() == at::kBFloat16) && k_in.dim() == 4 &&
                    v_in.dim() == 4,
                "attention: keys and values of one dtype, fp32 or bf16, 4-d; got ", k_in.scalar_type(), " ",
                k_in.sizes(), " and ", v_in.scalar_type(), " ", v_in.sizes());
    bf16 = k_in.scalar_type() == at::kBFloat16;
    heads = k_in.size(1), dim = k_in.size(3);
    s_k = k_in.stride(0), s_v = v_in.stride(0), h_k = k_in.stride(1), h_v = v_in.stride(1);
    t_k = k_in.stride(2), t_v = v_in.stride(2), d_k = k_in.stride(3), d_v = v_in.stride(3);
    slots = k_in.size(2);
    if (slot_rows_in.has_value() && slot_rows_in->defined()) {
      rows_holder = slot_rows_in->contiguous();
      TORCH_CHECK(rows_holder.scalar_type() == at::kLong && rows_holder.dim() == 2 && k_in.strides() == v_in.strides(),
                  "attention: slot_rows int64 [S, Tk] over key and value caches of one layout");
      slot_rows = rows_holder.data_ptr<int64_t>();
      slots = rows_holder.size(1);
    }
  }
  int64_t row(int64_t s, int64_t t, int64_t s_stride, int64_t t_stride) const {
    return slot_rows ? slot_rows[s * slots + t] : s * s_stride + t * t_stride;
  }
  // dst[i * step] = element base + i * stride of data, for i < count (default: D)
  void read(const char* data, int64_t base, int64_t stride, float* dst, int64_t step, int64_t count = -1) const {
    count = count < 0 ? dim : count;
    if (stride == 1 && step == 1) {  // a contiguous run: vectorised copies
      if (bf16) {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(data) + base;
        for (int64_t i = 0; i < count; ++i) dst[i] = widen(src[i]);
      } else {
        std::copy_n(reinterpret_cast<const float*>(data) + base, count, dst);
      }
    } else if (bf16) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(data) + base;
      for (int64_t i = 0; i < count; ++i) dst[i * step] = widen(src[i * stride]);
    } else {
      const float* src = reinterpret_cast<const float*>(data) + base;
      for (int64_t i = 0; i < count; ++i) dst[i * step] = src[i * stride];
    }
  }
  // kt[d * ldk + b] = key (s, h, t0 + b, d) for b < n, d < D: a block's keys, transposed
  void key_block(int64_t s, int64_t h, int64_t t0, int64_t n, float* kt, int64_t ldk) const {
#if defined(__AVX512F__)
    if (d_k == 1 && dim % kLanes == 0) {  // 16 keys x 16 dims at a time, widened and transposed in registers
      for (int64_t b0 = 0; b0 < n; b0 += kLanes) {
        int64_t at[kLanes];
        const int64_t nb = std::min(kLanes, n - b0);
        for (int64_t i = 0; i < nb; ++i) at[i] = row(s, t0 + b0 + i, s_k, t_k) + h * h_k;
        for (int64_t d0 = 0; d0 < dim; d0 += kLanes) {
          __m512i r[16];
          for (int64_t i = 0; i < kLanes; ++i) {
            if (i >= nb)
              r[i] = _mm512_setzero_si512();
            else if (bf16)
              r[i] = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                         reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(k) + at[i] + d0))), 16);
            else
              r[i] = _mm512_loadu_si512(reinterpret_cast<const float*>(k) + at[i] + d0);
          }
          transpose_16x16(r);
          for (int64_t d = 0; d < kLanes; ++d)
            _mm512_mask_storeu_epi32(kt + (d0 + d) * ldk + b0, static_cast<__mmask16>((1u << nb) - 1), r[d]);
        }
      }
      return;
    }
#endif
    if (slot_rows) {
      for (int64_t b = 0; b < n; ++b) read(k, row(s, t0 + b, s_k, t_k) + h * h_k, d_k, kt + b, ldk);
    } else {  // strided rows: d outer, so each store run is contiguous
      for (int64_t d = 0; d < dim; ++d) read(k, s * s_k + h * h_k + t0 * t_k + d * d_k, t_k, kt + d * ldk, 1, n);
    }
  }
  void value_row(int64_t s, int64_t h, int64_t t, float* dst, int64_t step) const {
    read(v, row(s, t, s_v, t_v) + h * h_v, d_v, dst, step);
  }
};

// Every one of n flags set (bools are bytes 0 / 1), eight at a time.
bool all_hidden(const bool* flags, int64_t n) {
  constexpr uint64_t kAllSet = 0x0101010101010101ull;
  uint64_t all = kAllSet;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, flags + i, sizeof word);
    all &= word;
  }
  bool hidden = all == kAllSet;
  for (; i < n; ++i) hidden = hidden && flags[i];
  return hidden;
}

// No infinity or NaN among x[0:n] (a branch-free scan of the exponent fields, which the compiler vectorizes).
bool all_finite(const float* x, int64_t n) {
  uint32_t special = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    special |= (u & 0x7F800000u) == 0x7F800000u;
  }
  return special == 0;
}

std::vector<at::Tensor> attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                  double scaling, int64_t R, int64_t B, int64_t tiles, int64_t live, int64_t n_used,
                                  const at::Tensor& pair_t_in, const at::Tensor& pair_j_in,
                                  const at::Tensor& invisible_in, const at::Tensor& kv_invalid_in, int64_t k_chunk,
                                  bool with_probs, const c10::optional<at::Tensor>& slot_rows_in) {
  TORCH_CHECK(q_in.device().is_cpu() && k_in.device().is_cpu() && v_in.device().is_cpu(),
              "attention: CPU tensors only");
  TORCH_CHECK(B <= k_chunk, "attention: a KV block of ", B, " keys exceeds the K chunk ", k_chunk);
  const auto q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const Queries queries(q);
  const auto pair_t = pair_t_in.contiguous(), pair_j = pair_j_in.contiguous();
  const auto invisible = invisible_in.contiguous(), kv_invalid = kv_invalid_in.contiguous();
  const KeyValues kv(k_in, v_in, slot_rows_in);
  const int64_t S = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3), Hkv = kv.heads, Tk = kv.slots;
  const int64_t rep = Hq / Hkv, rows = Tq * rep, P = pair_t.numel(), G = S * Hkv * P, span = kv_invalid.size(1);
  const int64_t W = D + 1, W16 = round_up(W, kLanes);
  const int64_t* pt = pair_t.data_ptr<int64_t>();
  const int64_t* pj = pair_j.data_ptr<int64_t>();
  const bool* inv = invisible.data_ptr<bool>();
  const bool* kv_inv = kv_invalid.data_ptr<bool>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float scale = static_cast<float>(scaling);
  auto opts = q.options().dtype(at::kFloat);
  const int64_t lanes = S * Hkv * tiles;

  // the plan's pair (t, j), -1 where it has none: a block after every row of the tile, which the torch
  // code scatters as -inf scores and zero PV
  std::vector<int64_t> pair_of(tiles * n_used, -1);
  for (int64_t p = 0; p < P; ++p) pair_of[pt[p] * n_used + pj[p]] = p;
  // The plan's pairs are shared by the batch's sequences; a pair with no key visible to any of a
  // sequence's live rows is an exact no-op for that sequence (scores -inf, so m, l and acc stay as
  // they were; its PV is the block's zero-probability chain). And a row that sees no key at all has
  // l = 0, so its output is 0. In inference neither is computed: seen[s * P + p] is 1 + the pair's last
  // row that sees a key (0: the pair is skipped), seen_rows[s * tiles + t] the most of the tile's pairs
  // (the tile's rows from there on are written as 0; a decode step's tile holds one position's rows).
  std::vector<int64_t> seen(S * P, live), seen_rows(S * tiles, with_probs ? live : 0);
  if (!with_probs) {
    at::parallel_for(0, S * P, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        int64_t r = live;
        while (r > 0 && all_hidden(inv + (i * live + r - 1) * B, B)) --r;
        seen[i] = r;
      }
    });
    for (int64_t s = 0; s < S; ++s)
      for (int64_t p = 0; p < P; ++p)
        seen_rows[s * tiles + pt[p]] = std::max(seen_rows[s * tiles + pt[p]], seen[s * P + p]);
  }
  // keys at or after a sequence's last valid slot only ever reach a row as -inf: not read (zero)
  std::vector<int64_t> n_keys(S, 0);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = std::min(Tk, span); t > 0; --t)
      if (!kv_inv[s * span + t - 1]) {
        n_keys[s] = t;
        break;
      }

  // the output: in q's dtype in inference (the fp32 result cast once, as the torch code does), fp32 with_probs
  auto out = at::empty({S, Hq, Tq, D}, with_probs ? opts : q.options());
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  // output row `row` of tile rows (position-major) of (s, h): acc / l, 0 for a row without keys (l = 0)
  auto out_row = [&](int64_t s, int64_t h, int64_t row, const float* acc, float l) {
    const int64_t at = ((s * Hq + h * rep + row % rep) * Tq + row / rep) * D;
    if (out_bf16) {
      thread_local std::vector<float> values;
      values.resize(D);
      for (int64_t d = 0; d < D; ++d) values[d] = l > 0 ? acc[d] / l : 0.0f;
      to_bf16(values.data(), out.data_ptr<at::BFloat16>() + at, D);
    } else {
      float* dst = out.data_ptr<float>() + at;
      for (int64_t d = 0; d < D; ++d) dst[d] = l > 0 ? acc[d] / l : 0.0f;
    }
  };
  const std::vector<float> no_keys(D + 1, 0.0f);  // acc of a row that sees no key: l = 0
  // with_probs (training): p of every pair in the [G, R, B] layout the torch code saves, each pair's
  // reference maximum, each row's l and final running maximum, the output's tile rows
  auto probs = with_probs ? at::empty({G, R, B}, opts).narrow(1, 0, live) : at::Tensor();
  auto out_tiles = with_probs ? at::empty({S, Hkv, tiles, live, D}, opts) : at::Tensor();
  std::vector<float> m_pair(with_probs ? G * live : 0), l_rows(with_probs ? lanes * live : 0),
      m_last(with_probs ? lanes * live : 0);

  // Work items (s, h, part): part k of the (s, h)'s tiles takes tiles k, k + parts, ... (parts > 1 only
  // when there are fewer (s, h) than twice the threads); handed out largest first, each to the next free
  // thread. Every output is written by the one item computing it, in a fixed order: the bits do not
  // depend on which thread runs which item.
  const int64_t threads = at::get_num_threads(), heads = S * Hkv;
  const int64_t parts = std::clamp<int64_t>((2 * threads + heads - 1) / heads, 1, tiles);
  std::vector<int64_t> work(S, 0), items(heads * parts);
  for (int64_t s = 0; s < S; ++s) work[s] = std::accumulate(seen.begin() + s * P, seen.begin() + (s + 1) * P, int64_t(0));
  for (int64_t i = 0; i < heads * parts; ++i) items[i] = i;
  std::stable_sort(items.begin(), items.end(), [&](int64_t a, int64_t b) { return work[a / parts / Hkv] > work[b / parts / Hkv]; });
  // one (s, h)'s blocks as the products read them: keys transposed [D, B], values [B, W16] with invalid
  // slots 0, a ones column (entry D of a PV row is the row's l) and zero lanes; loaded on first use
  struct Buffers {
    std::vector<float> kt, vb, idle;
    std::vector<char> loaded, none, idle_done;
    std::vector<float> qr, sc, pv, acc, part, m_prev, m_run, m_ref, alpha;
  };
  auto make = [&] {
    return Buffers{std::vector<float>(n_used * D * B), std::vector<float>(n_used * B * W16),
                   std::vector<float>(n_used * W16), std::vector<char>(n_used), std::vector<char>(n_used),
                   std::vector<char>(n_used), std::vector<float>(live * D), std::vector<float>(live * B),
                   std::vector<float>(live * W16), std::vector<float>(live * W),
                   std::vector<float>(kMaxRows * std::max(B, W16)), std::vector<float>(live),
                   std::vector<float>(live), std::vector<float>(live), std::vector<float>(live)};
  };
  const std::vector<float> zeros(std::max(B, W16), 0.0f);  // a zero PV row; the zero probabilities of an idle chain
  for_each_item(heads * parts, make, [&](Buffers& buf, int64_t item) {
    auto &kt = buf.kt, &vb = buf.vb, &idle = buf.idle, &qr = buf.qr, &sc = buf.sc, &pv = buf.pv, &acc = buf.acc;
    auto &part = buf.part, &m_prev = buf.m_prev, &m_run = buf.m_run, &m_ref = buf.m_ref, &alpha = buf.alpha;
    auto &loaded = buf.loaded, &none = buf.none, &idle_done = buf.idle_done;
    const int64_t it = items[item], sh = it / parts, first_tile = it % parts, s = sh / Hkv, h = sh % Hkv;
    std::fill(loaded.begin(), loaded.end(), 0);
    std::fill(idle_done.begin(), idle_done.end(), 0);
    auto values = [&](int64_t j) -> const float* {  // block j loaded; nullptr if none of its slots is valid
      if (!loaded[j]) {
        loaded[j] = 1;
        const int64_t first = j * B, n_slots = std::clamp<int64_t>(Tk - first, 0, B);
        none[j] = std::all_of(kv_inv + s * span + first, kv_inv + s * span + first + n_slots,
                              [](bool x) { return x; });
        float* kj = kt.data() + j * D * B;
        const int64_t n = std::clamp<int64_t>(n_keys[s] - first, 0, B);
        kv.key_block(s, h, first, n, kj, B);
        for (int64_t d = 0; d < D; ++d) std::fill(kj + d * B + n, kj + (d + 1) * B, 0.0f);
        float* vj = vb.data() + j * B * W16;
        for (int64_t b = 0; b < B; ++b) {
          float* dst = vj + b * W16;
          std::fill(dst + D, dst + W16, 0.0f);
          dst[D] = 1.0f;
          const int64_t slot = first + b;
          if (none[j] || slot >= Tk || kv_inv[s * span + slot])
            std::fill(dst, dst + D, 0.0f);
          else
            kv.value_row(s, h, slot, dst, 1);
        }
      }
      return none[j] ? nullptr : vb.data() + j * B * W16;
    };
    for (int64_t t = first_tile; t < tiles; t += parts) {
      const int64_t c = sh * tiles + t;
      // inference computes only the tile's real rows; training all live rows, as the torch code saves them
      const int64_t n_rows = seen_rows[s * tiles + t];
      for (int64_t row = t * R + n_rows; !with_probs && row < std::min(rows, (t + 1) * R); ++row)  // rows seeing no key
        out_row(s, h, row, no_keys.data(), 0.0f);
      if (n_rows == 0) continue;
      scaled_query_rows(queries, Tq, D, rep, s, h, t * R, n_rows, scale, qr.data(), D);
      for (int64_t j = 0; j < n_used; ++j) {
        const int64_t p = pair_of[t * n_used + j], g = sh * P + p;
        const bool computed = p >= 0 && seen[s * P + p] > 0;
        const float* pvr = zeros.data();  // the PV rows added (step 0: one row for all)
        int64_t pv_step = 0;
        float* scores = with_probs && p >= 0 ? probs.data_ptr<float>() + g * R * B : sc.data();
        if (computed) {
          const float* vj = values(j);
          fma_chain_rows(qr.data(), D, 1, n_rows, kt.data() + j * D * B, B, D, B, k_chunk, scores, B, part.data());
          const bool* hidden = inv + (s * P + p) * live * B;
          for (int64_t r = 0; r < n_rows; ++r) m_run[r] = select_and_max(scores + r * B, hidden + r * B, B);
          for (int64_t r = 0; r < n_rows; ++r) {  // the running maximum (cummax: NaN stays) and its reference
            if (j > 0 && !(m_run[r] >= m_prev[r]) && !std::isnan(m_run[r])) m_run[r] = m_prev[r];
            m_ref[r] = m_run[r] == neg_inf ? 0.0f : m_run[r];
            float* row = scores + r * B;
            for (int64_t b = 0; b < B; ++b) row[b] = row[b] - m_ref[r];
          }
          exp_in_place(scores, n_rows * B);
          if (vj != nullptr) {
            fma_chain_rows(scores, B, 1, n_rows, vj, W16, B, W16, k_chunk, pv.data(), W16, part.data());
            pvr = pv.data(), pv_step = W16;
          }  // else every value is 0: each chain is fma(p, 0, +0) = +0
        } else {
          for (int64_t r = 0; r < n_rows; ++r) {
            m_run[r] = j > 0 ? m_prev[r] : neg_inf;
            m_ref[r] = m_run[r] == neg_inf ? 0.0f : m_run[r];
          }
          if (p >= 0) {  // a skipped pair's PV: the block's chain for p = 0, +0 unless a value is not finite
            const float* vj = values(j);
            if (vj != nullptr && !idle_done[j]) {
              idle_done[j] = 1;
              float* dst = idle.data() + j * W16;
              std::fill(dst, dst + W16, 0.0f);
              if (!all_finite(vj, B * W16))  // fma(0, inf, .) is NaN
                fma_chain_rows(zeros.data(), B, 1, 1, vj, W16, B, W16, k_chunk, dst, W16, part.data());
            }
            if (vj != nullptr) pvr = idle.data() + j * W16;
          }
        }
        if (with_probs && p >= 0) std::copy(m_ref.begin(), m_ref.begin() + n_rows, m_pair.begin() + g * live);
        // acc_j = acc_{j-1} * alpha_j + pv_j in block order, alpha_j = exp(m_{j-1} - ref_j)
        if (j == 0) {
          for (int64_t r = 0; r < n_rows; ++r) std::copy(pvr + r * pv_step, pvr + r * pv_step + W, acc.data() + r * W);
        } else {
          for (int64_t r = 0; r < n_rows; ++r) alpha[r] = m_prev[r] - m_ref[r];
          exp_in_place(alpha.data(), n_rows);
          for (int64_t r = 0; r < n_rows; ++r) {
            float* a = acc.data() + r * W;
            const float* add = pvr + r * pv_step;
            for (int64_t d = 0; d < W; ++d) a[d] = a[d] * alpha[r] + add[d];  // two roundings: no fma
          }
        }
        std::copy(m_run.begin(), m_run.begin() + n_rows, m_prev.begin());
      }
      for (int64_t r = 0; r < n_rows; ++r) {  // out = acc / l (0 for a row without keys)
        const int64_t row = t * R + r;
        const float* a = acc.data() + r * W;
        const float l = a[D];
        float* tile_row = with_probs ? out_tiles.data_ptr<float>() + (c * live + r) * D : nullptr;
        if (with_probs) l_rows[c * live + r] = l, m_last[c * live + r] = m_prev[r];
        if (row >= rows) {
          if (tile_row) std::fill(tile_row, tile_row + D, 0.0f);
          continue;
        }
        out_row(s, h, row, a, l);
        if (tile_row) for (int64_t d = 0; d < D; ++d) tile_row[d] = l > 0 ? a[d] / l : 0.0f;
      }
    }
  });
  if (!with_probs) return {out};

  // lse = m + log(l) (0 where not finite) per row, then probs = p * exp(ref - lse) per pair
  auto lse = at::empty({lanes, live}, opts);
  float* ls = lse.data_ptr<float>();
  std::copy(l_rows.begin(), l_rows.end(), ls);
  lse.log_();
  for (int64_t i = 0; i < lanes * live; ++i) {
    const float value = m_last[i] + ls[i];
    ls[i] = std::isfinite(value) ? value : 0.0f;
  }
  auto factor = at::empty({G, live}, opts);
  float* fa = factor.data_ptr<float>();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t c = (g / P) * tiles + pt[g % P];
    for (int64_t r = 0; r < live; ++r) fa[g * live + r] = m_pair[g * live + r] - ls[c * live + r];
  }
  factor.exp_();
  float* sc = probs.data_ptr<float>();
  at::parallel_for(0, G, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g)
      for (int64_t r = 0; r < live; ++r) {
        float* row = sc + g * R * B + r * B;
        const float f = fa[g * live + r];
        for (int64_t b = 0; b < B; ++b) row[b] = row[b] * f;
      }
  });
  return {out, probs, out_tiles};
}

// _Attention.backward's products and sums, fused: per pair p (tile t, block j), in pair order,
//   dP = do_t @ v_j^T;  grad_s = (dP - delta_t) * probs_p;
//   grad_v_j += probs_p^T @ do_t;  grad_q_t += grad_s @ k_j^T;  grad_k_j += grad_s^T @ q_t,
// each product entry the fma chain MKL computes for torch.matmul here -- one chain over the whole
// reduced dim, as the torch code does not split it (every product has >= 4 rows, >= 12 columns,
// >= 400 multiply-adds and a reduced dim <= 128: the caller checks) -- and each += the IEEE add
// index_add_ does, starting from 0. q_t, k_j, v_j are the torch code's q_tiles, k_blocks, v_blocks
// (scaled query rows; keys; values with invalid slots 0), built here from q, k, v once per block.
// Returns (grad_q [S, Hkv, tiles, live, D], grad_k, grad_v [S, Hkv, n_blocks, B, D]).
std::vector<at::Tensor> attention_backward(const at::Tensor& do_in, const at::Tensor& delta_in,
                                           const at::Tensor& probs_in, const at::Tensor& q_in,
                                           const at::Tensor& k_in, const at::Tensor& v_in, double scaling, int64_t R,
                                           const at::Tensor& pair_t_in, const at::Tensor& pair_j_in,
                                           const at::Tensor& kv_invalid_in, int64_t n_blocks) {
  const auto dout = do_in.contiguous(), delta = delta_in.contiguous(), probs = probs_in.contiguous();
  const auto pair_t = pair_t_in.contiguous(), pair_j = pair_j_in.contiguous(), kv_invalid = kv_invalid_in.contiguous();
  const auto q = q_in.to(at::kFloat).contiguous(), k = k_in.to(at::kFloat), v = v_in.to(at::kFloat);
  const Queries queries(q);
  const int64_t S = dout.size(0), Hkv = dout.size(1), tiles = dout.size(2), live = dout.size(3), D = dout.size(4);
  const int64_t B = probs.size(-1), P = pair_t.numel(), Hq = q.size(1), Tq = q.size(2), Tk = k.size(2);
  const int64_t rep = Hq / Hkv, span = kv_invalid.size(1);
  const int64_t D16 = round_up(D, kLanes), B16 = round_up(B, kLanes);
  const int64_t whole = std::max({D, B, live});  // "chunk" size: every product reduces in one chain
  const int64_t* pt = pair_t.data_ptr<int64_t>();
  const int64_t* pj = pair_j.data_ptr<int64_t>();
  const int64_t n_used = P ? *std::max_element(pj, pj + P) + 1 : 0;
  const float* dd = dout.data_ptr<float>();
  const float* de = delta.data_ptr<float>();
  const float* pr = probs.data_ptr<float>();
  const bool* kv_inv = kv_invalid.data_ptr<bool>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2), ks3 = k.stride(3);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2), vs3 = v.stride(3);
  auto opts = dout.options();
  auto grad_q = at::zeros({S, Hkv, tiles, live, D}, opts);
  auto grad_k = at::zeros({S, Hkv, n_blocks, B, D}, opts), grad_v = at::zeros({S, Hkv, n_blocks, B, D}, opts);
  float* gq = grad_q.data_ptr<float>();
  float* gk = grad_k.data_ptr<float>();
  float* gv = grad_v.data_ptr<float>();
  at::parallel_for(0, S * Hkv, 1, [&](int64_t lo, int64_t hi) {
    const int64_t widest = std::max(B16, D16);
    // per (s, h): every used block's keys [B, D16] and values transposed [D, B16] (zero lanes after D, B)
    std::vector<float> k16(n_used * B * D16, 0.0f), vt(n_used * D * B16, 0.0f), do16(live * D16, 0.0f),
        q16(live * D16, 0.0f), gs(live * B16), prod(std::max(live, B) * widest), part(kMaxRows * widest);
    for (int64_t sh = lo; sh < hi; ++sh) {
      const int64_t s = sh / Hkv, h = sh % Hkv;
      for (int64_t j = 0; j < n_used; ++j)
        for (int64_t b = 0; b < B; ++b) {
          const int64_t slot = j * B + b;
          const bool in_range = slot < Tk, valid = in_range && !kv_inv[s * span + slot];
          const float* key = kd + s * ks0 + h * ks1 + slot * ks2;
          const float* value = vd + s * vs0 + h * vs1 + slot * vs2;
          for (int64_t d = 0; d < D; ++d) {
            k16[(j * B + b) * D16 + d] = in_range ? key[d * ks3] : 0.0f;
            vt[(j * D + d) * B16 + b] = valid ? value[d * vs3] : 0.0f;
          }
        }
      int64_t loaded_t = -1;
      for (int64_t p = 0; p < P; ++p) {
        const int64_t t = pt[p], j = pj[p];
        const float* prb = pr + ((sh * P + p) * live) * B;
        if (t != loaded_t) {  // the tile's rows of do and q, zero-padded to 16 columns (pairs come tile by tile)
          const float* dot = dd + ((sh * tiles + t) * live) * D;
          for (int64_t r = 0; r < live; ++r) std::copy(dot + r * D, dot + (r + 1) * D, do16.data() + r * D16);
          scaled_query_rows(queries, Tq, D, rep, s, h, t * R, live, static_cast<float>(scaling),
                            q16.data(), D16);
          loaded_t = t;
        }
        const float* kj = k16.data() + j * B * D16;
        const float* vj = vt.data() + j * D * B16;
        // grad_s = (do @ v^T - delta) * probs
        fma_chain_rows(do16.data(), D16, 1, live, vj, B16, D, B16, whole, gs.data(), B16, part.data());
        for (int64_t r = 0; r < live; ++r) {
          const float dl = de[(sh * tiles + t) * live + r];
          for (int64_t b = 0; b < B; ++b) {
            const float diff = gs[r * B16 + b] - dl;
            gs[r * B16 + b] = diff * prb[r * B + b];
          }
        }
        // grad_v_j += probs^T @ do (probs read transposed in place)
        fma_chain_rows(prb, 1, B, B, do16.data(), D16, live, D16, whole, prod.data(), D16, part.data());
        float* gvj = gv + (sh * n_blocks + j) * B * D;
        for (int64_t b = 0; b < B; ++b)
          for (int64_t d = 0; d < D; ++d) gvj[b * D + d] = gvj[b * D + d] + prod[b * D16 + d];
        // grad_q_t += grad_s @ k_j^T ([B, D] rows of the block's keys)
        fma_chain_rows(gs.data(), B16, 1, live, kj, D16, B, D16, whole, prod.data(), D16, part.data());
        float* gqt = gq + (sh * tiles + t) * live * D;
        for (int64_t r = 0; r < live; ++r)
          for (int64_t d = 0; d < D; ++d) gqt[r * D + d] = gqt[r * D + d] + prod[r * D16 + d];
        // grad_k_j += grad_s^T @ q_t (grad_s read transposed in place)
        fma_chain_rows(gs.data(), 1, B16, B, q16.data(), D16, live, D16, whole, prod.data(), D16, part.data());
        float* gkj = gk + (sh * n_blocks + j) * B * D;
        for (int64_t b = 0; b < B; ++b)
          for (int64_t d = 0; d < D; ++d) gkj[b * D + d] = gkj[b * D + d] + prod[b * D16 + d];
      }
    }
  });
  return {grad_q, grad_k, grad_v};
}

// The number of threads an at::parallel_for over n items runs on: 1 in a library built without OpenMP,
// whose at::parallel_for (header-only) is then a serial loop.
int64_t parallel_threads(int64_t n) {
  std::atomic<int64_t> chunks{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { ++chunks; });
  return chunks.load();
}

// The constants the ops' dispatch reads (native.constants), by name: the C++ is their one source.
std::map<std::string, int64_t> constants() { return {{"dot_group", kDotGroup}}; }

// gated_delta.cpp's entry point, registered in this, the library's one module
std::tuple<at::Tensor, at::Tensor> delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& decay, const at::Tensor& beta,
                                              const at::Tensor& state, const at::Tensor& lengths);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("parallel_threads", &parallel_threads, "threads an at::parallel_for over n items runs on");
  m.def("fixed_sum", &fixed_sum, "ops.fixed_sum for an fp32 CPU tensor");
  m.def("rms_norm", &rms_norm, "ops.rms_norm (inference) for a CPU tensor");
  m.def("constants", &constants, "the library's layout constants the ops' dispatch reads, by name");
  m.def("linear_dot", &linear_dot, "ops._padded_linear_forward on the dot path (bf16, AVX512-BF16)");
  m.def("linear_chain", &linear_chain, "ops._padded_linear_forward on the chain path (MKL's fma chains)");
  m.def("linear_tiles", &linear_tiles, "ops._padded_linear_forward as its torch code's aten calls");
  m.def("pack_chain_weight", &pack_chain_weight, "a weight [N, K] laid out once for few rows on the chain path");
  m.def("moe_experts_chain", &moe_experts_chain, "ops.moe_experts (fp32 or bf16, unsharded) on the chain path in one call");
  m.def("silu_mul", &silu_mul, "ops.silu_mul (inference) for CPU tensors");
  m.def("attention", &attention, "ops._attention_kernel without faults, for CPU tensors");
  m.def("attention_backward", &attention_backward, "_Attention.backward's products and sums, fused");
  m.def("bf16_dot_built", &bf16_dot_built, "whether linear's dot path (AVX512-BF16) was compiled");
  m.def("dot_matmul", &dot_matmul, "the dot path's product, with or without its denormal guard");
  m.def("moe_experts", &moe_experts, "ops.moe_experts (bf16, unsharded, packed) in one call");
  m.def("pack_dot_weight", &pack_dot_weight, "a bf16 weight's dot-path panels and their exponents, laid out once");
  m.def("use_vml_exp", &use_vml_exp, "use VML's exp (checked to be torch.exp's bits) where it is linked");
  m.def("exp_fp32", &exp_fp32, "exp of an fp32 tensor as the fused attention computes it");
  m.def("chain_matmul", &chain_matmul, "a @ b as the fused attention's fma chains compute it");
  m.def("delta_rule", &delta_rule, "gated_delta.delta_rule_torch for fp32 CPU tensors");
}
