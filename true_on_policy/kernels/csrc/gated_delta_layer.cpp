// gated_delta.gated_delta_net_slots in one call: a Gated DeltaNet layer's step between its input projections and
// out_proj, over vLLM's state slots -- the causal conv + SiLU, q/k l2norm, gating, the delta rule and the gated
// RMSNorm for every sequence of the step, the slots' conv and recurrent states updated in place.
//
// The same bits as the torch code (gated_delta.gated_delta_net_varlen on the gathered slots): the same fp32
// operations in the same order, rounded to the input dtype T where it rounds, the sums ops.fixed_sum's tree,
// exp through exp_in_place (torch.exp's bits), log and sqrt through ATen's (torch.sqrt is not the IEEE square
// root everywhere: norms.cpp); one token's delta-rule step is delta_step.h's. A token's values depend only on
// its sequence's state and its own inputs, so the threads' split (tokens for the elementwise passes,
// (sequence, head) pairs for the recurrence) does not move a bit.
#include "common.h"
#include "delta_step.h"
#include "fixed_tree.h"
#include "library.h"

namespace {

using fixed_tree::pow2_at_least;
using fixed_tree::tree_sum;

// A step's sizes: tokens, conv channels (2 Hk dk + Hv dv) and taps, heads and head dims, sequences.
struct Step {
  int64_t tokens, channels, taps, k_heads, v_heads, dk, dv, sequences;
  int64_t key_dim() const { return k_heads * dk; }
  int64_t value_dim() const { return v_heads * dv; }
};

// The step's sequences: token bounds (S + 1), state slots and whether each starts fresh (zero states).
struct Sequences {
  const int64_t* bounds;
  const int64_t* slots;
  const bool* fresh;
  std::vector<int64_t> of_token;  // the sequence of each token
};

template <typename T>
inline float rounded(float x) {  // x rounded to T (c10's round to nearest even for bf16), as fp32
  return static_cast<float>(static_cast<T>(x));
}

// One token's conv window into mixed (fp32 values of T): acc = ((x[t-K+1] w[0] + x[t-K+2] w[1]) + ...) + x[t]
// w[K-1], the first K - 1 - i taps from the slot's conv state (zeros for a fresh sequence); SiLU as
// acc / (1 + exp(-acc)) rounded to T. squares: per q and k head, tree(x^2) + l2_eps (the l2norm's radicand).
// w: (K, C) fp32; input: C floats of scratch, buf: pow2(dk) floats.
template <typename T>
void token_inputs(const T* x, int64_t x_row, const at::Tensor& conv, const Sequences& seqs, const float* w,
                  const Step& d, int64_t t, float l2_eps, float* mixed, float* squares, float* input, float* buf) {
  const int64_t C = d.channels, K = d.taps, s = seqs.of_token[t], i = t - seqs.bounds[s];
  const T* cache = conv.data_ptr<T>() + seqs.slots[s] * conv.stride(0);
  float* acc = mixed + t * C;
  for (int64_t j = 0; j < K; ++j) {
    const int64_t p = i + j;  // the tap's place in [conv state (K - 1) | the sequence's tokens]
    if (p >= K - 1) {
      const T* row = x + (seqs.bounds[s] + p - (K - 1)) * x_row;
      for (int64_t c = 0; c < C; ++c) input[c] = static_cast<float>(row[c]);
    } else if (seqs.fresh[s]) {
      std::fill(input, input + C, 0.0f);
    } else {
      for (int64_t c = 0; c < C; ++c) input[c] = static_cast<float>(cache[c * conv.stride(1) + p * conv.stride(2)]);
    }
    const float* wj = w + j * C;
    if (j == 0) {
      for (int64_t c = 0; c < C; ++c) acc[c] = input[c] * wj[c];
    } else {
      for (int64_t c = 0; c < C; ++c) acc[c] = acc[c] + input[c] * wj[c];
    }
  }
  for (int64_t c = 0; c < C; ++c) input[c] = -acc[c];
  exp_in_place(input, C);
  for (int64_t c = 0; c < C; ++c) acc[c] = rounded<T>(acc[c] / (1.0f + input[c]));
  const int64_t width = pow2_at_least(d.dk);
  for (int64_t h = 0; h < 2 * d.k_heads; ++h) {  // q heads, then k heads
    const float* head = acc + h * d.dk;
    for (int64_t e = 0; e < d.dk; ++e) buf[e] = head[e] * head[e];
    squares[t * 2 * d.k_heads + h] = tree_sum(buf, d.dk, width) + l2_eps;
  }
}

// The l2norm's division: each q and k head of every token over its root, rounded to T, q times q_scale.
template <typename T>
void normalize_qk(float* mixed, const float* roots, const Step& d, float q_scale) {
  at::parallel_for(0, d.tokens, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t h = 0; h < 2 * d.k_heads; ++h) {
        float* head = mixed + t * d.channels + h * d.dk;
        const float root = roots[t * 2 * d.k_heads + h];
        for (int64_t e = 0; e < d.dk; ++e) head[e] = rounded<T>(head[e] / root);
        if (h < d.k_heads)
          for (int64_t e = 0; e < d.dk; ++e) head[e] = head[e] * q_scale;
      }
  });
}

