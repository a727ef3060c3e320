"""A vLLM-CPU engine in its own process, with or without the consistent kernels, and its scorer.

:func:`start` launches ``vllm.LLM`` with the V1 engine core in a spawned process: the recipe's
settings travel to it through the environment, so vLLM's plugin loader applies
(:mod:`.plugin`) the consistent kernels there or not, per engine. :func:`generate` records each
sampled token's log-prob; :func:`score` scores the same tokens with the training forward (the
packed layout verl's FSDP engine uses), with the OOV-logit mask verl applies in its vLLM rollout.
"""

from __future__ import annotations

import contextlib
import os

import torch

from true_on_policy.config.settings import ENV_VAR, Settings
from true_on_policy.kernels.ops import DTYPES
from true_on_policy.vllm_adapter.patches import SSM_STATE_DTYPE

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # the engine core in its own process
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # a fresh interpreter: patches applied there only
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function (weight reload)
}

# The engine is eager (enforce_eager), and so is the one helper vLLM-CPU still compiles, the sampled
# token's rank (vllm/v1/sample/ops/logprobs.py; an integer count either way), which would otherwise run
# inductor and g++ in the engine's process at its first step (benchmarks/bench_vllm_engine_start.py).
EAGER_ENV = {"TORCH_COMPILE_DISABLE": "1"}
# KV-cache block size: a multiple of 32, what vLLM-CPU's attention kernel takes from 0.29.0 on (16 before)
BLOCK_SIZE = 32


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start(path: str, dtype: str, deterministic: bool, tp: int = 1, ep: bool = False, **engine_kwargs):
    """``vllm.LLM`` on the checkpoint ``path`` (eager, block size 16, chunked prefill, prefix caching
    except on hybrid models -- Gated DeltaNet layers -- where it is refused with the flag on; the
    recurrent state in fp32, :data:`.patches.SSM_STATE_DTYPE`: vLLM-CPU's own
    decode kernel needs it too), at tensor-parallel size ``tp`` (worker
    processes) with expert parallelism iff ``ep``. A TP / EP the consistent kernels do not keep
    bitwise is refused, naming it, before the engine starts."""
    from transformers import AutoConfig
    from vllm import LLM

    from true_on_policy.kernels.architectures import check_sharding

    config = AutoConfig.from_pretrained(path)
    check_sharding(config, tp, tp if ep else 1)
    settings = Settings(deterministic=deterministic, platform="cpu")
    for key, value in ENGINE_ENV.items():  # read again by the client later (e.g. collective_rpc)
        os.environ.setdefault(key, value)
    env = {ENV_VAR: settings.to_json(), "VLLM_TARGET_DEVICE": "cpu", **EAGER_ENV}
    kwargs = dict(
        model=path,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=512,
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        enable_prefix_caching="linear_attention" not in (getattr(config, "layer_types", None) or ()),
        enable_chunked_prefill=True,
        max_num_batched_tokens=128,
        seed=0,
        mamba_ssm_cache_dtype=SSM_STATE_DTYPE,
        # one worker process per rank: vLLM-CPU turns "uni" into "mp" while the engine core runs in its own
        # process (vllm/platforms/cpu.py), so TP 1 is one worker process too
        distributed_executor_backend="mp",
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        logprobs_mode="processed_logprobs",  # after temperature, as verl's vLLM rollout sets it
    )
    kwargs.update(engine_kwargs)
    with _environment(env):
        return LLM(**kwargs)


