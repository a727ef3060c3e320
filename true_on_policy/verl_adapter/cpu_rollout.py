"""``rollout.name=cpu``: the CPU rollout engine as a verl rollout backend.

verl needs two registrations for a backend (both done by :func:`register`, both inert):

- a :class:`verl.workers.rollout.replica.RolloutReplica` (driver side, ``RolloutReplicaRegistry``):
  :class:`CPUReplica` starts one :class:`CPUServer` Ray actor per replica, like verl's vLLM replica
  starts its HTTP server actor;
- a :class:`verl.workers.rollout.base.BaseRollout` (worker side, ``_ROLLOUT_REGISTRY``, which has no
  register function: :func:`true_on_policy.verl_adapter.patches.register_worker_rollout`):
  :class:`CPUServerAdapter` lives in each training worker and forwards weight updates and
  sleep / wake-up calls to the server actor.

The agent loop talks to :class:`CPUServer` token-in-token-out (``generate``), as it does to vLLM.
The server runs :class:`true_on_policy.rollout.engine.RolloutEngine`'s loop in a thread, so
requests keep arriving and leaving while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Optional

import ray
import torch

from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

from true_on_policy.verl_adapter import patches

logger = logging.getLogger(__name__)

BACKEND_NAME = "cpu"
SERVER_NAME_PREFIX = "cpu_server"

def _server_name(replica_rank: int, node_rank: int = 0) -> str:
    return f"{SERVER_NAME_PREFIX}_{replica_rank}_{node_rank}"


def load_serving_model(model_path: str, dtype: str):
    """The rollout's copy of the model, in the rollout dtype, on the project's module code."""
    from transformers import AutoModelForCausalLM

    from true_on_policy.contract.names import canonical_dtype
    from true_on_policy.transformers_adapter.training_attention import attn_implementation
    from true_on_policy.kernels.ops import DTYPES

    name = canonical_dtype(dtype)  # the spellings the contract reads (bf16, torch.float32, ...)
    if name not in DTYPES:
        raise ValueError(f"rollout.dtype={dtype!r} is not supported by the CPU rollout; use one of {sorted(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=DTYPES[name], attn_implementation=attn_implementation()
    )
    return model.eval()


def sampling_params_from_request(params: dict[str, Any], default_max_tokens: int):
    """verl's sampling-params dict -> the engine's; anything the engine cannot honour is an error."""
    from true_on_policy.rollout.engine import SamplingParams

    params = dict(params)
    top_p = params.pop("top_p", 1.0)
    top_k = params.pop("top_k", -1)
    if top_p is not None and float(top_p) != 1.0:
        raise ValueError(f"the CPU rollout samples from the full distribution; top_p={top_p} is not supported")
    if top_k is not None and int(top_k) not in (-1, 0):
        raise ValueError(f"the CPU rollout samples from the full distribution; top_k={top_k} is not supported")
    repetition_penalty = params.pop("repetition_penalty", 1.0)
    if float(repetition_penalty) != 1.0:
        raise ValueError(f"repetition_penalty={repetition_penalty} is not supported by the CPU rollout")
    max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", default_max_tokens))
    temperature = float(params.pop("temperature", 1.0))
    seed = params.pop("seed", None)
    params.pop("logprobs", None)  # log-probs are always returned
    if params.pop("ignore_eos", False):
        raise ValueError("ignore_eos=True is not supported by the CPU rollout (EOS always ends a request)")
    if params:
        raise ValueError(f"sampling parameters not supported by the CPU rollout: {sorted(params)}")
    return SamplingParams(max_new_tokens=int(max_tokens), temperature=temperature, seed=seed)


class CPUServer:
    """One rollout replica's engine, served to verl's agent loop (token in, token out)."""

    def __init__(self, config, model_config, rollout_mode: RolloutMode, replica_rank: int):
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        from true_on_policy.rollout.engine import RolloutEngine

        self.config = config = omega_conf_to_dataclass(config)
        self.model_config = model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.global_steps = None
        model = load_serving_model(model_config.local_path, config.dtype)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        tokenizer = getattr(model_config, "tokenizer", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        self.engine = RolloutEngine(
            model,
            eos_token_id=eos,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len or (config.prompt_length + config.response_length),
            # not + replica_rank: a request's sample must not depend on which replica serves it, so
            # the batch is the same at every data-parallel size (the number of replicas)
            seed=config.seed,
        )
        self._futures: dict[str, asyncio.Future] = {}
        self._work = asyncio.Event()
        self._admission_open = asyncio.Event()
        self._admission_open.set()
        self._loop_task: Optional[asyncio.Task] = None
        self._lock = asyncio.Lock()  # the engine is touched by one coroutine at a time

    # ------------------------------------------------------------------ serving
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            await self._work.wait()
            async with self._lock:
                if not self.engine.has_work():
                    self._work.clear()
                    continue
                try:
                    finished = await asyncio.to_thread(self.engine.step)
                except Exception as error:  # fail every waiting request loudly, keep serving
                    logger.exception("CPU rollout step failed")
                    for completion in self.engine.abort_all():
                        self._resolve_error(completion.request_id, error)
                    continue
            for completion in finished:
                self._resolve(completion)

    def _resolve(self, completion) -> None:
        future = self._futures.pop(completion.request_id, None)
        if future is not None and not future.done():
            future.set_result(completion)

    def _resolve_error(self, request_id: str, error: Exception) -> None:
        future = self._futures.pop(request_id, None)
        if future is not None and not future.done():
            future.set_exception(error)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **kwargs):
        unsupported = {key for key, value in kwargs.items() if value is not None and key != "priority"}
        if unsupported:
            raise ValueError(f"the CPU rollout serves text only; got {sorted(unsupported)}")
        await self._admission_open.wait()
        budget = self.config.prompt_length + self.config.response_length - len(prompt_ids)
        params = sampling_params_from_request(sampling_params, min(self.config.response_length, budget))
        future = asyncio.get_running_loop().create_future()
        async with self._lock:
            self._futures[request_id] = future
            self.engine.add_request(request_id, list(prompt_ids), params)
        self._work.set()
        self._ensure_loop()
        completion = await future
        return TokenOutput(
            token_ids=completion.token_ids,
            log_probs=completion.log_probs,
            stop_reason="aborted" if completion.stop_reason == "aborted" else "completed",
            extra_fields={"global_steps": self.global_steps},
        )

    # ------------------------------------------------------------------ control (called by verl)
    async def update_weights(self, named_tensors_ref, global_steps=None):
        named_tensors = named_tensors_ref if isinstance(named_tensors_ref, list) else ray.get(named_tensors_ref)
        if global_steps is not None:
            self.global_steps = global_steps
        # The trainer's step, not a count of loads, versions the per-request seeds: a server started
        # on a resumed checkpoint must sample what the uninterrupted run's server sampled.
        async with self._lock:
            return await asyncio.to_thread(self.engine.load_weights, named_tensors, self.global_steps)

    async def abort_all_requests(self, reject_request: bool = False, **_):
        self._admission_open.clear()
        async with self._lock:
            aborted = self.engine.abort_all()
        for completion in aborted:
            self._resolve(completion)
        return {"aborted_count": len(aborted), "request_ids": [c.request_id for c in aborted]}

    async def abort_request(self, request_id: str, **_):
        async with self._lock:
            completion = self.engine.abort(request_id)
        if completion is None:
            return {"aborted": False, "request_id": request_id}
        self._resolve(completion)
        return {"aborted": True, "request_id": request_id}

    async def resume_generation(self):
        self._admission_open.set()

    async def wait_for_requests_to_drain(self):
        while self.engine.has_work():
            await asyncio.sleep(0.01)

    # KV caches belong to requests and die with them: nothing to drop, free or restore between steps.
    async def sleep(self):
        await self.wait_for_requests_to_drain()

    async def wake_up(self, tags=None):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None

    def get_rollout_config(self):
        return self.config

    def get_server_address(self):
        return f"{SERVER_NAME_PREFIX}-{self.replica_rank}", 0


class CPUReplica(RolloutReplica):
    """One CPU server actor per replica; the trainer's workers keep the training copy."""

    async def launch_servers(self):
        if self.nnodes != 1:
            raise ValueError(f"the CPU rollout runs a replica on one node; got nnodes={self.nnodes}")
        settings_env = {key: value for key, value in os.environ.items() if key.startswith(("TRUE_ON_POLICY", "VERL_"))}
        server = (
            ray.remote(CPUServer)
            .options(
                name=_server_name(self.replica_rank),
                max_concurrency=self.max_concurrency,
                num_cpus=0,
                runtime_env={"env_vars": settings_env},
            )
            .remote(
                config=self.config,
                model_config=self.model_config,
                rollout_mode=self.rollout_mode,
                replica_rank=self.replica_rank,
            )
        )
        self.servers = [server]
        self._server_handle = server
        address, port = await server.get_server_address.remote()
        self._server_address = f"{address}:{port}"


