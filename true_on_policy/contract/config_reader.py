"""Strict reads of the resolved config: a value that cannot be read is a :class:`ConfigError`.

Only :mod:`true_on_policy.contract.config_views` reads the config, through :func:`lookup` and the
converters below. Absent or null keys read as the field's default; a present value of the wrong
kind, or an interpolation that does not resolve, names the key and the value instead of turning
into a default.
"""

from __future__ import annotations

import json
from typing import Any

from true_on_policy.config.settings import ConfigError as SettingsConfigError


class ConfigError(SettingsConfigError):
    """A config value the plan or the contract cannot use: names the key and the value."""

    def __init__(self, key: str, value: Any, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"{key}={value!r}: {expected}")


_MISSING = object()


def lookup(config: Any, dotted: str) -> Any:
    """``config[dotted]``, or None when a key on the way is absent or null.

    A key that is present but cannot be resolved (a broken interpolation) is a :class:`ConfigError`.
    """
    node = config
    for part in dotted.split("."):
        if node is None:
            return None
        try:
            if hasattr(node, "get"):
                node = node.get(part, _MISSING)
            else:
                node = getattr(node, part, _MISSING)
        except Exception as exc:  # noqa: BLE001 - an interpolation that cannot resolve: name the key
            raise ConfigError(dotted, "<unresolvable>", f"cannot be read: {type(exc).__name__}: {exc}") from exc
        if node is _MISSING:
            return None
    return node


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
