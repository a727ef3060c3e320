"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) as one order-fixed op for both engines.

Design: the recurrent order everywhere, with an fp32 state. Each token is one step on the state
``S`` (per head ``(dv, dk)``): ``S *= exp(g)``, ``delta = (v - S k) * beta``, ``S += delta k^T``,
``o = S q``, every product over ``dk`` an elementwise multiply and :func:`ops.fixed_sum`'s fixed
tree. A token's bits then depend only on the state entering it and its own inputs -- not on how
its sequence was split (full sequence, prefix + continuation, chunked prefill, token-by-token
decode), on the batch or on the threads. Why not a chunked form (transformers' and vLLM's prefill):
its order depends on where a token falls in its chunk, so decode (recurrent) and prefill differ,
and a fixed chunk grid would need decode to replay the partial chunk; the recurrent order is one
code path with no alignment to keep, at the cost of the chunked form's prefill parallelism.

The pieces around the core are pure functions with transformers' rounding points (fp32 inside):
the causal depthwise conv (fp32 taps in order, SiLU, cast to the input dtype; its state: the last
``K - 1`` raw inputs, input dtype), q/k l2norm (fp32, cast to the input dtype, then fp32 for the
core), gating (``g`` fp32; ``beta`` rounded to ``b``'s dtype), the core (fp32; output cast to the
input dtype) and the gated RMSNorm (transformers' casts). Only position-invariant torch kernels are
used: correctly rounded ``+ - * /``, fp32 ``exp``/``log``/``sqrt`` (measured); sigmoid and softplus are
built from them (:func:`ops.sigmoid`; torch's ``sigmoid``, ``softplus``, ``log1p`` and bf16 ``rsqrt`` are not position-invariant).

On CPU the core runs in C++ (``csrc/gated_delta.cpp`` in :mod:`.native`'s library, the same bits) when no
gradient is needed (:data:`ops.ROUTES`), and a serving engine's whole layer step over its state slots
(:func:`gated_delta_net_slots`: conv, gating, l2norm, core, gated norm) is one C++ call
(``csrc/gated_delta_layer.cpp``); ``ops.switched(native=False)`` forces the torch code. With a
gradient, :class:`CheckpointedDeltaRule` runs the same forward bits chunk by chunk, keeping one fp32
state per :data:`CHUNK` tokens, and its backward recomputes each chunk's states from its checkpoint
(memory: ``T / CHUNK + CHUNK`` states, not one per token); its gradients are close to autograd's
through the torch code (and to transformers' chunked reference), not bitwise. No verl, no
transformers import.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from true_on_policy.kernels import ops

SOFTPLUS_THRESHOLD = 20.0  # torch's softplus default: above it, softplus(x) is x
L2NORM_EPS = 1e-6  # transformers' (and FLA's) l2norm eps


class GatedDeltaState(NamedTuple):
    """What a sequence carries from one call to the next (one row per sequence).

    ``conv``: ``(B, C, K - 1)`` the last ``K - 1`` raw conv inputs, in the input dtype (zeros before
    the first token; transformers keeps ``K`` of them). ``recurrent``: ``(B, Hv, dv, dk)`` fp32 --
    vLLM's slot shape; transformers' state is its transpose ``(B, Hv, dk, dv)``.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor


# ----------------------------------------------------------------------------------------------
# Elementwise pieces (fp32, position-invariant kernels only)
# ----------------------------------------------------------------------------------------------


def softplus(x: torch.Tensor) -> torch.Tensor:
    """torch's ``softplus`` (threshold 20) as ``log(1 + exp(x))`` in fp32: torch's softplus and log1p
    kernels are not position-invariant, exp and log are. Below about -17 the result rounds to 0
    where torch's is ~exp(x) (an absolute error under 6e-8). The clamp keeps the unused branch finite
    so its gradient is not NaN."""
    h = x.to(torch.float32)
    inner = torch.log(1.0 + torch.exp(torch.clamp(h, max=SOFTPLUS_THRESHOLD)))
    return torch.where(h > SOFTPLUS_THRESHOLD, h, inner)


def gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """``(g, beta)``: ``g = -exp(A_log) * softplus(a + dt_bias)`` in fp32 (transformers' ``.float()``),
    ``beta = sigmoid(b)`` computed in fp32 and rounded to ``b``'s dtype (transformers' ``b.sigmoid()``)."""
    g = -torch.exp(A_log.to(torch.float32)) * softplus(a.to(torch.float32) + dt_bias.to(torch.float32))
    return g, ops.sigmoid(b).to(b.dtype)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim in fp32 (the sum :func:`ops.fixed_sum`, the
    rsqrt a division: torch's rsqrt is not position-invariant in bf16), cast to ``x``'s dtype."""
    h = x.to(torch.float32)
    return (h / torch.sqrt(ops.fixed_sum(h * h) + eps)).to(x.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None,
                  lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU: ``(out, new_conv_state)``.

    ``x``: ``(B, T, C)``; ``weight``: ``(C, K)`` or nn.Conv1d's ``(C, 1, K)``; ``conv_state``:
    ``(B, C, K - 1)`` raw inputs before ``x`` (None: zeros). Each output is
    ``((x[t-K+1] * w[0] + x[t-K+2] * w[1]) + ...) + x[t] * w[K-1]`` in fp32 (zeros from the state
    included), SiLU in fp32, cast to ``x``'s dtype. ``new_conv_state``: the last ``K - 1`` inputs up
    to each row's length (``lengths``: ``(B,)``, None: all ``T``), in ``x``'s dtype.
    """
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    batch, steps, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"causal_conv1d: weight shape {tuple(weight.shape)} does not fit {channels} channels")
    taps = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(batch, channels, taps - 1)
    if conv_state.shape != (batch, channels, taps - 1) or conv_state.dtype != x.dtype:
        raise ValueError(f"causal_conv1d: conv_state is {conv_state.dtype} {tuple(conv_state.shape)}, expected "
                         f"{x.dtype} {(batch, channels, taps - 1)}")
    full = torch.cat([conv_state.transpose(1, 2), x], dim=1)  # (B, K - 1 + T, C)
    h, w = full.to(torch.float32), weight.to(torch.float32)
    acc = h[:, 0:steps] * w[:, 0]
    for j in range(1, taps):
        acc = acc + h[:, j:j + steps] * w[:, j]
    out = ops.silu(acc).to(x.dtype)
    if lengths is None:
        new_state = full[:, steps:]
    else:
        index = lengths.to(torch.int64)[:, None] + torch.arange(taps - 1, device=x.device)
        new_state = torch.gather(full, 1, index[:, :, None].expand(-1, -1, channels))
    return out, new_state.transpose(1, 2).contiguous()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNormGated (norm, then SiLU gate): ``(ops.rms_norm(x) * silu(gate fp32)).to(x.dtype)``.

    Its casts: fp32 norm, cast to ``x``'s dtype before the weight multiply (in the weight's dtype),
    the gate product in fp32, cast once to ``x``'s dtype. Over the last dim.
    """
    return (ops.rms_norm(x, weight, eps) * ops.silu(gate.to(torch.float32))).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# The delta rule (recurrent order, fp32 state)
# ----------------------------------------------------------------------------------------------


def _check_core(q, k, v, decay, beta, state, lengths) -> None:
    batch, steps, heads, dk = q.shape
    dv = v.shape[-1]
    expected = {"q": (q, (batch, steps, heads, dk)), "k": (k, (batch, steps, heads, dk)),
                "v": (v, (batch, steps, heads, dv)), "decay": (decay, (batch, steps, heads)),
                "beta": (beta, (batch, steps, heads)), "state": (state, (batch, heads, dv, dk))}
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape or tensor.dtype != torch.float32:
            raise ValueError(f"delta_rule: {name} is {tensor.dtype} {tuple(tensor.shape)}, expected fp32 {shape}")
    if lengths is not None and (lengths.shape != (batch,) or bool(((lengths < 0) | (lengths > steps)).any())):
        raise ValueError(f"delta_rule: lengths {lengths.tolist()} must be {batch} values in [0, {steps}]")


def delta_rule_torch(q, k, v, decay, beta, state, lengths=None):
    """The specification of :func:`delta_rule` (autograd runs through it).

    Per token ``t`` and head, on ``S`` ``(dv, dk)``: ``S = S * decay``; ``kv = fixed_sum(S * k)``;
    ``delta = (v - kv) * beta``; ``S = S + delta[:, None] * k``; ``o = fixed_sum(S * q)``. Rows past
    their length keep their state and output +0.0.
    """
    outputs = []
    for t in range(q.shape[1]):
        k_t = k[:, t, :, None, :]
        s = state * decay[:, t, :, None, None]
        kv = ops.fixed_sum(s * k_t)[..., 0]
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        s = s + delta[..., None] * k_t
        o = ops.fixed_sum(s * q[:, t, :, None, :])[..., 0]
        if lengths is not None:
            active = (lengths > t)[:, None, None]
            o = torch.where(active, o, torch.zeros_like(o))
            s = torch.where(active[..., None], s, state)
        outputs.append(o)
        state = s
    out = torch.stack(outputs, 1) if outputs else v.new_zeros(v.shape)
    return out, state


def delta_rule(q, k, v, decay, beta, state, lengths=None):
    """The gated delta rule in the recurrent order: ``(out, new_state)``, both fp32.

    ``q, k``: ``(B, T, H, dk)`` (l2-normed; ``q`` scaled), ``v``: ``(B, T, H, dv)``, ``decay``
    (``exp(g)``) and ``beta``: ``(B, T, H)``, ``state``: ``(B, H, dv, dk)``, all fp32; ``lengths``:
    ``(B,)`` tokens per row (None: all ``T``). Invariant: a token's output and the state after it
    depend only on the state before it and its own inputs (see :func:`delta_rule_torch`). On CPU
    without a gradient the C++ kernel computes the same bits; with one, :class:`CheckpointedDeltaRule`
    (the same forward bits, a backward that keeps one state per :data:`CHUNK` tokens).
    Bits: the project's order, on every route.
    """
    _check_core(q, k, v, decay, beta, state, lengths)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, decay, beta, state)):
        if lengths is None:
            lengths = torch.full((q.shape[0],), q.shape[1], dtype=torch.int64, device=q.device)
        return CheckpointedDeltaRule.apply(q, k, v, decay, beta, state, lengths)
    return _delta_rule_forward(q, k, v, decay, beta, state, lengths)


def _delta_rule_forward(q, k, v, decay, beta, state, lengths):
    """:func:`delta_rule` without a gradient: the C++ core where :data:`ops.ROUTES` picks it, else the torch code."""
    if (kernel := ops._route("delta_rule", q.device, q, k, v, decay, beta, state)).run:
        if lengths is None:
            lengths = torch.full((q.shape[0],), q.shape[1], dtype=torch.int64)
        return kernel.run(q.contiguous(), k.contiguous(), v.contiguous(), decay.contiguous(), beta.contiguous(),
                          state.contiguous(), lengths.to(torch.int64).contiguous())
    return delta_rule_torch(q, k, v, decay, beta, state, lengths)


# ----------------------------------------------------------------------------------------------
# Training: the delta rule under autograd, one checkpoint per chunk
# ----------------------------------------------------------------------------------------------

# Tokens per checkpoint of the training backward. It keeps the state entering every CHUNK-th token
# (T / CHUNK states) and, while it walks one chunk back, the CHUNK states inside it: T / C + C states, least
# at C = sqrt(T) -- 64 sits there for T = 4096 and stays within 2x of the least from T = 1024 to 16384
# (T = 8192: 192 states instead of one per token). It is also transformers' and fla's chunk size. Any value
# gives the same forward bits and the same gradient math.
CHUNK = 64


class CheckpointedDeltaRule(torch.autograd.Function):
    """:func:`delta_rule` under autograd: ``apply(q, k, v, decay, beta, state, lengths)`` -> ``(out, new_state)``.

    Forward: :func:`delta_rule_torch`'s bits (the no-gradient path -- the C++ core where routed -- run chunk
    by chunk: a token's bits depend only on the state entering it), saving the inputs and the fp32 state
    entering each :data:`CHUNK`-token chunk: O(T / CHUNK) states. Backward: the chunks in reverse, each
    chunk's states recomputed from its checkpoint, then the analytic gradient token by token with dS
    accumulated in fp32 (:func:`_chunk_backward`, or the library's ``delta_rule_backward`` where
    :data:`ops.ROUTES` routes it). Gradients are close to autograd's through :func:`delta_rule_torch`,
    not bitwise. ``lengths``: ``(B,)`` int64 (right-padded rows keep their state and output 0).
    """

    @staticmethod
    def forward(ctx, q, k, v, decay, beta, state, lengths):
        steps = q.shape[1]
        checkpoints, outputs = state.new_empty(-(-steps // CHUNK), *state.shape), []
        for index, start in enumerate(range(0, steps, CHUNK)):
            stop = min(start + CHUNK, steps)
            checkpoints[index] = state
            out, state = _delta_rule_forward(*(x[:, start:stop] for x in (q, k, v, decay, beta)), state,
                                             (lengths - start).clamp(0, stop - start))
            outputs.append(out)
        ctx.save_for_backward(q, k, v, decay, beta, lengths, checkpoints)
        if not outputs:  # no token: the state passes through, as a new tensor (an output is not an input)
            return v.new_zeros(v.shape), state.clone()
        return torch.cat(outputs, 1), state

    @staticmethod
    def backward(ctx, grad_out, grad_state):
        q, k, v, decay, beta, lengths, checkpoints = ctx.saved_tensors
        grad_out, grad_state = grad_out.contiguous(), grad_state.contiguous()
        if (kernel := ops._route("delta_rule_backward", q.device, q).run) is not None:
            return (*kernel(q.contiguous(), k.contiguous(), v.contiguous(), decay.contiguous(), beta.contiguous(),
                            lengths.to(torch.int64).contiguous(), checkpoints, grad_out, grad_state, CHUNK), None)
        grads = [torch.zeros_like(x) for x in (q, k, v, decay, beta)]
        dstate = grad_state.clone()
        for index in reversed(range(checkpoints.shape[0])):
            start = index * CHUNK
            stop = min(start + CHUNK, q.shape[1])
            *chunk_grads, dstate = _chunk_backward(*(x[:, start:stop] for x in (q, k, v, decay, beta)),
                                                   checkpoints[index], (lengths - start).clamp(0, stop - start),
                                                   grad_out[:, start:stop], dstate)
            for grad, chunk_grad in zip(grads, chunk_grads):
                grad[:, start:stop] = chunk_grad
        return (*grads, dstate, None)


def _chunk_backward(q, k, v, decay, beta, state, lengths, grad_out, dstate):
    """One chunk of :class:`CheckpointedDeltaRule`'s backward in torch (the specification of the C++ walk):
    ``(dq, dk, dv, ddecay, dbeta, dstate_entering)``.

    The chunk's inputs ``(B, C, H, ...)``, ``state``: the state entering it, ``lengths``: tokens per row in it,
    ``dstate``: the gradient of the state leaving it. The states entering each token are recomputed with
    :func:`delta_rule_torch`'s operations (its bits); then, back from the last token, with ``G`` the gradient
    of ``S`` after the token: ``G2 = G + do q^T``, ``dq = S2^T do``, ``ddelta = G2 k``, ``dv = ddelta beta``,
    ``dbeta = ddelta . (v - kv)``, ``dkv = -ddelta beta``, ``dk = G2^T delta + S1^T dkv``,
    ``dS1 = G2 + dkv k^T``, ``ddecay = dS1 . S0``, and the ``G`` entering the token ``dS1 * decay``. A row past
    its length passes ``G`` through with zero gradients.
    """
    entering, s = [], state
    for t in range(q.shape[1]):
        entering.append(s)
        k_t = k[:, t, :, None, :]
        s1 = s * decay[:, t, :, None, None]
        delta = (v[:, t] - ops.fixed_sum(s1 * k_t)[..., 0]) * beta[:, t, :, None]
        s = torch.where((lengths > t)[:, None, None, None], s1 + delta[..., None] * k_t, s)
    grads = [[] for _ in range(5)]
    for t in reversed(range(q.shape[1])):
        s0, k_t, q_t, go = entering[t], k[:, t], q[:, t], grad_out[:, t]
        d, b = decay[:, t, :, None, None], beta[:, t, :, None]
        s1 = s0 * d
        err = v[:, t] - ops.fixed_sum(s1 * k_t[:, :, None, :])[..., 0]
        delta = err * b
        s2 = s1 + delta[..., None] * k_t[:, :, None, :]
        g2 = dstate + go[..., None] * q_t[:, :, None, :]
        ddelta = (g2 @ k_t[..., None])[..., 0]
        dkv = -(ddelta * b)
        ds1 = g2 + dkv[..., None] * k_t[:, :, None, :]
        active = (lengths > t)[:, None]
        token = (torch.matmul(s2.transpose(-1, -2), go[..., None])[..., 0],
                 (g2.transpose(-1, -2) @ delta[..., None] + s1.transpose(-1, -2) @ dkv[..., None])[..., 0],
                 ddelta * b, (ds1 * s0).sum((-1, -2)), (ddelta * err).sum(-1))
        for grad, value in zip(grads, token):
            grad.append(torch.where(active if value.dim() == 2 else active[..., None], value, 0.0))
        dstate = torch.where(active[..., None, None], ds1 * d, dstate)
    dq, dk, dv, ddecay, dbeta = (torch.stack(g[::-1], 1) for g in grads)
    return dq, dk, dv, ddecay, dbeta, dstate


def gated_delta_rule(query, key, value, g, beta, state=None, lengths=None):
    """transformers' ``*_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)`` in the recurrent order:
    ``(out, new_state)``.

    ``query, key``: ``(B, T, H, dk)``, ``value``: ``(B, T, H, dv)`` (input dtype), ``g`` (fp32) and
    ``beta``: ``(B, T, H)``, ``state``: ``(B, H, dv, dk)`` fp32 or None (zeros). Casts: q/k
    :func:`l2norm` (in their dtype), then everything fp32, ``q * dk**-0.5``; ``out`` in ``value``'s
    dtype; the state stays fp32.
    """
    batch, _, heads, dk = key.shape
    if state is None:
        state = torch.zeros(batch, heads, value.shape[-1], dk, dtype=torch.float32, device=value.device)
    q = l2norm(query).to(torch.float32) * (1 / (dk ** 0.5))
    k = l2norm(key).to(torch.float32)
    out, state = delta_rule(q, k, value.to(torch.float32), torch.exp(g.to(torch.float32)),
                            beta.to(torch.float32), state, lengths)
    return out.to(value.dtype), state


def gated_delta_net(mixed_qkv, z, a, b, *, conv_weight, A_log, dt_bias, norm_weight, head_k_dim: int,
                    head_v_dim: int, eps: float, state: GatedDeltaState | None = None, lengths=None):
    """A GatedDeltaNet layer between its input projections and ``out_proj``: ``(y, new_state)``.

    ``mixed_qkv``: ``(B, T, 2 * Hk * dk + Hv * dv)`` (``in_proj_qkv``), ``z``: ``(B, T, Hv * dv)``,
    ``a``, ``b``: ``(B, T, Hv)``; ``y``: ``(B, T, Hv * dv)`` in ``mixed_qkv``'s dtype. Steps:
    :func:`causal_conv1d`, split into q/k/v heads (q/k repeated to ``Hv`` heads, transformers'
    ``repeat_interleave``), :func:`gating`, :func:`gated_delta_rule`, :func:`gated_rms_norm` with
    gate ``z``. ``state`` carries a sequence across calls (None: a fresh sequence); ``lengths``
    ``(B,)``: tokens per row of a right-padded batch (None: all ``T``).
    """
    batch, steps, channels = mixed_qkv.shape
    v_heads = a.shape[-1]
    value_dim = v_heads * head_v_dim
    key_dim = (channels - value_dim) // 2
    if key_dim <= 0 or key_dim % head_k_dim or 2 * key_dim + value_dim != channels or v_heads % (key_dim // head_k_dim):
        raise ValueError(f"gated_delta_net: mixed_qkv width {channels} does not split into q, k (head_k_dim "
                         f"{head_k_dim}) and v ({v_heads} heads x head_v_dim {head_v_dim})")
    if z.shape != (batch, steps, value_dim) or b.shape != a.shape:
        raise ValueError(f"gated_delta_net: z {tuple(z.shape)} / b {tuple(b.shape)} do not fit "
                         f"{(batch, steps, value_dim)} / {tuple(a.shape)}")
    mixed, conv_state = causal_conv1d(mixed_qkv, conv_weight, None if state is None else state.conv, lengths)
    query, key, value = torch.split(mixed, [key_dim, key_dim, value_dim], dim=-1)
    k_heads = key_dim // head_k_dim
    repeat = v_heads // k_heads
    query = query.reshape(batch, steps, k_heads, head_k_dim).repeat_interleave(repeat, dim=2)
    key = key.reshape(batch, steps, k_heads, head_k_dim).repeat_interleave(repeat, dim=2)
    value = value.reshape(batch, steps, v_heads, head_v_dim)
    g, beta = gating(a, b, A_log, dt_bias)
    out, recurrent = gated_delta_rule(query, key, value, g, beta, None if state is None else state.recurrent,
                                      lengths)
    y = gated_rms_norm(out, z.reshape(batch, steps, v_heads, head_v_dim), norm_weight, eps)
    return y.reshape(batch, steps, value_dim), GatedDeltaState(conv_state, recurrent)


def gated_delta_net_varlen(mixed_qkv, z, a, b, *, cu_seqlens, conv_weight, A_log, dt_bias, norm_weight,
                           head_k_dim: int, head_v_dim: int, eps: float, state: GatedDeltaState | None = None):
    """:func:`gated_delta_net` over the tokens of several sequences laid end to end: ``(y, new_state)``.

    ``mixed_qkv``: ``(T, C)``, ``z``: ``(T, Hv * dv)``, ``a``, ``b``: ``(T, Hv)`` -- sequence ``i`` is
    rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` (``cu_seqlens``: ``(S + 1,)`` from 0, non-decreasing; an empty
    sequence keeps its state). ``state``: each sequence's entering state, batched ``conv (S, C, K - 1)``,
    ``recurrent (S, Hv, dv, dk)`` fp32 (zeros: a fresh sequence; None: all fresh). No state crosses
    from one sequence to the next, and each token has the bits it has in :func:`gated_delta_net` of its
    sequence alone (the sequences run as one right-padded batch). ``y``: ``(T, Hv * dv)``.
    """
    bounds = cu_seqlens.to(device=mixed_qkv.device, dtype=torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    total = mixed_qkv.shape[0]
    if bounds.dim() != 1 or bounds.numel() < 2 or int(bounds[0]) != 0 or int(bounds[-1]) != total \
            or bool((lengths < 0).any()):
        raise ValueError(f"gated_delta_net_varlen: cu_seqlens {bounds.tolist()} must rise from 0 to {total} tokens")
    count, steps = lengths.numel(), int(lengths.max())
    seq = torch.repeat_interleave(torch.arange(count, device=bounds.device), lengths)
    local = torch.arange(total, device=bounds.device) - bounds[:-1][seq]

    def padded(x):
        grid = x.new_zeros(count, steps, *x.shape[1:])
        grid[seq, local] = x
        return grid

    y, new_state = gated_delta_net(padded(mixed_qkv), padded(z), padded(a), padded(b), conv_weight=conv_weight,
                                   A_log=A_log, dt_bias=dt_bias, norm_weight=norm_weight, head_k_dim=head_k_dim,
                                   head_v_dim=head_v_dim, eps=eps, state=state, lengths=lengths)
    return y[seq, local], new_state


def gated_delta_net_slots(mixed_qkv, z, a, b, *, cu_seqlens, slots, fresh, conv_cache, state_cache, conv_weight,
                          A_log, dt_bias, norm_weight, head_k_dim: int, head_v_dim: int, eps: float) -> torch.Tensor:
    """:func:`gated_delta_net_varlen` over a serving engine's state slots: ``y`` ``(T, Hv * dv)``, the slots updated.

    Sequence ``i`` (rows ``cu_seqlens[i]:cu_seqlens[i + 1]``) enters with the states of slot ``slots[i]`` --
    ``conv_cache`` ``(n, C, K - 1)`` in the input dtype (any strides: vLLM's may be a transposed view),
    ``state_cache`` ``(n, Hv, dv, dk)`` fp32 -- or with zeros where ``fresh[i]``, and leaves its new states there.
    Each token has :func:`gated_delta_net_varlen`'s bits. Without a gradient on CPU one C++ call computes the
    whole step (conv, gating, l2norm, delta rule, gated norm: :data:`ops.ROUTES`), the same bits; elsewhere
    :func:`gated_delta_net_slots_torch`, its specification.
    Bits: rest on vml_exp, vml_log and vml_sqrt (the gates, softplus, the norms).
    """
    weight = conv_weight.squeeze(1) if conv_weight.dim() == 3 else conv_weight
    route = ops._route("gated_delta_net_slots", mixed_qkv.device, mixed_qkv, z, a, b, conv_cache, state_cache,
                       weight, norm_weight)
    if route.run:
        return route.run(mixed_qkv, z, a, b, cu_seqlens.to(torch.int64).contiguous(),
                         slots.to(torch.int64).contiguous(), fresh.to(torch.bool).contiguous(), conv_cache,
                         state_cache, weight.contiguous(), A_log, dt_bias, norm_weight.contiguous(), L2NORM_EPS,
                         1 / (head_k_dim ** 0.5), SOFTPLUS_THRESHOLD, eps)
    return gated_delta_net_slots_torch(mixed_qkv, z, a, b, cu_seqlens=cu_seqlens, slots=slots, fresh=fresh,
                                       conv_cache=conv_cache, state_cache=state_cache, conv_weight=weight, A_log=A_log,
                                       dt_bias=dt_bias, norm_weight=norm_weight, head_k_dim=head_k_dim,
                                       head_v_dim=head_v_dim, eps=eps)


def gated_delta_net_slots_torch(mixed_qkv, z, a, b, *, cu_seqlens, slots, fresh, conv_cache, state_cache, conv_weight,
                                A_log, dt_bias, norm_weight, head_k_dim: int, head_v_dim: int,
                                eps: float) -> torch.Tensor:
    """The specification of :func:`gated_delta_net_slots` (its arguments): the slots' states gathered (zeros
    where ``fresh``), :func:`gated_delta_net_varlen`, the new states scattered back."""
    keep = (~fresh)[:, None, None]
    conv = torch.where(keep, conv_cache[slots], conv_cache.new_zeros(()))
    recurrent = torch.where(keep[..., None], state_cache[slots], state_cache.new_zeros(()))
    y, state = gated_delta_net_varlen(mixed_qkv, z, a, b, cu_seqlens=cu_seqlens, conv_weight=conv_weight, A_log=A_log,
                                      dt_bias=dt_bias, norm_weight=norm_weight, head_k_dim=head_k_dim,
                                      head_v_dim=head_v_dim, eps=eps, state=GatedDeltaState(conv, recurrent))
    conv_cache[slots] = state.conv
    state_cache[slots] = state.recurrent
    return y
