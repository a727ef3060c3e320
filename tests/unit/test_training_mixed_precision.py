"""The training forward of a bf16 verl run: FSDP2 with verl's mixed-precision policy gives the bf16
model's bits.

verl's FSDP engine (verl/workers/engine/fsdp/transformer_impl.py) wraps each decoder layer and the
model in ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32,
cast_forward_inputs=True)`` and runs the forward under ``torch.autocast(bf16)``. The rollout engines
reproduce the plain bf16 model (test_consistent_model, test_vllm_logdiff), so the wrapped forward
must equal it bit for bit. The twin shows the problem the fix removes: the policy casts every
floating argument of a wrapped layer, the fp32 RoPE rows among them, and rows rounded to bf16
rotate differently.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from true_on_policy.kernels.architectures import UnsupportedFeatureError
from true_on_policy.transformers_adapter.forwards import ROPE_CARRIER, convert_model
from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION
from true_on_policy.kernels import ops
from true_on_policy.tiny_assets import build_model, tiny_model_config
from kernel_helpers import patched_transformers  # noqa: F401 (patched_transformers: an autouse fixture)
from ports import free_port

VERL_POLICY = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo group in this process (FSDP2 needs a process group even for one rank)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def flag_on():
    with ops.consistent(True):
        yield


def _model(kind: str) -> nn.Module:
    model = build_model(kind, seed=0)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return convert_model(model)


def _log_probs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
    return ops.token_log_probs(logits[0, :-1], ids[0, 1:])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fsdp2_mixed_precision_forward_has_the_bf16_models_bits(kind, mesh):
    ids = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(1))
    plain = _model(kind).to(torch.bfloat16)
    wrapped = _model(kind)  # fp32 parameters, bf16 compute: verl's model_dtype fp32, param_dtype bf16
    for layer in wrapped.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(**VERL_POLICY))
    fully_shard(wrapped, mesh=mesh, mp_policy=MixedPrecisionPolicy(**VERL_POLICY))
    assert torch.equal(_log_probs(wrapped, ids), _log_probs(plain, ids))


class _Recorder(nn.Module):
    def forward(self, x, rows):
        self.seen = rows
        return x


def test_twin_the_policy_rounds_float_layer_arguments_and_rounded_rope_rows_rotate_differently(mesh):
    cos, sin = ops.rope_table(tiny_model_config("dense"))
    recorder = _Recorder()
    fully_shard(recorder, mesh=mesh, mp_policy=MixedPrecisionPolicy(**VERL_POLICY))
    x = torch.zeros(1, dtype=torch.bfloat16)
    recorder(x, cos)
    assert recorder.seen.dtype == torch.bfloat16 and torch.equal(recorder.seen, cos.to(torch.bfloat16))
    q = torch.randn(1, 4, *cos.shape, generator=torch.Generator().manual_seed(2))
    rounded = ops.apply_rope(q, recorder.seen.float()[None], sin.to(torch.bfloat16).float()[None])
    assert not torch.equal(rounded, ops.apply_rope(q, cos[None], sin[None]))
    # the fix: the rows travel as int32 bit patterns, which the policy leaves alone
    recorder(x, cos.view(ROPE_CARRIER))
    assert torch.equal(recorder.seen.view(torch.float32), cos)


def test_float_position_embeddings_are_refused():
    """With the flag on, apply_rotary_pos_emb takes only the consistent rotary embedding's rows."""
    from transformers.models.qwen3 import modeling_qwen3

    cos, sin = ops.rope_table(tiny_model_config("dense"))
    q = torch.randn(1, 4, 3, cos.shape[1])
    with pytest.raises(UnsupportedFeatureError, match="position embeddings of dtype torch.float32"):
        modeling_qwen3.apply_rotary_pos_emb(q, q, cos[:3][None], sin[:3][None])
