// The CPU core of the consistent Gated DeltaNet: gated_delta.delta_rule_torch's bits in one call, and the
// training backward (gated_delta.CheckpointedDeltaRule's walk, delta_rule_backward). Part of the one native
// library: register_gated_delta adds both to its module.
//
// Per (batch row, head) -- one thread each, tokens in order -- and per state row r (dv rows of dk):
// S[r] *= decay; kv = tree(S[r] * k); delta = (v[r] - kv) * beta; S[r] += delta * k; o[r] = tree(S[r] * q).
// The torch code does each of these for all rows at once, but a row's values only involve that row, so
// the bits are the same. Only correctly rounded fp32 * + -, no exp (decay = exp(g) comes in), built with
// -ffp-contract=off and without -ffast-math: no FMA contraction, no reassociation. tree() is
// ops.fixed_sum: zero-padded to a power of two, element i paired with i + width/2 at every level.
// One token's step is delta_step.h's (shared with gated_delta_layer.cpp).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "delta_step.h"
#include "fixed_tree.h"
#include "library.h"

namespace {

using delta_step::vector_path;
using fixed_tree::pow2_at_least;
using fixed_tree::tree_sum;

void check(const at::Tensor& x, const char* name, at::ScalarType dtype, int64_t dims) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dtype && x.is_contiguous() && x.dim() == dims,
              "delta_rule: ", name, " must be a contiguous CPU ", dtype, " tensor with ", dims, " dims, got ",
              x.scalar_type(), " ", x.sizes(), " on ", x.device());
}

// The inputs delta_rule and delta_rule_backward share: q, k (B, T, H, dk), v (B, T, H, dv), decay, beta (B, T, H)
// contiguous fp32 CPU tensors and lengths (B,) int64. Checks their kinds (each by name) and returns whether their
// shapes fit each other, for the caller's one shape check (its message names the call).
bool check_core_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& decay,
                       const at::Tensor& beta, const at::Tensor& lengths) {
  check(q, "q", at::kFloat, 4);
  check(k, "k", at::kFloat, 4);
  check(v, "v", at::kFloat, 4);
  check(decay, "decay", at::kFloat, 3);
  check(beta, "beta", at::kFloat, 3);
  check(lengths, "lengths", at::kLong, 1);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2);
  return k.sizes() == q.sizes() && v.size(0) == B && v.size(1) == T && v.size(2) == H &&
         decay.sizes() == at::IntArrayRef({B, T, H}) && beta.sizes() == decay.sizes() && lengths.size(0) == B;
}

}  // namespace

// q, k: (B, T, H, dk); v: (B, T, H, dv); decay, beta: (B, T, H); state: (B, H, dv, dk); lengths: (B,) int64.
// Returns (out (B, T, H, dv), new state); out is +0.0 past a row's length.
std::tuple<at::Tensor, at::Tensor> delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& decay, const at::Tensor& beta,
                                              const at::Tensor& state, const at::Tensor& lengths) {
  const bool core_fits = check_core_inputs(q, k, v, decay, beta, lengths);
  check(state, "state", at::kFloat, 4);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), dk = q.size(3), dv = v.size(3);
  TORCH_CHECK(core_fits && state.sizes() == at::IntArrayRef({B, H, dv, dk}), "delta_rule: shapes do not fit q ",
              q.sizes());
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
        delta_step::step(sp + bh * dv * dk, qp + token * dk, kp + token * dk, vp + token * dv, dp[token],
                         bp[token], op + token * dv, dv, dk, width, buf.data(), vectors);
      }
    }
  });
  return {out, new_state};
}

namespace {

// One token of gated_delta._chunk_backward for one head, back from its end: s0 the state entering the token
// (dv x dk), g the gradient of the state after it, turned in place into the gradient of the state entering
// it. dq, dk (dk values) and dv (dv values) are written; ddecay and dbeta returned through pointers. kv is
// recomputed with the forward's tree (its bits); the other sums run in row order r = 0, 1, ... (dq, dk) or
// through the tree (per-row products, ddecay's lanes): fp32, not the torch walk's order (gradients are close,
// not bitwise). buf: width floats; s1, g2, lanes: dk floats each.
void token_backward(const float* s0, float* g, const float* q, const float* k, const float* v, const float* go,
                    float decay, float beta, float* dq, float* dk_out, float* dv_out, float* ddecay,
                    float* dbeta, int64_t dv, int64_t dk, int64_t width, float* buf, float* s1, float* g2,
                    float* lanes) {
  std::fill(dq, dq + dk, 0.0f);
  std::fill(dk_out, dk_out + dk, 0.0f);
  std::fill(lanes, lanes + dk, 0.0f);
  float db = 0.0f;
  for (int64_t r = 0; r < dv; ++r) {
    const float* s0r = s0 + r * dk;
    float* gr = g + r * dk;
    for (int64_t i = 0; i < dk; ++i) {
      s1[i] = s0r[i] * decay;
      buf[i] = s1[i] * k[i];
    }
    const float err = v[r] - tree_sum(buf, dk, width);
    const float delta = err * beta, gor = go[r];
    for (int64_t i = 0; i < dk; ++i) {
      g2[i] = gr[i] + gor * q[i];
      buf[i] = g2[i] * k[i];
    }
    const float ddelta = tree_sum(buf, dk, width);
    const float dkv = -(ddelta * beta);
    dv_out[r] = ddelta * beta;
    db = db + ddelta * err;
    for (int64_t i = 0; i < dk; ++i) {
      const float s2 = s1[i] + delta * k[i];
      const float ds1 = g2[i] + dkv * k[i];
      dq[i] = dq[i] + s2 * gor;
      dk_out[i] = dk_out[i] + (g2[i] * delta + s1[i] * dkv);
      lanes[i] = lanes[i] + ds1 * s0r[i];
      gr[i] = ds1 * decay;
    }
  }
  std::copy(lanes, lanes + dk, buf);
  *ddecay = tree_sum(buf, dk, width);
  *dbeta = db;
}

}  // namespace

