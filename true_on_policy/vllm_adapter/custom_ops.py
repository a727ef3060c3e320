"""vLLM's out-of-tree custom ops (``CustomOp.register_oot``, registered by :mod:`.patches`) on
:mod:`true_on_policy.kernels.ops`: RMSNorm, SiluAndMul and RoPE, each computing what the training forward
(:mod:`true_on_policy.transformers_adapter.forwards`) computes for the same token.

RMSNorm: vLLM's fused ``norm(x, residual)`` is HF's ``residual + x`` in the model dtype, then
:func:`ops.rms_norm` (HF adds the residual in the model dtype, vLLM's stock kernel in fp32).
"""

from __future__ import annotations

import torch

from true_on_policy.kernels import ops
from true_on_policy.kernels.architectures import UnsupportedFeatureError

from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.linear_scaling_rope import LinearScalingRotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding


class ConsistentRMSNorm(RMSNorm):
    """vLLM's RMSNorm (optionally fused with the residual add) as HF's RMSNorm on ops.rms_norm."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.variance_size_override is not None or not self.has_weight:
            raise UnsupportedFeatureError(
                "true_on_policy (vLLM): RMSNorm with var_hidden_size or without weight is not covered"
            )
        if residual is None:
            return ops.rms_norm(x, self.weight, self.variance_epsilon)
        summed = residual + x  # HF: hidden_states = residual + hidden_states, in the model dtype
        return ops.rms_norm(summed, self.weight, self.variance_epsilon), summed


class ConsistentGemmaRMSNorm(GemmaRMSNorm):
    """vLLM's GemmaRMSNorm (Qwen3.5's RMSNorm, ``x * (1 + w)``) on ``ops.rms_norm(unit_offset=True)``,
    its fused residual add as :class:`ConsistentRMSNorm`'s (HF's ``residual + x`` in the model dtype)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.variance_epsilon, unit_offset=True)
        summed = residual + x
        return ops.rms_norm(summed, self.weight, self.variance_epsilon, unit_offset=True), summed


class ConsistentSiluAndMul(SiluAndMul):
    """``silu(gate) * up`` with the fp32 exp-based SiLU of the training MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return ops.silu_mul(x[..., :d], x[..., d:])


class _ConsistentRope:
    """NeoX RoPE from the training side's one fp32 table (:func:`ops.rope_table`), fp32 rotation.

    Each subclass names its vLLM RoPE class's parameters as the HF ``rope_parameters`` the
    training side reads from the same config, so both engines build the same table. Partial RoPE
    (``rotary_dim < head_size``, Qwen3.5): the table of the ``rotary_dim`` rotated features (transformers
    computes the frequencies over them), which :func:`ops.apply_rope` applies to the head's first
    ``rotary_dim`` features, passing the rest through.
    """

    def _rope_parameters(self) -> dict:
        return {"rope_type": "default", "rope_theta": float(self.base)}

    def _table(self, device):
        cached = self.__dict__.get("_true_on_policy_rope")
        if cached is None or cached[0] != device:
            if not self.is_neox_style or self.rotary_dim > self.head_size:
                raise UnsupportedFeatureError(
                    f"true_on_policy (vLLM): RoPE with rotary_dim={self.rotary_dim} of head_size={self.head_size}, "
                    f"is_neox_style={self.is_neox_style} is not covered (NeoX rotation only)"
                )
            config = {
                "rope_parameters": self._rope_parameters(),
                "head_dim": self.rotary_dim,  # the table's width: the rotated features
                "max_position_embeddings": self.max_position_embeddings,
            }
            cos, sin = ops.rope_table(config, device=device)
            cached = (device, cos, sin)
            self.__dict__["_true_on_policy_rope"] = cached
        return cached[1], cached[2]

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None, *args):
        if args or key is None:
            raise UnsupportedFeatureError("true_on_policy (vLLM): RoPE without key or with offsets is not covered")
        cos, sin = self._table(query.device)
        positions = positions.flatten()
        if positions.numel() and int(positions.max()) >= cos.shape[0]:
            raise UnsupportedFeatureError(
                f"true_on_policy (vLLM): position {int(positions.max())} is outside the RoPE table "
                f"[0, max_position_embeddings={cos.shape[0]})"
            )
        c, s = cos[positions], sin[positions]
        n = positions.shape[0]
        q = ops.apply_rope(query.view(n, -1, self.head_size), c, s, 1).reshape(query.shape)
        k = ops.apply_rope(key.view(n, -1, self.head_size), c, s, 1).reshape(key.shape)
        return q, k


class ConsistentRotaryEmbedding(_ConsistentRope, RotaryEmbedding):
    """vLLM's default RoPE (``rope_type: default``) on the one fp32 table."""


class ConsistentLinearScalingRotaryEmbedding(_ConsistentRope, LinearScalingRotaryEmbedding):
    """``rope_type: linear``: frequencies divided by the factor, as the training side's table."""

    def _rope_parameters(self) -> dict:
        if len(self.scaling_factors) != 1:
            raise UnsupportedFeatureError(
                f"true_on_policy (vLLM): linear RoPE scaling with several factors {self.scaling_factors} is not covered"
            )
        return {"rope_type": "linear", "rope_theta": float(self.base), "factor": self.scaling_factors[0]}


class ConsistentLlama3RotaryEmbedding(_ConsistentRope, Llama3RotaryEmbedding):
    """``rope_type: llama3`` (Llama 3.1+): the same scaled frequencies as the training side's table."""

    def _rope_parameters(self) -> dict:
        return {
            "rope_type": "llama3",
            "rope_theta": float(self.base),
            "factor": self.scaling_factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.orig_max_position,
        }


# vLLM class name -> its consistent replacement (registered by .patches as out-of-tree custom ops)
CONSISTENT_ROPES = {
    "RotaryEmbedding": ConsistentRotaryEmbedding,
    "LinearScalingRotaryEmbedding": ConsistentLinearScalingRotaryEmbedding,
    "Llama3RotaryEmbedding": ConsistentLlama3RotaryEmbedding,
}