def generate(llm, prompts: list[list[int]], new_tokens: int, n: int = 1, temperature: float = 1.0):
    """Per prompt, per sample: (generated token ids, recorded log-probs fp32).

    The requests are submitted longest prompt first (the results come in ``prompts``' order): the engine core
    steps as soon as one request has arrived, and stock vLLM-CPU's Gated DeltaNet fails on a step of one prompt
    token alone where it takes its C++ conv (0.29.0 on: AVX512-BF16 CPUs; 0.28.0: AMX -- ``targets.stock_gdn_cpp_conv``),
    which refuses the one-row view of the input projection that ``contiguous()`` leaves with the projection's row
    stride ("causal_conv1d_fwd_cpu: expect x to be transposed"). The consistent step reads that view
    (test_qwen35_vllm.py)."""
    from vllm import SamplingParams

    params = SamplingParams(n=n, max_tokens=new_tokens, temperature=temperature, logprobs=0, ignore_eos=True)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    submitted = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], params, use_tqdm=False)
    outputs = [out for _, out in sorted(zip(order, submitted), key=lambda pair: pair[0])]
    result = []
    for out in outputs:
        samples = []
        for sample in out.outputs:
            ids = list(sample.token_ids)
            lps = torch.tensor([step[t].logprob for step, t in zip(sample.logprobs, ids)], dtype=torch.float32)
            samples.append((ids, lps))
        result.append(samples)
    return result


def load_weights(llm, named_tensors: dict[str, torch.Tensor]) -> None:
    """Write HF-named weights into the running engine's model (what verl's weight sync does)."""
    items = [(k, v.contiguous()) for k, v in per_expert_names(named_tensors).items()]

    def _load(worker):
        worker.model_runner.model.load_weights(weights=items)

    llm.collective_rpc(_load)


def per_expert_names(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' packed expert tensors (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]) as the per-expert checkpoint names vLLM's Qwen3-MoE loader takes (verl's stream)."""
    out = {}
    for name, tensor in named_tensors.items():
        if name.endswith("experts.gate_up_proj"):
            stem = name[: -len("gate_up_proj")]
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{stem}{e}.gate_proj.weight"], out[f"{stem}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            stem = name[: -len("down_proj")]
            for e, weight in enumerate(tensor):
                out[f"{stem}{e}.down_proj.weight"] = weight
        else:
            out[name] = tensor
    return out


def load_training_model(path: str, dtype: str):
    """The training side: transformers' model from ``path`` on the project's model code."""
    from transformers import AutoModelForCausalLM

    from true_on_policy.transformers_adapter.forwards import patch_transformers

    patch_transformers()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="consistent")
    return model.eval()


@torch.no_grad()
def score(model, prompts, samples, deterministic: bool, vocab_limit: int | None, temperature: float = 1.0,
          micro_batch: int = 3) -> torch.Tensor:
    """Training-side log-probs of every sampled token, in the order of :func:`generate`'s output.

    Sequences are packed in reversed micro-batches (another batch composition than the rollout);
    logits beyond ``vocab_limit`` are set to -inf (verl's vLLM rollout masks them), then divided by
    ``temperature`` and scored as verl's trainer does.
    """
    from true_on_policy.rollout.packed_forward import forward_packed
    from true_on_policy.kernels import ops

    flat = [(p, ids) for p, per_prompt in zip(prompts, samples) for ids, _ in per_prompt]
    scores: dict[int, torch.Tensor] = {}
    order = list(reversed(range(len(flat))))
    with ops.consistent(deterministic):
        for start in range(0, len(order), micro_batch):
            group = order[start : start + micro_batch]
            seqs = [flat[i][0] + flat[i][1] for i in group]
            ids = torch.tensor([t for s in seqs for t in s])
            positions = torch.cat([torch.arange(len(s)) for s in seqs])
            logits = forward_packed(model, ids, positions, [len(s) for s in seqs], None).float()
            if vocab_limit is not None and vocab_limit < logits.shape[-1]:
                logits[..., vocab_limit:] = float("-inf")
            logits = logits / temperature
            offset = 0
            for i, s in zip(group, seqs):
                p = len(flat[i][0])
                rows = logits[offset + p - 1 : offset + len(s) - 1]
                labels = torch.tensor(flat[i][1])
                if deterministic:
                    scores[i] = ops.token_log_probs(rows, labels)
                else:
                    scores[i] = torch.log_softmax(rows, dim=-1).gather(-1, labels[:, None])[:, 0]
                offset += len(s)
    return torch.cat([scores[i] for i in range(len(flat))])


def recorded(samples) -> torch.Tensor:
    return torch.cat([lps for per_prompt in samples for _, lps in per_prompt])

