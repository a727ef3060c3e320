"""Every change to transformers' internals, in one place, checked against transformers 5.9.0.

For each architecture of :data:`true_on_policy.kernels.architectures.TABLE`, in its module
(:attr:`~true_on_policy.kernels.architectures.Architecture.transformers_module`; ``P`` its class prefix;
which class plays which role: :func:`classes`), the module code of :mod:`.forwards` replaces:

==================================  ================================================================
target                              replacement (flag off: transformers' original runs)
==================================  ================================================================
``PRMSNorm.forward``                :func:`ops.rms_norm`
``PRotaryEmbedding.forward``        rows of the one fp32 RoPE table
``apply_rotary_pos_emb`` (module)   the fp32 rotation (and, through :func:`rotary_patches`,
                                    the diagnosis capture's recording wrapper)
``PMLP.forward``                    the fp32 SiLU between consistent linears
``PDecoderLayer.__init__``          its ``nn.Linear`` children become ``ConsistentLinear``
``PForCausalLM.__init__``           ``lm_head`` becomes ``ConsistentLMHead``; the config is checked
``PForCausalLM.forward``            converts a model built before patching; checks what was built
``<router>.forward`` (MoE)          fp32 router logits, stable top-k
``<experts>.forward`` (MoE)         per-expert consistent linears, slot-order combine
Qwen3.5 (by its entry):
``PRMSNorm.forward``                :func:`ops.rms_norm` with ``unit_offset`` (the ``(1 + w)`` norm)
``PAttention.forward``              gated: the same steps, the gate through :func:`ops.sigmoid_gate`
``PSparseMoeBlock.forward``         routed experts + :func:`moe.shared_expert`
``PGatedDeltaNet.forward``          :func:`gated_delta.gated_delta_net_varlen` between consistent linears
``PRMSNormGated.forward``           :func:`gated_delta.gated_rms_norm`
``PTextModel.forward``              hands the layers the packed sequences (from ``position_ids``)
==================================  ================================================================

Read, not replaced: ``PAttention.forward`` (it hands the registered attention function the
arguments the consistent one takes). Registered under ``"consistent"``: the attention function in
``transformers.AttentionInterface`` and the mask function in
``transformers.masking_utils.AttentionMaskInterface``, through their ``register``; removed again
through their private ``_global_mapping`` dict.

:func:`apply` checks every target first -- present, and with the parameters it has in
transformers 5.9.0 and 5.10.4 (the same lists) -- and patches nothing if one differs: :class:`true_on_policy.patching.PatchTargetChanged`
names it (the mechanism is :mod:`true_on_policy.patching`'s).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from true_on_policy import patching
from true_on_policy.kernels import architectures

# The versions every parameter list below was read from (tested): 5.9.0 beside vLLM 0.28, 5.10.4 beside 0.29 - 0.31.
TRANSFORMERS_VERSIONS = ("5.9.0", "5.10.4")
_WRITTEN_FOR = f"transformers {' / '.join(TRANSFORMERS_VERSIONS)}"

_ATTENTION_FORWARD = ("self", "hidden_states", "position_embeddings", "attention_mask", "past_key_values", "kwargs")
# The causal LM's forward is wrapped with (*args, **kwargs) and passes everything on: its leading
# parameters are checked (MoE models add output_router_logits after them).
_CAUSAL_LM_FORWARD = ("self", "input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                      "use_cache")


@dataclass(frozen=True)
class Role:
    """One role's target in an architecture's modeling module: ``<class>.<attribute>`` (no class: a
    module-level function), with its parameters in transformers 5.9.0 (``leading``: only the first ones
    are fixed). Which class plays the role in an architecture: :func:`classes`."""

    attribute: str
    params: tuple[str, ...]
    leading: bool = False


_GATED_DELTA_NET_FORWARD = ("self", "hidden_states", "cache_params", "attention_mask", "kwargs")
_TEXT_MODEL_FORWARD = ("self", "input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds",
                       "use_cache", "kwargs")

ROLES: dict[str, Role] = {
    "rms_norm": Role("forward", ("self", "hidden_states")),
    "unit_offset_norm": Role("forward", ("self", "x")),
    "rotary": Role("forward", ("self", "x", "position_ids")),
    "apply_rotary": Role("apply_rotary_pos_emb", ("q", "k", "cos", "sin", "unsqueeze_dim")),
    "mlp": Role("forward", ("self", "x")),
    "attention": Role("forward", _ATTENTION_FORWARD),
    "gated_attention": Role("forward", _ATTENTION_FORWARD),
    "decoder_layer": Role("__init__", ("self", "config", "layer_idx")),
    "causal_lm": Role("__init__", ("self", "config")),
    "causal_lm_forward": Role("forward", _CAUSAL_LM_FORWARD, leading=True),
    "router": Role("forward", ("self", "hidden_states")),
    "renormalizing_router": Role("forward", ("self", "hidden_states")),
    "experts": Role("forward", ("self", "hidden_states", "top_k_index", "top_k_weights")),
    "shared_expert_moe": Role("forward", ("self", "hidden_states")),
    "gated_delta_net": Role("forward", _GATED_DELTA_NET_FORWARD),
    "gated_rms_norm": Role("forward", ("self", "hidden_states", "gate")),
    "text_model": Role("forward", _TEXT_MODEL_FORWARD),
}
READ_ONLY_ROLES = ("attention",)
ATTENTION_REGISTRIES = (("transformers", "AttentionInterface"), ("transformers.masking_utils", "AttentionMaskInterface"))
REGISTER_PARAMS = ("key", "value")


def classes(arch: architectures.Architecture) -> dict[str, str | None]:
    """role -> the class that plays it in ``arch``'s modeling module (None: a module-level function).

    Per the entry: a ``(1 + w)`` norm patches ``RMSNorm`` as ``unit_offset_norm``; gated attention
    replaces the attention's forward (``gated_attention``) instead of reading it; an MoE block with a
    shared expert and Gated DeltaNet layers add their classes."""
    p = arch.transformers_prefix
    found: dict[str, str | None] = {
        "unit_offset_norm" if arch.unit_offset_norm else "rms_norm": p + "RMSNorm",
        "rotary": p + arch.rotary_class, "apply_rotary": None, "mlp": p + "MLP",
        "gated_attention" if arch.gated_attention else "attention": p + "Attention",
        "decoder_layer": p + "DecoderLayer", "causal_lm": p + "ForCausalLM", "causal_lm_forward": p + "ForCausalLM",
    }
    if arch.moe is not None:
        found["renormalizing_router" if arch.moe.always_renormalize else "router"] = arch.moe.transformers_router
        found["experts"] = arch.moe.transformers_experts
        if arch.moe.shared_expert is not None:
            found["shared_expert_moe"] = arch.moe.shared_expert
    if arch.linear_attention is not None:
        linear = arch.linear_attention
        found.update(gated_delta_net=linear.layer, gated_rms_norm=linear.norm, text_model=linear.text_model)
    return found


def targets() -> list[tuple[str, patching.Target]]:
    """(role, target) of every transformers target, per architecture of the table, in patch order."""
    out = []
    for arch in architectures.TABLE:
        for role, owner in classes(arch).items():
            r = ROLES[role]
            attribute = r.attribute if owner is None else f"{owner}.{r.attribute}"
            out.append((role, patching.Target(arch.transformers_module, attribute, r.params, r.leading, _WRITTEN_FOR)))
    return out


def _registries() -> list:
    """The two attention registries, each checked: ``register(key, value)`` and a ``_global_mapping``
    dict (the registrations, read to remove ours)."""
    found = []
    for module, name in ATTENTION_REGISTRIES:
        register = patching.Target(module, f"{name}.register", REGISTER_PARAMS, written_for=_WRITTEN_FOR)
        patching.check([register, patching.Target(module, f"{name}._global_mapping", dict, written_for=_WRITTEN_FOR)])
        found.append(register.owner())
    return found


def check_targets() -> list[str]:
    """Check, without patching, every target :func:`apply` touches; returns their names."""
    _registries()
    checked = [target for _, target in targets()]
    patching.check(checked)
    return [target.name for target in checked]


_APPLIED: patching.Applied | None = None
_COVERED: dict[tuple[str, ...], tuple[type, ...]] = {}


def applied() -> bool:
    return _APPLIED is not None


def covered(*roles: str) -> tuple[type, ...]:
    """The classes of ``roles`` (e.g. "attention", "decoder_layer", "causal_lm") of all architectures."""
    if roles not in _COVERED:
        _COVERED[roles] = tuple(t.owner() for r, t in targets() if r in roles and "." in t.attribute)
    return _COVERED[roles]


def apply(replacements: Mapping[str, Callable[[Callable], Callable]], attention_name: str,
          registrations: tuple[Callable, Callable]) -> None:
    """Patch every target (idempotent) and register ``registrations`` (the attention function, the mask
    function) under ``attention_name``; all checked first. ``replacements``: role -> the factory that
    takes the original and returns its replacement (the module code: :mod:`.forwards`)."""
    global _APPLIED
    registries = _registries()
    checked = targets()
    patching.check(target for _, target in checked)
    missing = {role for role, _ in checked if role not in READ_ONLY_ROLES} - set(replacements)
    if missing:
        raise ValueError(f"apply: no replacement for the roles {sorted(missing)}")
    for registry, function in zip(registries, registrations):
        registry.register(attention_name, function)
    if _APPLIED is not None:
        return
    _APPLIED = patching.apply(
        patching.Patch(target, make=replacements[role]) for role, target in checked if role not in READ_ONLY_ROLES
    )


def revert(attention_name: str) -> None:
    """Undo :func:`apply`: originals restored, the ``attention_name`` registrations removed."""
    global _APPLIED
    if _APPLIED is not None:
        _APPLIED.revert()
        _APPLIED = None
    for registry in _registries():
        registry._global_mapping.pop(attention_name, None)


def rotary_patches(modules, make_wrapper: Callable[[Callable], Callable]) -> list[patching.Patch]:
    """Patches by which each covered modeling module among ``modules`` calls ``make_wrapper(current)``
    as its ``apply_rotary_pos_emb`` (the diagnosis capture records the rotation); applied through
    :func:`true_on_policy.patching.apply`, each target checked like :func:`apply`'s."""
    names = {module.__name__ for module in modules if module is not None}
    found: dict[str, patching.Patch] = {}
    for role, target in targets():
        if role == "apply_rotary" and target.module in names:  # one module may serve several architectures
            found.setdefault(target.name, patching.Patch(target, make=make_wrapper))
    return list(found.values())