// torch.sqrt's bits in place (ops.l2norm and ops.rms_norm call it; it is not the IEEE square root everywhere).
void torch_sqrt(std::vector<float>& x) {
  at::from_blob(x.data(), {static_cast<int64_t>(x.size())}, at::TensorOptions().dtype(at::kFloat)).sqrt_();
}

// gated_delta.gating for every (token, value head): decay = exp(-exp(A_log) * softplus(a + dt_bias)), softplus
// log(1 + exp(min(h, threshold))) below the threshold and h above it; beta = 1 / (1 + exp(-b)) rounded to T.
template <typename T>
void gating(const at::Tensor& a, const at::Tensor& b, const float* A_log, const float* dt_bias, const Step& d,
            float threshold, float* decay, float* beta) {
  const int64_t H = d.v_heads, n = d.tokens * H;
  const T *ap = a.data_ptr<T>(), *bp = b.data_ptr<T>();
  std::vector<float> rate(A_log, A_log + H), h(n), e(n);
  exp_in_place(rate.data(), H);
  for (int64_t t = 0; t < d.tokens; ++t)
    for (int64_t v = 0; v < H; ++v) {
      h[t * H + v] = static_cast<float>(ap[t * a.stride(0) + v]) + dt_bias[v];
      e[t * H + v] = std::min(h[t * H + v], threshold);
    }
  exp_in_place(e.data(), n);
  for (int64_t i = 0; i < n; ++i) e[i] = 1.0f + e[i];
  at::from_blob(e.data(), {n}, at::TensorOptions().dtype(at::kFloat)).log_();
  for (int64_t i = 0; i < n; ++i) decay[i] = -rate[i % H] * (h[i] > threshold ? h[i] : e[i]);
  exp_in_place(decay, n);
  for (int64_t t = 0; t < d.tokens; ++t)
    for (int64_t v = 0; v < H; ++v) e[t * H + v] = -static_cast<float>(bp[t * b.stride(0) + v]);
  exp_in_place(e.data(), n);
  for (int64_t i = 0; i < n; ++i) beta[i] = rounded<T>(1.0f / (1.0f + e[i]));
}

// The delta rule per (sequence, value head), tokens in order, on the slot's recurrent state in place (zeroed
// first for a fresh sequence); value head v reads key head v / (Hv / Hk) (transformers' repeat_interleave).
void recurrence(const float* mixed, const float* decay, const float* beta, const Sequences& seqs, const Step& d,
                at::Tensor& state, float* out) {
  const int64_t C = d.channels, H = d.v_heads, repeat = d.v_heads / d.k_heads, plane = d.dv * d.dk;
  const int64_t width = pow2_at_least(d.dk);
  const bool vectors = delta_step::vector_path(d.dk);
  float* states = state.data_ptr<float>();
  for_each_item(
      d.sequences * H, [&] { return std::vector<float>(width); },
      [&](std::vector<float>& buf, int64_t item) {
        const int64_t s = item / H, v = item % H, k = v / repeat;
        float* S = states + seqs.slots[s] * state.stride(0) + v * plane;
        if (seqs.fresh[s]) std::fill(S, S + plane, 0.0f);
        for (int64_t t = seqs.bounds[s]; t < seqs.bounds[s + 1]; ++t) {
          const float* row = mixed + t * C;
          delta_step::step(S, row + k * d.dk, row + d.key_dim() + k * d.dk, row + 2 * d.key_dim() + v * d.dv,
                           decay[t * H + v], beta[t * H + v], out + (t * H + v) * d.dv, d.dv, d.dk, width,
                           buf.data(), vectors);
        }
      });
}

