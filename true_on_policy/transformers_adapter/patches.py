"""Every change to transformers' internals, in one place, checked against transformers 5.9.0.

For each architecture of :data:`true_on_policy.kernels.architectures.TABLE`, in its module
``transformers.models.<model_type>.modeling_<model_type>`` (``P`` its class prefix), the module
code of :mod:`true_on_policy.kernels.model` replaces:

==================================  ================================================================
target                              replacement (flag off: transformers' original runs)
==================================  ================================================================
``PRMSNorm.forward``                :func:`ops.rms_norm`
``PRotaryEmbedding.forward``        rows of the one fp32 RoPE table
``apply_rotary_pos_emb`` (module)   the fp32 rotation (and, within :func:`wrapping_apply_rotary`,
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
transformers 5.9.0 -- and patches nothing if one differs: :class:`TransformersPatchError` names it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from true_on_policy.kernels import architectures

TRANSFORMERS_VERSION = "5.9.0"  # the version every parameter list below is taken from (tested)

_ATTENTION_FORWARD = ("self", "hidden_states", "position_embeddings", "attention_mask", "past_key_values", "kwargs")
# The causal LM's forward is wrapped with (*args, **kwargs) and passes everything on: its leading
# parameters are checked (MoE models add output_router_logits after them).
_CAUSAL_LM_FORWARD = ("self", "input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                      "use_cache")

# role -> (class-name suffix, attribute, its parameters in transformers 5.9.0, leading parameters only)
ROLES: dict[str, tuple[str, str, tuple[str, ...], bool]] = {
    "rms_norm": ("RMSNorm", "forward", ("self", "hidden_states"), False),
    "rotary": ("RotaryEmbedding", "forward", ("self", "x", "position_ids"), False),
    "apply_rotary": ("", "apply_rotary_pos_emb", ("q", "k", "cos", "sin", "unsqueeze_dim"), False),
    "mlp": ("MLP", "forward", ("self", "x"), False),
    "attention": ("Attention", "forward", _ATTENTION_FORWARD, False),
    "decoder_layer": ("DecoderLayer", "__init__", ("self", "config", "layer_idx"), False),
    "causal_lm": ("ForCausalLM", "__init__", ("self", "config"), False),
    "causal_lm_forward": ("ForCausalLM", "forward", _CAUSAL_LM_FORWARD, True),
    "router": ("", "forward", ("self", "hidden_states"), False),
    "experts": ("", "forward", ("self", "hidden_states", "top_k_index", "top_k_weights"), False),
}
READ_ONLY_ROLES = ("attention",)
ATTENTION_REGISTRIES = (("transformers", "AttentionInterface"), ("transformers.masking_utils", "AttentionMaskInterface"))
REGISTER_PARAMS = ("key", "value")


class TransformersPatchError(RuntimeError):
    """A patched transformers target is missing or changed: the patch would not do what it says."""


@dataclass(frozen=True)
class Target:
    architecture: str
    role: str
    module: str
    owner: str | None  # the class, or None for a module-level function
    attribute: str
    params: tuple[str, ...]
    leading: bool

    @property
    def name(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.attribute) if p)


def targets() -> list[Target]:
    """Every transformers target, per architecture of the table, in patch order."""
    out = []
    for arch in architectures.TABLE:
        classes = {role: arch.transformers_prefix + suffix for role, (suffix, *_rest) in ROLES.items() if suffix}
        classes["apply_rotary"] = None
        if arch.moe is not None:
            classes["router"], classes["experts"] = arch.moe.transformers_router, arch.moe.transformers_experts
        for role, owner in classes.items():
            _, attribute, params, leading = ROLES[role]
            out.append(Target(arch.name, role, arch.transformers_module, owner, attribute, params, leading))
    return out


def _resolve(target: Target):
    """(owner object, the attribute's current value), or TransformersPatchError naming what is missing."""
    try:
        owner = importlib.import_module(target.module)
    except ImportError as error:
        raise TransformersPatchError(
            f"{target.name}: module {target.module} cannot be imported ({error}); true_on_policy covers "
            f"{target.architecture} with transformers {TRANSFORMERS_VERSION}'s module"
        ) from error
    if target.owner is not None:
        if not hasattr(owner, target.owner):
            raise TransformersPatchError(f"{target.name}: {target.module} has no class {target.owner} "
                                         f"(transformers {TRANSFORMERS_VERSION} has it)")
        owner = getattr(owner, target.owner)
    if not hasattr(owner, target.attribute):
        raise TransformersPatchError(f"{target.name}: missing (transformers {TRANSFORMERS_VERSION} has it)")
    return owner, getattr(owner, target.attribute)


def check(target: Target):
    """Resolve ``target`` and compare its parameters with transformers 5.9.0's; returns (owner, original).

    A function this module installed is checked through the original it replaced.
    """
    owner, value = _resolve(target)
    value = _ORIGINALS.get((owner, target.attribute), value)
    params = tuple(inspect.signature(value).parameters)
    if (params[: len(target.params)] if target.leading else params) != target.params:
        which = "leading parameters" if target.leading else "parameters"
        raise TransformersPatchError(
            f"{target.name}: its {which} are {params}, true_on_policy's patch was written for {target.params} "
            f"(transformers {TRANSFORMERS_VERSION}); the patch must be reviewed for this transformers version"
        )
    return owner, value


def _registries():
    """The two attention registries, each checked: ``register(key, value)`` and a ``_global_mapping`` dict."""
    found = []
    for module, name in ATTENTION_REGISTRIES:
        registry = getattr(importlib.import_module(module), name, None)
        where = f"{module}.{name}"
        if registry is None:
            raise TransformersPatchError(f"{where}: missing (transformers {TRANSFORMERS_VERSION} has it)")
        params = tuple(inspect.signature(registry.register).parameters)
        if params != REGISTER_PARAMS:
            raise TransformersPatchError(f"{where}.register: parameters {params}, written for {REGISTER_PARAMS}")
        if not isinstance(getattr(registry, "_global_mapping", None), dict):
            raise TransformersPatchError(f"{where}._global_mapping: not a dict (transformers {TRANSFORMERS_VERSION}: "
                                         "the registrations, read to remove ours)")
        found.append(registry)
    return found


def check_targets() -> list[str]:
    """Check, without patching, every target :func:`apply` touches; returns their names."""
    _registries()
    names = []
    for target in targets():
        check(target)
        names.append(target.name)
    return names


_ORIGINALS: dict[tuple[object, str], object] = {}
_COVERED: dict[str, tuple[type, ...]] = {}


def applied() -> bool:
    return bool(_ORIGINALS)


def covered(role: str) -> tuple[type, ...]:
    """The classes of ``role`` (e.g. "attention", "decoder_layer", "causal_lm") of all architectures."""
    if role not in _COVERED:
        _COVERED[role] = tuple(_resolve(t)[0] for t in targets() if t.role == role and t.owner is not None)
    return _COVERED[role]


def apply(replacements: Mapping[str, Callable[[Callable], Callable]], attention_name: str,
          registrations: tuple[Callable, Callable]) -> None:
    """Patch every target (idempotent) and register ``registrations`` (the attention function, the mask
    function) under ``attention_name``; all checked first. ``replacements``: role -> the factory that
    takes the original and returns its replacement (the module code: :mod:`true_on_policy.kernels.model`)."""
    registries = _registries()
    checked = [(target, *check(target)) for target in targets()]
    missing = {target.role for target, *_ in checked if target.role not in READ_ONLY_ROLES} - set(replacements)
    if missing:
        raise TransformersPatchError(f"apply: no replacement for the roles {sorted(missing)}")
    for registry, function in zip(registries, registrations):
        registry.register(attention_name, function)
    if _ORIGINALS:
        return
    for target, owner, original in checked:
        if target.role in READ_ONLY_ROLES:
            continue
        _ORIGINALS[owner, target.attribute] = original
        setattr(owner, target.attribute, replacements[target.role](original))


def revert(attention_name: str) -> None:
    """Undo :func:`apply`: originals restored, the ``attention_name`` registrations removed."""
    for (owner, attribute), original in reversed(list(_ORIGINALS.items())):
        setattr(owner, attribute, original)
    _ORIGINALS.clear()
    for registry in _registries():
        registry._global_mapping.pop(attention_name, None)


@contextlib.contextmanager
def wrapping_apply_rotary(modules, make_wrapper: Callable[[Callable], Callable]):
    """Within the block, each covered modeling module among ``modules`` calls
    ``make_wrapper(current)`` as its ``apply_rotary_pos_emb`` (the diagnosis capture records the
    rotation); each target is checked first, like :func:`apply`'s, and restored on exit."""
    names = {module.__name__ for module in modules if module is not None}
    swapped = []
    try:
        for target in targets():
            if target.role == "apply_rotary" and target.module in names:
                owner, _ = check(target)
                current = getattr(owner, target.attribute)
                swapped.append((owner, target.attribute, current))
                setattr(owner, target.attribute, make_wrapper(current))
                names.discard(target.module)  # one module may serve several architectures
        yield
    finally:
        for owner, attribute, current in reversed(swapped):
            setattr(owner, attribute, current)
