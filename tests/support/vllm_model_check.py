"""Build vLLM's own model objects on CPU (no engine, no weights) and run the adapter's model check.

``python tests/support/vllm_model_check.py DIR...`` prints one JSON object: per checkpoint
directory, the attention implementation vLLM built, what the model built (biases, q/k norm) next to
its architecture entry's description, and the outcome of ``patches.verify_model`` for each device.

The consistent patch set for CPU is applied, then the DEVICE attention backend (what
``apply_consistent("cuda")`` registers as vLLM's ``CUSTOM`` backend) is registered for the CPU
attention slot, so vLLM's CPU selector builds :class:`DeviceAttentionImpl` into every attention
layer -- the device classes, constructed by vLLM on CPU as far as that goes (no CUDA kernels run).
Runs in its own process: it initialises vLLM's (single-rank, gloo) distributed state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys


def main(paths: list[str]) -> dict:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from true_on_policy.kernels import architectures
    from true_on_policy.vllm_adapter import patches

    patches.apply_consistent("cpu")
    register_backend(AttentionBackendEnum.CPU_ATTN, "true_on_policy.vllm_adapter.attention_backends.DeviceAttentionBackend")
    results, initialised = {}, False
    for path in paths:
        model_config = ModelConfig(model=path, dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
        vllm_config = VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=16))
        with set_current_vllm_config(vllm_config):
            if not initialised:  # the first model must be the MoE one: vLLM creates its EP group only then
                init_distributed_environment(1, 0, "tcp://127.0.0.1:0", 0, "gloo")
                initialize_model_parallel(1, 1)
                initialised = True
            cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
            model = cls(vllm_config=vllm_config)
        verdicts = {}
        for device in ("cuda", "cpu"):
            try:
                patches.verify_model(model, vllm_config, device)
                verdicts[device] = "ok"
            except Exception as error:  # noqa: BLE001 -- reported, the test asserts on it
                verdicts[device] = f"{type(error).__name__}: {error}"
        described = dataclasses.asdict(architectures.check_config(model_config.hf_config))
        results[path] = {
            "model": type(model).__name__,
            "attention_impls": sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")}),
            "rope_classes": sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")}),
            "built": patches.built_features(model),
            "described": described,
            "verify": verdicts,
        }
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
