// The CPU core of the consistent Gated DeltaNet: gated_delta.delta_rule_torch's bits in one call (part of
// the one native library: register_gated_delta adds delta_rule to its module).
//
// Per (batch row, head) -- one thread each, tokens in order -- and per state row r (dv rows of dk):
// S[r] *= decay; kv = tree(S[r] * k); delta = (v[r] - kv) * beta; S[r] += delta * k; o[r] = tree(S[r] * q).
// The torch code does each of these for all rows at once, but a row's values only involve that row, so
// the bits are the same. Only correctly rounded fp32 * + -, no exp (decay = exp(g) comes in), built with
// -ffp-contract=off and without -ffast-math: no FMA contraction, no reassociation. tree() is
// ops.fixed_sum: zero-padded to a power of two, element i paired with i + width/2 at every level.
// With AVX-512 and dk a power of two >= 16, a state row stays in vectors and the tree's last four levels
// are lane permutes (tree_sum_vectors): the same pairs, the same bits, without a buffer round trip per level.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "fixed_tree.h"
#include "library.h"

namespace {

using fixed_tree::pow2_at_least;
using fixed_tree::tree_sum;

void check(const at::Tensor& x, const char* name, at::ScalarType dtype, int64_t dims) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dtype && x.is_contiguous() && x.dim() == dims,
              "delta_rule: ", name, " must be a contiguous CPU ", dtype, " tensor with ", dims, " dims, got ",
              x.scalar_type(), " ", x.sizes(), " on ", x.device());
}

// One token of one head: state s (dv x dk) updated in place, output row o (dv).
void token_step(float* s, const float* q, const float* k, const float* v, float decay, float beta, float* o,
                int64_t dv, int64_t dk, int64_t width, float* buf) {
  for (int64_t r = 0; r < dv; ++r) {
    float* row = s + r * dk;
    for (int64_t i = 0; i < dk; ++i) {
      row[i] = row[i] * decay;
      buf[i] = row[i] * k[i];
    }
    const float delta = (v[r] - tree_sum(buf, dk, width)) * beta;
    for (int64_t i = 0; i < dk; ++i) {
      row[i] = row[i] + delta * k[i];
      buf[i] = row[i] * q[i];
    }
    o[r] = tree_sum(buf, dk, width);
  }
}

#ifdef __AVX512F__
constexpr int64_t kMaxVectors = 32;  // dk up to 512 on the vector path

// tree_sum of a row of 16 * vecs values (a power of two) held in vectors: lane l of x[i] is element 16 i + l,
// so adding x[i + vecs] pairs element e with e + 8 vecs (the level's half width); then, inside x[0], lane l
// with lane l + 8, + 4, + 2, + 1. The same pairs as tree_sum, the same bits.
inline float tree_sum_vectors(__m512* x, int64_t vecs) {
  while (vecs > 1) {
    vecs /= 2;
    for (int64_t i = 0; i < vecs; ++i) x[i] = _mm512_add_ps(x[i], x[i + vecs]);
  }
  __m512 v = x[0];
  const __m512i up8 = _mm512_set_epi32(7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8);
  const __m512i up4 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 3, 2, 1, 0, 7, 6, 5, 4);
  const __m512i up2 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 1, 0, 3, 2);
  const __m512i up1 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 0, 1);
  v = _mm512_add_ps(v, _mm512_permutexvar_ps(up8, v));
  v = _mm512_add_ps(v, _mm512_permutexvar_ps(up4, v));
  v = _mm512_add_ps(v, _mm512_permutexvar_ps(up2, v));
  v = _mm512_add_ps(v, _mm512_permutexvar_ps(up1, v));
  return _mm512_cvtss_f32(v);
}

// token_step for dk = 16 * vecs (a power of two): a state row stays in vectors between its two trees.
void token_step_vectors(float* s, const float* q, const float* k, const float* v, float decay, float beta,
                        float* o, int64_t dv, int64_t vecs) {
  __m512 kk[kMaxVectors], qq[kMaxVectors], row[kMaxVectors], prod[kMaxVectors];
  for (int64_t j = 0; j < vecs; ++j) {
    kk[j] = _mm512_loadu_ps(k + 16 * j);
    qq[j] = _mm512_loadu_ps(q + 16 * j);
  }
  const __m512 dd = _mm512_set1_ps(decay);
  for (int64_t r = 0; r < dv; ++r) {
    float* sr = s + r * 16 * vecs;
    for (int64_t j = 0; j < vecs; ++j) {
      row[j] = _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * j), dd);
      prod[j] = _mm512_mul_ps(row[j], kk[j]);
    }
    const __m512 delta = _mm512_set1_ps((v[r] - tree_sum_vectors(prod, vecs)) * beta);
    for (int64_t j = 0; j < vecs; ++j) {
      row[j] = _mm512_add_ps(row[j], _mm512_mul_ps(delta, kk[j]));
      _mm512_storeu_ps(sr + 16 * j, row[j]);
      prod[j] = _mm512_mul_ps(row[j], qq[j]);
    }
    o[r] = tree_sum_vectors(prod, vecs);
  }
}
#endif

bool vector_path(int64_t dk) {
#ifdef __AVX512F__
  return dk >= 16 && dk <= 16 * kMaxVectors && pow2_at_least(dk) == dk;
#else
  return false;
#endif
}

}  // namespace

// q, k: (B, T, H, dk); v: (B, T, H, dv); decay, beta: (B, T, H); state: (B, H, dv, dk); lengths: (B,) int64.
// Returns (out (B, T, H, dv), new state); out is +0.0 past a row's length.
std::tuple<at::Tensor, at::Tensor> delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& decay, const at::Tensor& beta,
                                              const at::Tensor& state, const at::Tensor& lengths) {
  check(q, "q", at::kFloat, 4);
  check(k, "k", at::kFloat, 4);
  check(v, "v", at::kFloat, 4);
  check(decay, "decay", at::kFloat, 3);
  check(beta, "beta", at::kFloat, 3);
  check(state, "state", at::kFloat, 4);
  check(lengths, "lengths", at::kLong, 1);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), dk = q.size(3), dv = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == B && v.size(1) == T && v.size(2) == H &&
                  decay.sizes() == at::IntArrayRef({B, T, H}) && beta.sizes() == decay.sizes() &&
                  state.sizes() == at::IntArrayRef({B, H, dv, dk}) && lengths.size(0) == B,
              "delta_rule: shapes do not fit q ", q.sizes());
  auto out = at::zeros({B, T, H, dv}, q.options());
  auto new_state = state.clone();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float *op = out.data_ptr<float>(), *sp = new_state.data_ptr<float>();
  const int64_t width = pow2_at_least(dk);
  const bool vectors = vector_path(dk);
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(width);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H, length = std::min<int64_t>(lp[b], T);
      for (int64_t t = 0; t < length; ++t) {
        const int64_t token = (b * T + t) * H + h;
#ifdef __AVX512F__
        if (vectors) {
          token_step_vectors(sp + bh * dv * dk, qp + token * dk, kp + token * dk, vp + token * dv, dp[token],
                             bp[token], op + token * dv, dv, dk / 16);
          continue;
        }
#endif
        token_step(sp + bh * dv * dk, qp + token * dk, kp + token * dk, vp + token * dv, dp[token], bp[token],
                   op + token * dv, dv, dk, width, buf.data());
      }
    }
  });
  return {out, new_state};
}

void register_gated_delta(pybind11::module& m) {
  m.def("delta_rule", &delta_rule, "gated_delta.delta_rule_torch for fp32 CPU tensors");
}
