"""Patching another library's internals: the one way every engine adapter (and the diagnosis
capture) changes code it does not own.

A :class:`Target` names ``module.attribute`` (the attribute may be dotted: ``Class.method``) and
what the patch was written against: the parameter names of the callable found there (all, or only
the leading ones), or the type of the value found there. :func:`apply` checks every target of a set
before it changes anything -- a missing or changed target raises :class:`PatchTargetChanged`,
naming it and what changed, and nothing is applied -- then installs each :class:`Patch` and returns
an :class:`Applied`, whose :meth:`~Applied.revert` (or the end of its ``with`` block) puts back what
was there.

An installed replacement carries ``__wrapped__`` (the value it replaced) and a mark: a target that
is already patched is checked through the original it replaced, and :func:`is_replacement` tells
an installed replacement from the library's own code. No engine is imported here.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

_MARK = "_true_on_policy_patch"
_LOOK_UP = object()  # Target.check's default: read the target from its module


class PatchTargetChanged(RuntimeError):
    """A patch target is missing or changed: the patch would not do what it says."""


def _describe(owner: Any) -> str:
    if inspect.ismodule(owner):
        return owner.__name__
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return f"a {type(owner).__name__}"


def is_replacement(value: Any) -> bool:
    """Was ``value`` installed by :func:`apply` (in place of its ``__wrapped__``)?"""
    return getattr(value, _MARK, False) is True


def original_of(value: Any) -> Any:
    """The library's own value behind installed replacements (``value`` itself if it is none)."""
    while is_replacement(value) and hasattr(value, "__wrapped__"):
        value = value.__wrapped__
    return value


@dataclass(frozen=True)
class Target:
    """``module.attribute`` as a patch was written against it.

    ``expected``: the parameter names of the callable found there (``leading``: only its first
    parameters are fixed), or the type of the value found there. ``written_for`` (e.g.
    ``"verl 0.9.1"``) is the version the patch was written against, said in every refusal.
    """

    module: str
    attribute: str
    expected: tuple[str, ...] | type
    leading: bool = False
    written_for: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"

    def changed(self, what: str) -> PatchTargetChanged:
        against = f" (the patch was written against {self.written_for})" if self.written_for else ""
        return PatchTargetChanged(f"{self.name}: {what}{against}; true_on_policy cannot patch it safely")

    def _get(self, owner: Any, part: str) -> Any:
        if not hasattr(owner, part):
            raise self.changed(f"{_describe(owner)} has no attribute {part!r} (renamed or removed?)")
        return getattr(owner, part)

    def owner(self) -> Any:
        """The object the attribute's last part lives on: the module, or a class in it."""
        try:
            owner = importlib.import_module(self.module)
        except ImportError as error:
            raise self.changed(f"module {self.module} cannot be imported ({error})") from error
        for part in self.attribute.split(".")[:-1]:
            owner = self._get(owner, part)
        return owner

    def resolve(self, owner: Any = None) -> tuple[Any, Any]:
        """(owner, the attribute's current value); ``owner`` given: read there instead (a subclass,
        a module that imported the name)."""
        owner = self.owner() if owner is None else owner
        return owner, self._get(owner, self.attribute.rsplit(".", 1)[-1])

    def check(self, found: Any = _LOOK_UP) -> Any:
        """Check the current value (or ``found``) against :attr:`expected`; returns the original
        (an installed replacement is checked through the value it replaced)."""
        value = original_of(self.resolve()[1] if found is _LOOK_UP else found)
        if isinstance(self.expected, type):
            if not isinstance(value, self.expected):
                raise self.changed(f"expected a {self.expected.__name__}, found a {type(value).__name__}")
            return value
        if not callable(value):
            raise self.changed(f"expected a callable with parameters {self.expected}, found a {type(value).__name__}")
        params = tuple(inspect.signature(value).parameters)
        if (params[: len(self.expected)] if self.leading else params) != self.expected:
            which = "leading parameters" if self.leading else "parameters"
            raise self.changed(f"its {which} changed: expected {self.expected}, found {params}")
        return value


def check(targets: Iterable[Target]) -> list[Any]:
    """Check every target (nothing is patched); returns their originals."""
    return [target.check() for target in targets]


@dataclass(frozen=True)
class Patch:
    """Install ``replacement`` at ``target`` -- or ``make(current value)``, for a replacement that
    calls what it replaces. ``owner``: install there instead of on the target's own module or class
    (a subclass, a module that bound the name at import), still checked against ``target``."""

    target: Target
    replacement: Callable | None = None
    make: Callable[[Any], Callable] | None = None
    owner: Any = None

    def __post_init__(self) -> None:
        if (self.replacement is None) == (self.make is None):
            raise ValueError(f"Patch of {self.target.name}: give exactly one of replacement= and make=")


class Applied:
    """The patches :func:`apply` installed; :meth:`revert` (or leaving its ``with`` block) undoes them."""

    def __init__(self, installed: list[tuple[Any, str, bool, Any]]) -> None:
        self._installed = installed  # (owner, attribute, owner had its own value, that raw value)

    def revert(self) -> None:
        """Put back what each patch replaced, in reverse order (an inherited attribute is inherited again)."""
        for owner, attribute, own, raw in reversed(self._installed):
            if own:
                setattr(owner, attribute, raw)
            else:
                delattr(owner, attribute)
        self._installed = []

    def __enter__(self) -> Applied:
        return self

    def __exit__(self, *exc_info) -> None:
        self.revert()


def _replacement(patch: Patch, current: Any) -> Any:
    new = patch.make(current) if patch.make is not None else patch.replacement
    if new is current or new is original_of(current):
        raise ValueError(f"Patch of {patch.target.name}: a patch must install a new function, got the one it replaces")
    if is_replacement(new) and new.__wrapped__ is not current:
        raise ValueError(f"Patch of {patch.target.name}: {new!r} is installed elsewhere over another function; "
                         "give each target its own function")
    return new


def apply(patches: Iterable[Patch]) -> Applied:
    """Check every patch's target, then install every replacement; returns the handle that reverts them.

    A missing or changed target raises :class:`PatchTargetChanged` before anything is installed.
    """
    patches = list(patches)
    found = []
    for patch in patches:
        owner, current = patch.target.resolve(patch.owner)
        patch.target.check(current)
        found.append((patch, owner, patch.target.attribute.rsplit(".", 1)[-1], current))
    places = [(id(owner), attribute) for _, owner, attribute, _ in found]
    if len(set(places)) != len(places):
        raise ValueError(f"one attribute patched twice in one set: {[p.target.name for p in patches]}")
    planned = [(owner, attribute, current, _replacement(patch, current)) for patch, owner, attribute, current in found]
    installed = []
    for owner, attribute, current, new in planned:
        own = attribute in vars(owner)
        raw = inspect.getattr_static(owner, attribute)
        new.__wrapped__ = current
        setattr(new, _MARK, True)
        installed.append((owner, attribute, own, raw))
        setattr(owner, attribute, staticmethod(new) if isinstance(raw, staticmethod) else new)
    return Applied(installed)