// gated_delta.gated_rms_norm's radicands per (token, value head) on the recurrence's output rounded to T:
// tree(x^2) / dv + eps.
template <typename T>
void norm_squares(const float* out, const Step& d, float eps, float* squares) {
  const int64_t width = pow2_at_least(d.dv);
  at::parallel_for(0, d.tokens * d.v_heads, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(width);
    for (int64_t row = lo; row < hi; ++row) {
      const float* o = out + row * d.dv;
      for (int64_t e = 0; e < d.dv; ++e) buf[e] = rounded<T>(o[e]) * rounded<T>(o[e]);
      squares[row] = tree_sum(buf.data(), d.dv, width) / static_cast<float>(d.dv) + eps;
    }
  });
}

// The rest of gated_delta.gated_rms_norm for one token: x / root rounded to T, times the weight (rounded to T
// where the weight is T's bf16), times silu(z) in fp32, rounded to T. input: scratch of Hv dv floats.
template <typename T, typename W>
void gated_norm(const float* out, const float* roots, const T* z, int64_t z_row, const W* weight, const Step& d,
                int64_t t, T* y, float* input) {
  const int64_t n = d.value_dim();
  const T* zt = z + t * z_row;
  for (int64_t i = 0; i < n; ++i) input[i] = -static_cast<float>(zt[i]);
  exp_in_place(input, n);
  for (int64_t v = 0; v < d.v_heads; ++v) {
    const float* o = out + t * n + v * d.dv;
    const float root = roots[t * d.v_heads + v];
    for (int64_t e = 0; e < d.dv; ++e) {
      const int64_t i = v * d.dv + e;
      float scaled = static_cast<float>(weight[e]) * rounded<T>(rounded<T>(o[e]) / root);
      if constexpr (std::is_same_v<T, W>) scaled = rounded<T>(scaled);
      const float zf = static_cast<float>(zt[i]);
      y[t * n + i] = static_cast<T>(scaled * (zf / (1.0f + input[i])));
    }
  }
}

// The conv states after the step: each slot keeps the last K - 1 raw inputs of [its state | its tokens] (zeros
// for a fresh state); taps in ascending order read only taps not yet written.
template <typename T>
void keep_conv_states(const T* x, int64_t x_row, at::Tensor& conv, const Sequences& seqs, const Step& d) {
  T* cache = conv.data_ptr<T>();
  at::parallel_for(0, d.sequences, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      const int64_t length = seqs.bounds[s + 1] - seqs.bounds[s];
      T* slot = cache + seqs.slots[s] * conv.stride(0);
      for (int64_t p = 0; p < d.taps - 1; ++p) {
        const int64_t from = length + p;  // its place in [state | tokens]
        for (int64_t c = 0; c < d.channels; ++c) {
          T& tap = slot[c * conv.stride(1) + p * conv.stride(2)];
          if (from >= d.taps - 1)
            tap = x[(seqs.bounds[s] + from - (d.taps - 1)) * x_row + c];
          else
            tap = seqs.fresh[s] ? static_cast<T>(0.0f) : slot[c * conv.stride(1) + from * conv.stride(2)];
        }
      }
    }
  });
}

}  // namespace

