"""Qwen3.5 (dense and MoE) on the consistent path: its kernels, the training model and the CPU engine.

Kernels (bitwise, ``torch.equal``, against a plain torch statement of transformers' math where that is
equal by construction; close to transformers' modules otherwise): the ``(1 + w)`` RMSNorm, partial RoPE
(the table and the rotation), the sigmoid gate, the shared expert (merged == separate projections). Closeness
to stock transformers (log-probs, gradients, the shared expert and gated attention modules):
``test_qwen35_vs_transformers.py``.
"""

from __future__ import annotations

import pytest
import torch

from true_on_policy.kernels import architectures, moe, ops

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


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
    assert torch.equal(merged, statement)  # against transformers' module: test_qwen35_vs_transformers.py


# ----------------------------------------------------------------------------------------------
# The model: training forward, the CPU engine's prefill / continuation / decode, packing
# ----------------------------------------------------------------------------------------------

from kernel_helpers import patched_transformers  # noqa: E402,F401 (an autouse fixture)
from true_on_policy.rollout.packed_forward import KVCache, forward_packed  # noqa: E402
from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION  # noqa: E402
from true_on_policy.tiny_assets import build_model  # noqa: E402

KINDS = ["qwen35", "qwen35_moe"]
_MODELS: dict = {}


@pytest.fixture(autouse=True)
def flag_off_after():
    yield
    ops.set_switches(consistent=False)


def model_for(kind: str, dtype: torch.dtype):
    if (kind, dtype) not in _MODELS:
        model = build_model(kind, seed=0).to(dtype)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        _MODELS[kind, dtype] = model
    return _MODELS[kind, dtype]


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (n,), generator=gen(seed))


def train(model, seqs, grad: bool = False) -> torch.Tensor:
    """The trainer's forward: the sequences packed in one row, positions restarting at 0 (verl's layout)."""
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.set_grad_enabled(grad):
        return model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits[0]


def serve(model, seq: torch.Tensor, pieces: list[int], companion: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU engine: ``seq`` fed in ``pieces`` over its cache (state carried), each call batched with the
    next token of ``companion`` (another request, its own cache); ``seq``'s logits rows."""
    caches, rows, start, other = [KVCache(), KVCache()], [], 0, 0
    for size in pieces:
        ids, pos, lens = [seq[start:start + size]], [torch.arange(start, start + size)], [size]
        if companion is not None and other < len(companion):
            ids.append(companion[other:other + 1])
            pos.append(torch.tensor([other]))
            lens.append(1)
            other += 1
        rows.append(forward_packed(model, torch.cat(ids), torch.cat(pos), lens, caches[:len(lens)])[:size])
        start += size
    return torch.cat(rows)


@pytest.mark.parametrize("kind", KINDS)
def test_training_forward_equals_prefill_continuation_and_token_by_token(kind, dtype):
    """Bitwise: the trainer's forward under autograd (the GDN's torch code) == the engine's prefill +
    continuation == token by token (its C++ core, state carried), with another request in the batch."""
    model = model_for(kind, dtype)
    seq, companion = tokens(45, 1), tokens(30, 2)
    with ops.consistent(True):
        trained = train(model, [seq], grad=True).detach()
        assert trained.dtype == torch.float32
        for pieces in ([45], [17, 28], [30, 1, 14], [1] * 45):
            assert torch.equal(serve(model, seq, pieces, companion), trained), f"{kind} {dtype} pieces {pieces}"


def test_a_300_token_sequence_decoded_token_by_token_has_the_training_bits():
    model = model_for("qwen35_moe", torch.bfloat16)
    seq = tokens(320, 3)
    with ops.consistent(True):
        assert torch.equal(serve(model, seq, [20] + [1] * 300, tokens(200, 4)), train(model, [seq]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_packed_row_has_each_sequences_bits_alone(kind, dtype):
    """verl packs several sequences in one row, positions restarting at 0: each == alone, == in a padded
    batch (attention mask, left and right padding). Twin: transformers' own forward (flag off) ignores the
    boundaries -- the Gated DeltaNet state leaks from one sequence into the next."""
    model = model_for(kind, dtype)
    seqs = [tokens(n, 10 + n) for n in (17, 9, 23)]
    with ops.consistent(True):
        packed = train(model, seqs)
        alone = torch.cat([train(model, [s]) for s in seqs])
        width = 27
        ids, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
        for b, (s, left) in enumerate(zip(seqs, (2, 0, 4))):
            ids[b, left:left + len(s)], mask[b, left:left + len(s)] = s, 1
        with torch.no_grad():
            padded = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                           use_cache=False).logits
        padded = torch.cat([padded[b, left:left + len(s)] for b, (s, left) in enumerate(zip(seqs, (2, 0, 4)))])
    assert torch.equal(packed, alone) and torch.equal(padded, alone)
    with ops.consistent(False):
        leaked, separate = train(model, seqs), torch.cat([train(model, [s]) for s in seqs])
    torch.testing.assert_close(leaked[:17], separate[:17], atol=0.05, rtol=0.05)  # the first sequence: no leak
    assert (leaked[17:] - separate[17:]).abs().max() > 0.05, "flag off: no state leaked across the packing"


def test_a_gated_delta_forward_replaced_after_patching_is_refused_by_name(monkeypatch):
    """verl 0.9.1 replaces Qwen3_5GatedDeltaNet.forward for the vision-language model types: if that ran
    after patch_transformers(), the consistent layer would not; refused, naming verl's function."""
    verl_qwen35 = pytest.importorskip("verl.models.transformers.qwen3_5")
    model = build_model("qwen35", seed=0)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    monkeypatch.setattr(hf.Qwen3_5GatedDeltaNet, "forward", verl_qwen35.qwen3_5_gated_delta_net_forward)
    with ops.consistent(True), pytest.raises(Exception, match="qwen3_5_gated_delta_net_forward, set after"):
        train(model, [tokens(5, 0)])


def test_verls_decoder_layer_hands_our_layer_cu_seqlens(monkeypatch):
    """verl's Qwen3.5 decoder layer calls the GDN layer with ``cu_seqlens`` only (no other kwargs): ours runs
    on them and gives the bits of its own packing."""
    verl_qwen35 = pytest.importorskip("verl.models.transformers.qwen3_5")
    model = model_for("qwen35", torch.float32)
    seqs = [tokens(n, 30 + n) for n in (11, 7)]
    with ops.consistent(True):
        ours = train(model, seqs)
        monkeypatch.setattr(hf.Qwen3_5DecoderLayer, "forward", verl_qwen35.qwen3_5_decoder_layer_forward)
        ids, pos = torch.cat(seqs)[None], torch.cat([torch.arange(len(s)) for s in seqs])[None]
        with torch.no_grad():
            theirs = model(input_ids=ids, position_ids=pos, use_cache=False, cu_seqlens=torch.tensor([0, 11, 18]),
                           true_on_policy_packing=None).logits[0]
    assert torch.equal(ours, theirs)
