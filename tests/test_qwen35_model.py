"""Qwen3.5 (dense and MoE) on the consistent path: its kernels, the training model and the CPU engine.

Kernels (bitwise, ``torch.equal``, against a plain torch statement of transformers' math where that is
equal by construction; close to transformers' modules otherwise): the ``(1 + w)`` RMSNorm, partial RoPE
(the table and the rotation), the sigmoid gate, the shared expert (merged == separate projections).
"""

from __future__ import annotations

import pytest
import torch

from true_on_policy.kernels import architectures, moe, ops

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
hf_moe = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def test_unit_offset_rms_norm_is_transformers_math_on_the_fixed_sum(dtype):
    x = torch.randn(7, 64, generator=gen(0)).to(dtype)
    weight = (0.1 * torch.randn(64, generator=gen(1))).to(dtype)
    ours = ops.rms_norm(x, weight, 1e-6, unit_offset=True)
    h = x.float()
    statement = (h / torch.sqrt(ops.fixed_sum(h * h) / 64 + 1e-6) * (1.0 + weight.float())).to(dtype)
    assert torch.equal(ours, statement)
    assert torch.equal(ops.rms_norm(x[3:4], weight, 1e-6, unit_offset=True), ours[3:4])  # a row alone
    module = hf.Qwen3_5RMSNorm(64, eps=1e-6)
    module.weight.copy_(weight.float())
    torch.testing.assert_close(ours, module.to(dtype)(x))
    assert not torch.equal(ours, ops.rms_norm(x, weight, 1e-6))  # twin: Qwen3's norm rounds otherwise


@torch.no_grad()
def test_sigmoid_gate_is_transformers_rounding_on_the_position_invariant_sigmoid(dtype):
    x, gate = (torch.randn(9, 48, generator=gen(s)).to(dtype) for s in (2, 3))
    assert torch.equal(ops.sigmoid_gate(x, gate), x * (1.0 / (1.0 + torch.exp(-gate.float()))).to(dtype))
    torch.testing.assert_close(ops.sigmoid_gate(x, gate), x * torch.sigmoid(gate))
    with pytest.raises(ValueError, match="share a dtype"):
        ops.sigmoid_gate(x.float(), gate.bfloat16())


TINY = {"head_dim": 32, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 256,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25}}


@torch.no_grad()
def test_partial_rope_is_transformers_table_and_rotation():
    cos, sin = ops.rope_table(TINY)
    assert cos.shape == (256, 8) and architectures.rotary_dim(TINY) == 8
    config = hf.Qwen3_5TextConfig(**{k: v for k, v in TINY.items()})
    their_cos, their_sin = hf.Qwen3_5TextRotaryEmbedding(config)(torch.zeros(1), torch.arange(256)[None])
    assert torch.equal(their_cos[0], cos) and torch.equal(their_sin[0], sin)
    q, k = torch.randn(2, 4, 10, 32, generator=gen(4)), torch.randn(2, 2, 10, 32, generator=gen(5))
    positions = torch.arange(10)[None].expand(2, -1)
    their_q, their_k = hf.apply_rotary_pos_emb(q, k, cos[positions], sin[positions])
    assert torch.equal(ops.apply_rope(q, cos[positions], sin[positions]), their_q)
    assert torch.equal(ops.apply_rope(k, cos[positions], sin[positions]), their_k)
    bf16 = ops.apply_rope(q.bfloat16(), cos[positions], sin[positions])
    assert torch.equal(bf16[..., 8:], q.bfloat16()[..., 8:])  # the rest of the head passes through


def test_mrope_text_positions_are_one_row_and_other_rows_are_refused():
    rows = torch.arange(6)[None, None].expand(3, 2, -1)
    assert torch.equal(ops.text_positions(rows), rows[0])
    image = rows.clone()
    image[1, 0, 3] = 0
    with pytest.raises(NotImplementedError, match="multimodal RoPE"):
        ops.text_positions(image)


@torch.no_grad()
def test_shared_expert_merged_and_separate_projections_give_the_same_bits(dtype):
    hidden = torch.randn(13, 64, generator=gen(6)).to(dtype)
    gate, up = (torch.randn(32, 64, generator=gen(s)).to(dtype) * 0.1 for s in (7, 8))
    down, gate_weight = (torch.randn(64, 32, generator=gen(9)) * 0.1).to(dtype), torch.randn(1, 64, generator=gen(10))
    gate_weight = (gate_weight * 0.1).to(dtype)
    merged = moe.shared_expert(hidden, torch.cat([gate, up]), down, gate_weight)
    assert torch.equal(merged, moe.shared_expert(hidden, (gate, up), down, gate_weight))
    assert torch.equal(moe.shared_expert(hidden[5:6], (gate, up), down, gate_weight), merged[5:6])
    statement = ops.sigmoid_gate(ops.linear(ops.silu_mul(ops.linear(hidden, gate), ops.linear(hidden, up)), down),
                                 ops.linear(hidden, gate_weight))
    assert torch.equal(merged, statement)
    mlp = torch.nn.functional.linear
    reference = torch.sigmoid(mlp(hidden, gate_weight)) * mlp(torch.nn.functional.silu(mlp(hidden, gate))
                                                              * mlp(hidden, up), down)
    torch.testing.assert_close(merged, reference, **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))