namespace {

// Input checks, each naming the argument: T-typed activations with unit inner stride, the caches' shapes.
Step check_step(const at::Tensor& mixed_qkv, const at::Tensor& z, const at::Tensor& a, const at::Tensor& b,
                const at::Tensor& bounds, const at::Tensor& slots, const at::Tensor& fresh, const at::Tensor& conv,
                const at::Tensor& state, const at::Tensor& conv_weight, const at::Tensor& norm_weight) {
  const auto dtype = mixed_qkv.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gated_delta_net_slots: mixed_qkv must be fp32 or bf16");
  for (const auto& [x, name] : {std::pair{&mixed_qkv, "mixed_qkv"}, {&z, "z"}, {&a, "a"}, {&b, "b"}})
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == dtype && x->dim() == 2 && x->stride(1) == 1 &&
                    x->size(0) == mixed_qkv.size(0),
                "gated_delta_net_slots: ", name, " must be a (tokens, n) CPU ", dtype, " tensor of unit inner stride");
  TORCH_CHECK(conv.scalar_type() == dtype && conv.dim() == 3 && conv_weight.scalar_type() == dtype &&
                  conv_weight.dim() == 2 && conv_weight.is_contiguous(),
              "gated_delta_net_slots: conv_cache (slots, C, K - 1) and conv_weight (C, K) must be ", dtype);
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 4 && state.stride(3) == 1 &&
                  state.stride(2) == state.size(3) && state.stride(1) == state.size(2) * state.size(3),
              "gated_delta_net_slots: state_cache must be fp32 (slots, Hv, dv, dk), each slot contiguous");
  const auto weight_dtype = norm_weight.scalar_type();
  TORCH_CHECK(norm_weight.is_contiguous() && (weight_dtype == at::kFloat || weight_dtype == at::kBFloat16),
              "gated_delta_net_slots: norm_weight must be contiguous fp32 or bf16");
  const int64_t S = slots.numel(), Hv = a.size(1), dv = state.size(2), dk = state.size(3);
  TORCH_CHECK(bounds.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  fresh.scalar_type() == at::kBool && bounds.is_contiguous() && slots.is_contiguous() &&
                  fresh.is_contiguous() && bounds.numel() == S + 1 && fresh.numel() == S,
              "gated_delta_net_slots: cu_seqlens (S + 1) and slots (S) int64, fresh (S) bool, contiguous");
  const Step d{mixed_qkv.size(0), mixed_qkv.size(1), conv_weight.size(1), 0, Hv, dk, dv, S};
  const int64_t key_dim = (d.channels - Hv * dv) / 2;
  TORCH_CHECK(key_dim > 0 && key_dim % dk == 0 && 2 * key_dim + Hv * dv == d.channels && Hv % (key_dim / dk) == 0 &&
                  z.size(1) == Hv * dv && b.size(1) == Hv && state.size(1) == Hv && norm_weight.numel() == dv &&
                  conv.size(1) == d.channels && conv.size(2) == d.taps - 1 && conv_weight.size(0) == d.channels,
              "gated_delta_net_slots: shapes do not fit mixed_qkv ", mixed_qkv.sizes(), ", z ", z.sizes(), ", a ",
              a.sizes(), ", state_cache ", state.sizes(), ", conv_cache ", conv.sizes(), ", conv_weight ",
              conv_weight.sizes());
  return {d.tokens, d.channels, d.taps, key_dim / dk, Hv, dk, dv, S};
}

Sequences read_sequences(const at::Tensor& bounds, const at::Tensor& slots, const at::Tensor& fresh, int64_t tokens) {
  Sequences seqs{bounds.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), fresh.data_ptr<bool>(), {}};
  const int64_t S = slots.numel();
  TORCH_CHECK(seqs.bounds[0] == 0 && seqs.bounds[S] == tokens,
              "gated_delta_net_slots: cu_seqlens must rise from 0 to ", tokens, " tokens");
  seqs.of_token.reserve(tokens);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(seqs.bounds[s + 1] >= seqs.bounds[s], "gated_delta_net_slots: cu_seqlens must not fall");
    seqs.of_token.insert(seqs.of_token.end(), seqs.bounds[s + 1] - seqs.bounds[s], s);
  }
  return seqs;
}