// gated_delta.CheckpointedDeltaRule's backward: every chunk of `chunk` tokens in reverse, its states recomputed
// from its checkpoint with the forward's steps (the same bits), then token_backward back from its last
// active token. q, k: (B, T, H, dk); v, grad_out: (B, T, H, dv); decay, beta: (B, T, H); lengths: (B,) int64;
// checkpoints: (ceil(T / chunk), B, H, dv, dk), the state entering each chunk; grad_state: (B, H, dv, dk).
// Returns (dq, dk, dv, ddecay, dbeta, dstate); zeros past a row's length, whose state gradient passes through.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> delta_rule_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& decay, const at::Tensor& beta,
    const at::Tensor& lengths, const at::Tensor& checkpoints, const at::Tensor& grad_out,
    const at::Tensor& grad_state, int64_t chunk) {
  const bool core_fits = check_core_inputs(q, k, v, decay, beta, lengths);
  check(checkpoints, "checkpoints", at::kFloat, 5);
  check(grad_out, "grad_out", at::kFloat, 4);
  check(grad_state, "grad_state", at::kFloat, 4);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), dk = q.size(3), dv = v.size(3);
  TORCH_CHECK(chunk > 0, "delta_rule_backward: chunk must be positive, got ", chunk);
  const int64_t chunks = (T + chunk - 1) / chunk;
  TORCH_CHECK(core_fits && grad_out.sizes() == v.sizes() && grad_state.sizes() == at::IntArrayRef({B, H, dv, dk}) &&
                  checkpoints.sizes() == at::IntArrayRef({chunks, B, H, dv, dk}),
              "delta_rule_backward: shapes do not fit q ", q.sizes(), " and chunk ", chunk);
  auto dq = at::zeros_like(q), dk_ = at::zeros_like(k), dv_ = at::zeros_like(v);
  auto ddecay = at::zeros_like(decay), dbeta = at::zeros_like(beta);
  auto dstate = grad_state.clone();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>(), *cp = checkpoints.data_ptr<float>();
  const float* gop = grad_out.data_ptr<float>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float *dqp = dq.data_ptr<float>(), *dkp = dk_.data_ptr<float>(), *dvp = dv_.data_ptr<float>();
  float *ddp = ddecay.data_ptr<float>(), *dbp = dbeta.data_ptr<float>(), *gp = dstate.data_ptr<float>();
  const int64_t width = pow2_at_least(dk), plane = dv * dk;
  const bool vectors = vector_path(dk);
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> states(chunk * plane), buf(width), s1(dk), g2(dk), lanes(dk), scratch(dv);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H, length = std::min<int64_t>(lp[b], T);
      float* g = gp + bh * plane;
      for (int64_t n = chunks - 1; n >= 0; --n) {
        const int64_t start = n * chunk, stop = std::min(std::min(start + chunk, T), length);
        if (stop <= start) continue;  // every token past the row's length: the gradient passes through
        float* s = states.data();
        std::copy(cp + (n * B * H + bh) * plane, cp + (n * B * H + bh + 1) * plane, s);
        for (int64_t t = start; t + 1 < stop; ++t, s += plane) {  // the state entering each later token
          const int64_t token = (b * T + t) * H + h;
          std::copy(s, s + plane, s + plane);
          delta_step::step(s + plane, qp + token * dk, kp + token * dk, vp + token * dv, dp[token], bp[token],
                           scratch.data(), dv, dk, width, buf.data(), vectors);
        }
        for (int64_t t = stop - 1; t >= start; --t) {
          const int64_t token = (b * T + t) * H + h;
          token_backward(states.data() + (t - start) * plane, g, qp + token * dk, kp + token * dk,
                         vp + token * dv, gop + token * dv, dp[token], bp[token], dqp + token * dk,
                         dkp + token * dk, dvp + token * dv, ddp + token, dbp + token, dv, dk, width, buf.data(),
                         s1.data(), g2.data(), lanes.data());
        }
      }
    }
  });
  return {dq, dk_, dv_, ddecay, dbeta, dstate};
}

void register_gated_delta(pybind11::module& m) {
  m.def("delta_rule", &delta_rule, "gated_delta.delta_rule_torch for fp32 CPU tensors");
  m.def("delta_rule_backward", &delta_rule_backward,
        "gated_delta.CheckpointedDeltaRule's backward for fp32 CPU tensors");
}
