// One token of the gated delta rule for one head, in gated_delta.delta_rule_torch's order (shared by
// gated_delta.cpp's core and backward and gated_delta_layer.cpp's layer step). Per state row r (dv rows of dk):
// S[r] *= decay; kv = tree(S[r] * k); delta = (v[r] - kv) * beta; S[r] += delta * k; o[r] = tree(S[r] * q).
// Only correctly rounded fp32 * + - (built with -ffp-contract=off, no -ffast-math); tree() is ops.fixed_sum.
// With AVX-512 (AVX2) and dk a power of two >= 16 (8), a state row stays in vectors and the tree's last four
// (three) levels are lane permutes (tree_sum_vectors): the same pairs, the same bits, without a buffer round
// trip per level.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "fixed_tree.h"

namespace delta_step {

// One token of one head: state s (dv x dk) updated in place, output row o (dv).
inline void token_step(float* s, const float* q, const float* k, const float* v, float decay, float beta,
                       float* o, int64_t dv, int64_t dk, int64_t width, float* buf) {
  for (int64_t r = 0; r < dv; ++r) {
    float* row = s + r * dk;
    for (int64_t i = 0; i < dk; ++i) {
      row[i] = row[i] * decay;
      buf[i] = row[i] * k[i];
    }
    const float delta = (v[r] - fixed_tree::tree_sum(buf, dk, width)) * beta;
    for (int64_t i = 0; i < dk; ++i) {
      row[i] = row[i] + delta * k[i];
      buf[i] = row[i] * q[i];
    }
    o[r] = fixed_tree::tree_sum(buf, dk, width);
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
constexpr int64_t kMaxVectors = 32;  // dk up to 32 vectors on the vector path
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kVecLanes = 16;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
// inside one vector: lane l with lane l + 8, + 4, + 2, + 1 (the tree's last four levels)
inline float lanes_sum(Vec v) {
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
#else
using Vec = __m256;
constexpr int64_t kVecLanes = 8;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec broadcast(float x) { return _mm256_set1_ps(x); }
// inside one vector: lane l with lane l + 4, + 2, + 1 (the tree's last three levels)
inline float lanes_sum(Vec v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm256_cvtss_f32(v);
}
#endif

// tree_sum of a row of kVecLanes * vecs values (a power of two) held in vectors: lane l of x[i] is element
// kVecLanes i + l, so adding x[i + vecs] pairs element e with e + kVecLanes vecs (the level's half width); then
// lanes_sum inside x[0]. The same pairs as tree_sum, the same bits.
inline float tree_sum_vectors(Vec* x, int64_t vecs) {
  while (vecs > 1) {
    vecs /= 2;
    for (int64_t i = 0; i < vecs; ++i) x[i] = add(x[i], x[i + vecs]);
  }
  return lanes_sum(x[0]);
}

// token_step for dk = kVecLanes * vecs (a power of two): a state row stays in vectors between its two trees.
inline void token_step_vectors(float* s, const float* q, const float* k, const float* v, float decay, float beta,
                               float* o, int64_t dv, int64_t vecs) {
  Vec kk[kMaxVectors], qq[kMaxVectors], row[kMaxVectors], prod[kMaxVectors];
  for (int64_t j = 0; j < vecs; ++j) {
    kk[j] = load(k + kVecLanes * j);
    qq[j] = load(q + kVecLanes * j);
  }
  const Vec dd = broadcast(decay);
  for (int64_t r = 0; r < dv; ++r) {
    float* sr = s + r * kVecLanes * vecs;
    for (int64_t j = 0; j < vecs; ++j) {
      row[j] = mul(load(sr + kVecLanes * j), dd);
      prod[j] = mul(row[j], kk[j]);
    }
    const Vec delta = broadcast((v[r] - tree_sum_vectors(prod, vecs)) * beta);
    for (int64_t j = 0; j < vecs; ++j) {
      row[j] = add(row[j], mul(delta, kk[j]));
      store(sr + kVecLanes * j, row[j]);
      prod[j] = mul(row[j], qq[j]);
    }
    o[r] = tree_sum_vectors(prod, vecs);
  }
}
#endif

// Whether a state row of dk values runs on the vector path (a power of two of whole vectors).
inline bool vector_path(int64_t dk) {
#if defined(__AVX512F__) || defined(__AVX2__)
  return dk >= kVecLanes && dk <= kVecLanes * kMaxVectors && fixed_tree::pow2_at_least(dk) == dk;
#else
  return false;
#endif
}

// token_step, on the vector path where `vectors` (vector_path(dk)) holds: the same bits either way.
inline void step(float* s, const float* q, const float* k, const float* v, float decay, float beta, float* o,
                 int64_t dv, int64_t dk, int64_t width, float* buf, bool vectors) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if (vectors) return token_step_vectors(s, q, k, v, decay, beta, o, dv, dk / kVecLanes);
#endif
  token_step(s, q, k, v, decay, beta, o, dv, dk, width, buf);
}

}  // namespace delta_step