template <typename T, typename W>
at::Tensor layer_step(const at::Tensor& mixed_qkv, const at::Tensor& z, const at::Tensor& a, const at::Tensor& b,
                      const Sequences& seqs, const Step& d, at::Tensor& conv, at::Tensor& state,
                      const at::Tensor& conv_weight, const at::Tensor& A_log, const at::Tensor& dt_bias,
                      const at::Tensor& norm_weight, double l2_eps, double q_scale, double threshold, double eps) {
  const auto w = conv_weight.to(at::kFloat).t().contiguous();  // (K, C): a tap's weights side by side
  const auto rates = A_log.to(at::kFloat).contiguous(), bias = dt_bias.to(at::kFloat).contiguous();
  std::vector<float> mixed(d.tokens * d.channels), decay(d.tokens * d.v_heads), beta(decay.size());
  std::vector<float> out(d.tokens * d.value_dim()), qk_roots(d.tokens * 2 * d.k_heads), roots(decay.size());
  const T* x = mixed_qkv.data_ptr<T>();
  at::parallel_for(0, d.tokens, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> input(d.channels), buf(pow2_at_least(d.dk));
    for (int64_t t = lo; t < hi; ++t)
      token_inputs<T>(x, mixed_qkv.stride(0), conv, seqs, w.data_ptr<float>(), d, t, static_cast<float>(l2_eps),
                      mixed.data(), qk_roots.data(), input.data(), buf.data());
  });
  torch_sqrt(qk_roots);
  normalize_qk<T>(mixed.data(), qk_roots.data(), d, static_cast<float>(q_scale));
  gating<T>(a, b, rates.data_ptr<float>(), bias.data_ptr<float>(), d, static_cast<float>(threshold), decay.data(),
            beta.data());
  recurrence(mixed.data(), decay.data(), beta.data(), seqs, d, state, out.data());
  keep_conv_states<T>(x, mixed_qkv.stride(0), conv, seqs, d);
  norm_squares<T>(out.data(), d, static_cast<float>(eps), roots.data());
  torch_sqrt(roots);
  auto y = at::empty({d.tokens, d.value_dim()}, mixed_qkv.options());
  at::parallel_for(0, d.tokens, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> input(d.value_dim());
    for (int64_t t = lo; t < hi; ++t)
      gated_norm<T, W>(out.data(), roots.data(), z.data_ptr<T>(), z.stride(0), norm_weight.data_ptr<W>(), d, t,
                       y.data_ptr<T>(), input.data());
  });
  return y;
}

}  // namespace

// gated_delta.gated_delta_net_slots (inference, CPU): mixed_qkv (T, 2 Hk dk + Hv dv), z (T, Hv dv), a, b (T, Hv),
// all fp32 or all bf16 with unit inner stride; cu_seqlens (S + 1), slots (S) int64, fresh (S) bool; conv_cache
// (slots, C, K - 1) of the input dtype, any strides; state_cache (slots, Hv, dv, dk) fp32; conv_weight (C, K);
// A_log, dt_bias (Hv); norm_weight (dv) of the input dtype or fp32. Returns y (T, Hv dv); the listed slots'
// states are updated in place.
at::Tensor gated_delta_net_slots(const at::Tensor& mixed_qkv, const at::Tensor& z, const at::Tensor& a,
                                 const at::Tensor& b, const at::Tensor& cu_seqlens, const at::Tensor& slots,
                                 const at::Tensor& fresh, at::Tensor conv_cache, at::Tensor state_cache,
                                 const at::Tensor& conv_weight, const at::Tensor& A_log, const at::Tensor& dt_bias,
                                 const at::Tensor& norm_weight, double l2_eps, double q_scale, double threshold,
                                 double eps) {
  const Step d = check_step(mixed_qkv, z, a, b, cu_seqlens, slots, fresh, conv_cache, state_cache, conv_weight,
                            norm_weight);
  const Sequences seqs = read_sequences(cu_seqlens, slots, fresh, d.tokens);
  const bool bf16 = mixed_qkv.scalar_type() == at::kBFloat16, fp32_weight = norm_weight.scalar_type() == at::kFloat;
  auto run = [&](auto input, auto weight) {
    using T = decltype(input);
    using W = decltype(weight);
    return layer_step<T, W>(mixed_qkv, z, a, b, seqs, d, conv_cache, state_cache, conv_weight, A_log, dt_bias,
                            norm_weight, l2_eps, q_scale, threshold, eps);
  };
  if (bf16) return fp32_weight ? run(at::BFloat16(), 0.0f) : run(at::BFloat16(), at::BFloat16());
  return fp32_weight ? run(0.0f, 0.0f) : run(0.0f, at::BFloat16());
}

void register_gated_delta_layer(pybind11::module& m) {
  m.def("gated_delta_net_slots", &gated_delta_net_slots,
        "gated_delta.gated_delta_net_slots (inference) for CPU tensors: a Gated DeltaNet layer step over state slots");
}