class CPUServerAdapter(rollout_base.BaseRollout):
    """Worker side: forwards the trainer's weights and lifecycle calls to this replica's server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self._server = None

    @property
    def server(self):
        if self.rollout_rank != 0:
            return None
        if self._server is None:
            self._server = ray.get_actor(_server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        if self.server is not None:
            await self.server.wake_up.remote(tags=tags)

    async def release(self):
        if self.server is not None:
            await self.server.sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights, global_steps: int = None, wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise ValueError(f"the CPU rollout takes full named tensors; got wire_format={wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise ValueError("the CPU rollout takes merged weights; LoRA adapters are not supported")
        # Every rank drains the generator: producing full tensors may run collectives across ranks.
        named = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights]
        if self.server is not None:
            await self.server.update_weights.remote(ray.put(named), global_steps=global_steps)

    def generate_sequences(self, prompts):
        raise NotImplementedError("the CPU rollout serves the agent loop through CPUServer.generate")


def register() -> None:
    """Make ``rollout.name=cpu`` known to verl (inert until a config selects it)."""
    RolloutReplicaRegistry.register(BACKEND_NAME, lambda: CPUReplica)
    patches.register_worker_rollout(BACKEND_NAME, "async", f"{__name__}.CPUServerAdapter")


__all__ = ["CPUReplica", "CPUServer", "CPUServerAdapter", "register"]
