"""Every change to transformers' internals, in one place, checked against transformers 5.9.0.

For each architecture of :data:`true_on_policy.kernels.architectures.TABLE`, in its module
``transformers.models.<model_type>.modeling_<model_type>`` (``P`` its class prefix), the module
code of :mod:`true_on_policy.kernels.model` replaces:

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
==================================  ================================================================

Read, not replaced: ``PAttention.forward`` (it hands the registered attention function the
arguments the consistent one takes). Registered under ``"consistent"``: the attention function in
``transformers.AttentionInterface`` and the mask function in
``transformers.masking_utils.AttentionMaskInterface``, through their ``register``; removed again
through their private ``_global_mapping`` dict.

:func:`apply` checks every target first -- present, and with the parameters it has in
transformers 5.9.0 -- and patches nothing if one differs: :class:`true_on_policy.patching.PatchTargetChanged`
names it (the mechanism is :mod:`true_on_policy.patching`'s).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from true_on_policy import patching
from true_on_policy.kernels import architectures

TRANSFORMERS_VERSION = "5.9.0"  # the version every parameter list below is taken from (tested)
_WRITTEN_FOR = f"transformers {TRANSFORMERS_VERSION}"

_ATTENTION_FORWARD = ("self", "hidden_states", "position_embeddings", "attention_mask", "past_key_values", "kwargs")
# The causal LM's forward is wrapped with (*args, **kwargs) and passes everything on: its leading
# parameters are checked (MoE models add output_router_logits after them).
_CAUSAL_LM_FORWARD = ("self", "input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                      "use_cache")


@dataclass(frozen=True)
class Role:
    """One role's target in each architecture's modeling module: ``<prefix><suffix>.<attribute>``
    (no suffix: a module-level function, or the MoE classes the architecture names), with its
    parameters in transformers 5.9.0 (``leading``: only the first ones are fixed)."""

    suffix: str
    attribute: str
    params: tuple[str, ...]
    leading: bool = False


ROLES: dict[str, Role] = {
    "rms_norm": Role("RMSNorm", "forward", ("self", "hidden_states")),
    "rotary": Role("RotaryEmbedding", "forward", ("self", "x", "position_ids")),
    "apply_rotary": Role("", "apply_rotary_pos_emb", ("q", "k", "cos", "sin", "unsqueeze_dim")),
    "mlp": Role("MLP", "forward", ("self", "x")),
    "attention": Role("Attention", "forward", _ATTENTION_FORWARD),
    "decoder_layer": Role("DecoderLayer", "__init__", ("self", "config", "layer_idx")),
    "causal_lm": Role("ForCausalLM", "__init__", ("self", "config")),
    "causal_lm_forward": Role("ForCausalLM", "forward", _CAUSAL_LM_FORWARD, leading=True),
    "router": Role("", "forward", ("self", "hidden_states")),
    "experts": Role("", "forward", ("self", "hidden_states", "top_k_index", "top_k_weights")),
}
READ_ONLY_ROLES = ("attention",)
ATTENTION_REGISTRIES = (("transformers", "AttentionInterface"), ("transformers.masking_utils", "AttentionMaskInterface"))
REGISTER_PARAMS = ("key", "value")


def targets() -> list[tuple[str, patching.Target]]:
    """(role, target) of every transformers target, per architecture of the table, in patch order."""
    out = []
    for arch in architectures.TABLE:
        classes = {role: arch.transformers_prefix + r.suffix for role, r in ROLES.items() if r.suffix}
        classes["apply_rotary"] = None
        if arch.moe is not None:
            classes["router"], classes["experts"] = arch.moe.transformers_router, arch.moe.transformers_experts
        for role, owner in classes.items():
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
_COVERED: dict[str, tuple[type, ...]] = {}


def applied() -> bool:
    return _APPLIED is not None


def covered(role: str) -> tuple[type, ...]:
    """The classes of ``role`` (e.g. "attention", "decoder_layer", "causal_lm") of all architectures."""
    if role not in _COVERED:
        _COVERED[role] = tuple(t.owner() for r, t in targets() if r == role and "." in t.attribute)
    return _COVERED[role]


def apply(replacements: Mapping[str, Callable[[Callable], Callable]], attention_name: str,
          registrations: tuple[Callable, Callable]) -> None:
    """Patch every target (idempotent) and register ``registrations`` (the attention function, the mask
    function) under ``attention_name``; all checked first. ``replacements``: role -> the factory that
    takes the original and returns its replacement (the module code: :mod:`true_on_policy.kernels.model`)."""
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
