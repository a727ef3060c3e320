// What every source of the library shares: its threads, exp, bf16 conversions, the k-leaf tree and silu_mul's
// run. Built with -ffp-contract=off and without -ffast-math (native.CFLAGS): no FMA contraction, no
// reassociation, in every source.
#pragma once
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

namespace fixed_order {
// use_vml_exp's switch: one for the whole library
inline std::atomic<bool> g_vml_exp{false};
}  // namespace fixed_order

// Internal linkage: each source compiles (and may inline) its own copy of these helpers, as the one-source
// library did.
namespace {

using fixed_order::g_vml_exp;

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

constexpr int64_t kLanes = 16;  // columns per register block (16 fp32 lanes of a zmm register)

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

// torch.exp's fp32 bits where this torch has MKL: ATen's vml::vexp calls VML's vmsExp with high accuracy,
// denormals kept and errors ignored on every contiguous run, and VML's result is elementwise. Resolved
// weakly (a torch without MKL lacks it) and used only once native.exp_is_torchs has checked it
// (use_vml_exp); otherwise exp_in_place calls at::exp.
extern "C" void VMSEXP_(const int* n, const float* a, float* r, const long long* mode) __attribute__((weak));
constexpr long long kVmlTorchMode = 0x2 /* HA */ | 0x140000 /* FTZDAZ_OFF */ | 0x100 /* ERRMODE_IGNORE */;

void exp_in_place(float* x, int64_t n) {
  if (n <= 0) return;
  if (g_vml_exp) {
    const int count = static_cast<int>(n);
    VMSEXP_(&count, x, x, &kVmlTorchMode);
  } else {
    at::from_blob(x, {n}, at::TensorOptions().dtype(at::kFloat)).exp_();
  }
}

// A bf16 value's bits as fp32 (exact).
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

}  // namespace
