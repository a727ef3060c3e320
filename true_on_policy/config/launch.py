"""The launch: a composed verl config read once, by one lookup, into typed values.

:func:`read_launch` is the only reader of the composed config (the ``check`` CLI, the dry runs and
verl's launch hook all reach it through :func:`true_on_policy.contract.verdict.decide`): it returns a
:class:`Launch` -- the parsed ``true_on_policy:`` section (:class:`~true_on_policy.config.settings.Settings`),
the two sides' views (:class:`Sides`), the keys FlashREINFORCE's invariants read (:class:`Algorithm`)
and the checkpoint's parsed config.json -- and everything after it works on those objects.

Every key goes through :func:`lookup`: an absent key is :data:`MISSING`; a present one that cannot be
read (an interpolation that does not resolve) is a :class:`ConfigError` naming the key. The views'
fields name the key they come from and how it is converted; absent or null reads as the field's
default, a value of the wrong kind names key and value; a dtype or an attention name is read into its
canonical name (:mod:`true_on_policy.config.vocabulary`) here, once, so the contract's rows compare the
values as they are. Keys verl always carries (the strategy, the
rollout name and TP, the world size, the model path) have no default: missing is an error naming the
key, never a guess. The determinism plan's updates are laid over the views with :meth:`Sides.overlay`
(the same keys the launch writes into the config), so the contract describes what the launch will run
without reading the config again. Pure: no verl, no omegaconf import.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from true_on_policy.config.platforms import is_cpu_engine, is_data_parallel, is_sglang
from true_on_policy.config.invariants import ADV_ESTIMATOR_KEY, FLASHREINFORCE, INVARIANT_KEYS, LOSS_MODE_KEY, MISSING
from true_on_policy.config.settings import ConfigError, Settings
from true_on_policy.config.vocabulary import canonical_attention, canonical_dtype
from true_on_policy.kernels.architectures import Checkpoint, inspect_checkpoint


def lookup(config: Any, dotted: str) -> Any:
    """``config[dotted]``; :data:`MISSING` when a key on the way is absent, a node is null, or the value
    is OmegaConf's ``???`` (no value given). A key that is present but cannot be read (an
    interpolation that does not resolve) is a :class:`ConfigError` naming the key."""
    node = config
    for part in dotted.split("."):
        if node is None or node is MISSING:
            return MISSING
        try:
            node = node.get(part, MISSING) if hasattr(node, "get") else getattr(node, part, MISSING)
        except Exception as exc:  # noqa: BLE001 - an interpolation that cannot resolve: name the key
            raise ConfigError(dotted, "<unresolvable>", f"cannot be read: {type(exc).__name__}: {exc}") from exc
    return node


def _present(value: Any) -> Any:
    """A looked-up value with absence read as null (the views' defaults apply to both)."""
    return None if value is MISSING else value


def integer(key: str, value: Any, default: int | None, minimum: int | None = 1) -> int | None:
    """An integer setting (absent/null = ``default``); anything else is a ConfigError."""
    if value is None or value == "":
        return default
    expected = f"an integer >= {minimum}" if minimum is not None else "an integer"
    if isinstance(value, bool):
        raise ConfigError(key, value, expected)
    try:
        number = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise ConfigError(key, value, expected) from None
    if minimum is not None and number < minimum:
        raise ConfigError(key, value, expected)
    return number


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_bool(key: str, value: Any, default: bool = False) -> bool:
    """A boolean (absent/null = ``default``); a string must spell true/false/1/0/yes/no/on/off."""
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(key, value, "a boolean (true/false)")


def number(key: str, value: Any, default: Any, kind: type) -> Any:
    """A number of ``kind`` (absent/null = ``default``)."""
    if value is None:
        return default
    try:
        if isinstance(value, bool):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(key, value, f"a number ({kind.__name__})") from None


def text(key: str, value: Any, default: str | None) -> str | None:
    """A name (absent/null/empty = ``default``), as a string."""
    if value is None or value == "":
        return default
    if isinstance(value, (dict, list, tuple)) or hasattr(value, "items"):
        raise ConfigError(key, value, "a name (a string)")
    return str(value)


def mapping(key: str, value: Any) -> dict[str, Any]:
    """A mapping, or a JSON object given as a string (how verl passes some engine kwargs)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(key, value, "a mapping (or a JSON object)") from None
    if not hasattr(value, "items"):
        raise ConfigError(key, value, "a mapping (or a JSON object)")
    return {str(k): v for k, v in value.items()}

A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
M = "actor_rollout_ref.model"
MEGATRON = f"{A}.megatron"
MEGATRON_TC = f"{MEGATRON}.override_transformer_config"
TORCHTITAN = f"{A}.torchtitan"
VEOMNI = f"{A}.veomni"
FSDP = f"{A}.fsdp_config"
ROLLOUT_VLLM = f"{R}.engine_kwargs.vllm"
ROLLOUT_SGLANG = f"{R}.engine_kwargs.sglang"
RL_CONFIG = f"{ROLLOUT_VLLM}.additional_config.rl_config"
ENV_PATH = "ray_kwargs.ray_init.runtime_env.env_vars"

REQUIRED = object()  # a key verl always carries: missing is an error, not a default

# A row-parallel layer's reduction: none (TP=1), an all-reduce, or a reduce-scatter + all-gather.
ROW_PARALLEL_ALL_REDUCE = "all_reduce"
ROW_PARALLEL_RS_AG = "reduce_scatter+all_gather"
ROW_PARALLEL_NONE = "none"


def _key(path: str, kind: str, default: Any = None, **options: Any) -> Any:
    """A view field read from ``path`` with the converter ``kind`` (see :func:`_convert`)."""
    return dataclasses.field(metadata={"path": path, "kind": kind, "default": default, **options})


_CANONICAL = {"dtype": canonical_dtype, "attention": canonical_attention}  # unset stays None


def _convert(meta: Mapping[str, Any], value: Any) -> Any:
    path, kind, default = meta["path"], meta["kind"], meta["default"]
    if value is None and default is REQUIRED:
        raise ConfigError(path, None, "required (verl's config always carries it; is the config composed from verl's ppo_trainer?)")
    if kind == "int":
        return integer(path, value, default, meta.get("minimum", 1))
    if kind == "bool":
        return parse_bool(path, value, default)
    if kind == "text":
        return text(path, value, default)
    if kind in _CANONICAL:  # a name both engines spell differently: read once into the canonical one
        name = text(path, value, default)
        return None if name is None else _CANONICAL[kind](name)
    if kind == "float":
        return number(path, value, default, float)
    if kind == "number_int":
        return number(path, value, default, int)
    if kind == "mapping":
        return mapping(path, value)
    if kind == "raw":
        return value
    if kind == "env":
        return {str(k): str(v) for k, v in mapping(path, value).items()}
    raise AssertionError(kind)


def _read(cls, config: Any):
    return cls(**{f.name: _convert(f.metadata, _present(lookup(config, f.metadata["path"]))) for f in dataclasses.fields(cls)})


def _overlay(view, updates: Mapping[str, Any]):
    """``view`` with the fields whose key ``updates`` sets re-read from that value (env: merged)."""
    if view is None:
        return None
    changes = {}
    for f in dataclasses.fields(view):
        if not f.init:  # derived: computed again by the view
            continue
        if "path" not in f.metadata:
            changes[f.name] = _overlay(getattr(view, f.name), updates)
            continue
        path = f.metadata["path"]
        if f.metadata["kind"] == "env":
            prefix = f"{path}."
            extra = {k[len(prefix):]: str(v) for k, v in updates.items() if k.startswith(prefix)}
            if extra:
                changes[f.name] = {**getattr(view, f.name), **extra}
        elif path in updates:
            changes[f.name] = _convert(f.metadata, updates[path])
    return dataclasses.replace(view, **changes)


# --------------------------------------------------------------------------------------------
# the training side
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MegatronView:
    tp: int = _key(f"{MEGATRON}.tensor_model_parallel_size", "int", 1)
    ep: int = _key(f"{MEGATRON}.expert_model_parallel_size", "int", 1)
    etp: int | None = _key(f"{MEGATRON}.expert_tensor_parallel_size", "int")  # null = TP
    pp: int = _key(f"{MEGATRON}.pipeline_model_parallel_size", "int", 1)
    cp: int = _key(f"{MEGATRON}.context_parallel_size", "int", 1)
    sequence_parallel: bool = _key(f"{MEGATRON}.sequence_parallel", "bool", True)  # validated even where TP=1 ignores it
    dtype: str = _key(f"{MEGATRON}.dtype", "dtype", "bfloat16")
    attention_backend: str | None = _key(f"{MEGATRON_TC}.attention_backend", "attention")  # null = verl's default flash
    flash_attn_npu_batch_invariant: bool = _key(f"{MEGATRON_TC}.use_flash_attn_npu_batch_invariant", "bool", False)
    batch_invariant_mode: bool = _key(f"{MEGATRON_TC}.batch_invariant_mode", "bool", False)
    batch_invariant_ops: bool = _key(f"{MEGATRON_TC}.use_batch_invariant_ops", "bool", False)
    dispatcher: str | None = _key(f"{MEGATRON_TC}.moe_token_dispatcher_type", "text")  # null = verl's default alltoall
    router_dtype: str | None = _key(f"{MEGATRON_TC}.moe_router_dtype", "dtype")  # null = the compute dtype


@dataclasses.dataclass(frozen=True)
class TorchtitanView:
    tp: int = _key(f"{TORCHTITAN}.tensor_parallel_size", "int", 1)
    ep: int = _key(f"{TORCHTITAN}.expert_parallel_size", "int", 1)
    pp: int = _key(f"{TORCHTITAN}.pipeline_parallel_size", "int", 1)
    cp: int = _key(f"{TORCHTITAN}.context_parallel_size", "int", 1)
    dtype: str = _key(f"{TORCHTITAN}.dtype", "dtype", "bfloat16")
    attn_type: str = _key(f"{TORCHTITAN}.attn_type", "attention", "flex")


@dataclasses.dataclass(frozen=True)
class VeomniView:
    ep: int = _key(f"{VEOMNI}.expert_parallel_size", "int", 1)
    ulysses: int = _key(f"{VEOMNI}.ulysses_parallel_size", "int", 1)
    attn_implementation: str = _key(f"{VEOMNI}.attn_implementation", "attention", "flash_attention_2")
    mixed_precision: bool = _key(f"{VEOMNI}.mixed_precision", "bool", True)


@dataclasses.dataclass(frozen=True)
class FsdpView:
    param_dtype: str | None = _key(f"{FSDP}.mixed_precision.param_dtype", "dtype")  # null = verl's default bf16
    model_dtype: str = _key(f"{FSDP}.model_dtype", "dtype", "fp32")
    ulysses: int = _key(f"{FSDP}.ulysses_sequence_parallel_size", "int", 1)
    # verl's FSDPActorConfig copies this deprecated key over the one above when it is > 1
    deprecated_ulysses: int = _key(f"{A}.ulysses_sequence_parallel_size", "int", 1)


@dataclasses.dataclass(frozen=True)
class _TrainingKeys:
    strategy: str = _key(f"{A}.strategy", "text", REQUIRED)
    nnodes: int = _key("trainer.nnodes", "int", REQUIRED)
    gpus_per_node: int = _key("trainer.n_gpus_per_node", "int", REQUIRED)
    model_path: str = _key(f"{M}.path", "text", REQUIRED)
    attn_implementation: str | None = _key(f"{M}.override_config.attn_implementation", "attention")  # null = flash_attention_2
    use_fused_kernels: bool = _key(f"{M}.use_fused_kernels", "bool", False)
    lora_rank: int = _key(f"{M}.lora_rank", "int", 0, minimum=0)
    override_config: dict = _key(f"{M}.override_config", "mapping")  # applied to the training model only


@dataclasses.dataclass(frozen=True)
class TrainingView(_TrainingKeys):
    """What the training engine (``actor.strategy``) is configured to run."""

    # the selected engine's own keys (None for the others)
    megatron: MegatronView | None = None
    torchtitan: TorchtitanView | None = None
    veomni: VeomniView | None = None
    fsdp: FsdpView | None = None
    # derived from the keys above when the view is built (and again after an overlay)
    world: int = dataclasses.field(init=False)
    is_fsdp: bool = dataclasses.field(init=False)
    row_parallel: str = dataclasses.field(init=False)  # the row-parallel reduction (ROW_PARALLEL_*)
    compute_dtype: tuple[str, str] = dataclasses.field(init=False)  # the dtype it computes in, and its key

    def __post_init__(self) -> None:
        object.__setattr__(self, "world", self.nnodes * self.gpus_per_node)
        object.__setattr__(self, "is_fsdp", is_data_parallel(self.strategy))
        object.__setattr__(self, "row_parallel", _row_parallel(self.megatron, self.torchtitan))
        object.__setattr__(self, "compute_dtype", _compute_dtype(self))


def _row_parallel(megatron: MegatronView | None, torchtitan: TorchtitanView | None) -> str:
    """The training side's row-parallel reduction, from the engine the config selects."""
    if megatron is not None:
        if megatron.tp <= 1:
            return ROW_PARALLEL_NONE
        return ROW_PARALLEL_RS_AG if megatron.sequence_parallel else ROW_PARALLEL_ALL_REDUCE
    if torchtitan is not None:
        return ROW_PARALLEL_NONE if torchtitan.tp <= 1 else ROW_PARALLEL_RS_AG
    return ROW_PARALLEL_NONE


def _compute_dtype(t: TrainingView) -> tuple[str, str]:
    """The dtype the training engine computes in, and the key it comes from."""
    if t.megatron is not None:
        return t.megatron.dtype, f"{MEGATRON}.dtype"
    if t.torchtitan is not None:
        return t.torchtitan.dtype, f"{A}.torchtitan.dtype"
    if t.veomni is not None:
        return ("bfloat16" if t.veomni.mixed_precision else "float32"), f"{A}.veomni.mixed_precision"
    param = t.fsdp.param_dtype
    return param or "bfloat16", f"{FSDP}.mixed_precision.param_dtype" + ("" if param else " (verl default bf16)")


def read_training(config: Any) -> TrainingView:
    base = _read(_TrainingKeys, config)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    engine = {
        "megatron": ("megatron", MegatronView),
        "torchtitan": ("torchtitan", TorchtitanView),
        "veomni": ("veomni", VeomniView),
    }.get(base.strategy, ("fsdp", FsdpView))  # fsdp, fsdp2, fsdp_turbo and any data-parallel engine
    return TrainingView(**fields, **{engine[0]: _read(engine[1], config)})


# --------------------------------------------------------------------------------------------
# the rollout side
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VllmView:
    attention_backend: str | None = _key(f"{ROLLOUT_VLLM}.attention_backend", "attention")  # null = vLLM auto-selects
    all2all_backend: str | None = _key(f"{ROLLOUT_VLLM}.all2all_backend", "text")  # null = allgather_reducescatter
    block_size: int | None = _key(f"{ROLLOUT_VLLM}.block_size", "int")
    kv_cache_dtype: str = _key(f"{ROLLOUT_VLLM}.kv_cache_dtype", "text", "auto")  # auto = the model dtype
    mamba_ssm_cache_dtype: str = _key(f"{ROLLOUT_VLLM}.mamba_ssm_cache_dtype", "text", "auto")  # auto = the model dtype
    mamba_cache_mode: str = _key(f"{ROLLOUT_VLLM}.mamba_cache_mode", "text", "none")  # vLLM's CacheConfig default
    speculative_config: dict = _key(f"{ROLLOUT_VLLM}.speculative_config", "mapping")  # passed to vLLM as given
    hf_overrides: dict = _key(f"{ROLLOUT_VLLM}.hf_overrides", "mapping")
    decode_context_parallel_size: int = _key(f"{ROLLOUT_VLLM}.decode_context_parallel_size", "int", 1)
    prefill_context_parallel_size: int = _key(f"{ROLLOUT_VLLM}.prefill_context_parallel_size", "int", 1)
    compilation_config: dict = _key(f"{ROLLOUT_VLLM}.compilation_config", "mapping")
    # vllm-ascend's additional_config: rl_config (main builds) and FlashComm1 (releases)
    rl_config: Any = _key(RL_CONFIG, "raw")
    rl_enabled: bool = _key(f"{RL_CONFIG}.enabled", "bool", False)
    rl_training_consistency: bool = _key(f"{RL_CONFIG}.enable_training_consistency", "bool", False)
    rl_batch_invariant: bool = _key(f"{RL_CONFIG}.enable_batch_invariant", "bool", False)
    flashcomm1_key: Any = _key(f"{ROLLOUT_VLLM}.additional_config.enable_flashcomm1", "raw")

    @property
    def flashcomm1(self) -> bool:
        return parse_bool(f"{ROLLOUT_VLLM}.additional_config.enable_flashcomm1", self.flashcomm1_key, False)

    @property
    def sequence_parallel(self) -> bool:
        """vLLM's sequence-parallel compilation pass (reduce-scatter + all-gather row-parallel layers)."""
        pass_config = self.compilation_config.get("pass_config") or {}
        pc = f"{ROLLOUT_VLLM}.compilation_config.pass_config"
        if not hasattr(pass_config, "get"):
            raise ConfigError(pc, pass_config, "a mapping")
        return parse_bool(f"{pc}.enable_sp", pass_config.get("enable_sp")) or parse_bool(
            f"{pc}.enable_sequence_parallelism", pass_config.get("enable_sequence_parallelism")
        )


@dataclasses.dataclass(frozen=True)
class SglangView:
    attention_backend: str | None = _key(f"{ROLLOUT_SGLANG}.attention_backend", "attention")
    # SGLang's ServerArgs.json_model_override_args (a JSON object as a string; verl passes engine_kwargs on)
    json_model_override_args: dict = _key(f"{ROLLOUT_SGLANG}.json_model_override_args", "mapping")
    decode_context_parallel_size: int = _key(f"{ROLLOUT_SGLANG}.decode_context_parallel_size", "int", 1)
    prefill_context_parallel_size: int = _key(f"{ROLLOUT_SGLANG}.prefill_context_parallel_size", "int", 1)


@dataclasses.dataclass(frozen=True)
class _RolloutKeys:
    name: str = _key(f"{R}.name", "text", REQUIRED)
    tp: int = _key(f"{R}.tensor_model_parallel_size", "int", REQUIRED)
    dp: int = _key(f"{R}.data_parallel_size", "int", 1)
    ep: int = _key(f"{R}.expert_parallel_size", "int", 1)  # as declared; vLLM's EP group is TP*DP
    pp: int = _key(f"{R}.pipeline_model_parallel_size", "int", 1)
    dtype: str = _key(f"{R}.dtype", "dtype", "bfloat16")
    quantization: str | None = _key(f"{R}.quantization", "text")  # null = weights served in rollout.dtype
    temperature: float = _key(f"{R}.temperature", "float", 1.0)
    top_p: float = _key(f"{R}.top_p", "float", 1.0)
    top_k: int = _key(f"{R}.top_k", "number_int", -1)
    calculate_log_probs: bool = _key(f"{R}.calculate_log_probs", "bool", False)
    logprobs_mode: str = _key(f"{R}.logprobs_mode", "text", "processed_logprobs")
    enforce_eager: bool = _key(f"{R}.enforce_eager", "bool", False)
    enable_sleep_mode: bool = _key(f"{R}.enable_sleep_mode", "bool", True)
    enable_prefix_caching: bool = _key(f"{R}.enable_prefix_caching", "bool", True)  # verl's default
    # verl's MTP rollout (rollout.mtp interpolates model.mtp): vLLM's speculative decoding with MTP drafts
    mtp_enable: bool = _key(f"{R}.mtp.enable", "bool", False)
    mtp_enable_rollout: bool = _key(f"{R}.mtp.enable_rollout", "bool", False)
    free_cache_engine: bool = _key(f"{R}.free_cache_engine", "bool", True)
    # the environment of every Ray worker (training and rollout alike); the plan adds its keys here
    env: dict = _key(ENV_PATH, "env")


@dataclasses.dataclass(frozen=True)
class RolloutView(_RolloutKeys):
    """What the rollout engine (``rollout.name``) is configured to run."""

    vllm: VllmView | None = None
    sglang: SglangView | None = None
    engine_kwargs: VllmView | SglangView | None = dataclasses.field(init=False)  # the selected engine's view

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_kwargs", self.sglang if is_sglang(self.name) else self.vllm)

    @property
    def vllm_batch_invariant(self) -> bool:
        """``VLLM_BATCH_INVARIANT`` in the workers' environment (vLLM's and vllm-ascend's switch)."""
        return parse_bool(f"{ENV_PATH}.VLLM_BATCH_INVARIANT", self.env.get("VLLM_BATCH_INVARIANT"))

    @property
    def flashcomm1(self) -> bool:
        """vllm-ascend's FlashComm1 (reduce-scatter + all-gather row-parallel layers): its additional_config
        key or its environment variable."""
        env = parse_bool(f"{ENV_PATH}.VLLM_ASCEND_ENABLE_FLASHCOMM1", self.env.get("VLLM_ASCEND_ENABLE_FLASHCOMM1"))
        return self.vllm.flashcomm1 or env


def read_rollout(config: Any) -> RolloutView:
    base = _read(_RolloutKeys, config)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    if is_sglang(base.name):
        return RolloutView(**fields, sglang=_read(SglangView, config))
    if is_cpu_engine(base.name):
        return RolloutView(**fields)
    return RolloutView(**fields, vllm=_read(VllmView, config))


# --------------------------------------------------------------------------------------------
# both
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sides:
    training: TrainingView
    rollout: RolloutView

    def overlay(self, updates: Mapping[str, Any]) -> Sides:
        """These views with ``updates`` (dotted key -> value, e.g. a plan's config updates) applied."""
        return Sides(_overlay(self.training, updates), _overlay(self.rollout, updates))


def read_sides(config: Any) -> Sides:
    """Both sides of a resolved verl config (a DictConfig or nested mappings)."""
    return Sides(read_training(config), read_rollout(config))


# --------------------------------------------------------------------------------------------
# the launch
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """The keys FlashREINFORCE's invariants read, as found (:data:`MISSING` when absent)."""

    found: Mapping[str, Any]
    flashreinforce: bool  # the loss or the advantage estimator is flashreinforce: the invariants apply


def read_algorithm(config: Any) -> Algorithm:
    """The invariants' keys of a composed config (an absent one: a violation naming it)."""
    found = {key: lookup(config, key) for key in INVARIANT_KEYS}
    return Algorithm(found, FLASHREINFORCE in (found[LOSS_MODE_KEY], found[ADV_ESTIMATOR_KEY]))


@dataclasses.dataclass(frozen=True)
class Launch:
    """A composed config, read once. Without a ``true_on_policy:`` section: settings, sides and checkpoint None."""

    settings: Settings | None
    sides: Sides | None
    algorithm: Algorithm
    checkpoint: Checkpoint | None  # the model's config.json, judged once; None: not a local checkpoint directory


def read_launch(config: Any) -> Launch:
    """The launch ``config`` describes (a resolved DictConfig or nested mappings); a bad value is a
    :class:`ConfigError` naming key and value (one in the ``true_on_policy:`` section first)."""
    algorithm = read_algorithm(config)
    if lookup(config, "true_on_policy") in (None, MISSING):
        return Launch(None, None, algorithm, None)
    try:
        sides, error = read_sides(config), None
    except ConfigError as raised:
        sides, error = None, raised
    checkpoint = inspect_checkpoint(sides.training.model_path) if sides is not None else None
    settings = Settings.from_config(config)
    if error is not None:
        raise error
    return Launch(settings, sides, algorithm, checkpoint)
