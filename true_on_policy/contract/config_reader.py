"""Strict reads of the resolved config: a value that cannot be read is a :class:`ConfigError`.

Absent or null keys read as the caller's default; a present value of the wrong kind, or an
interpolation that does not resolve, names the key and the value instead of turning into a default.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value the plan or the contract cannot use: names the key and the value."""

    def __init__(self, key: str, value: Any, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"{key}={value!r}: {expected}")


_MISSING = object()


def _get(config: Any, dotted: str, default: Any = None) -> Any:
    """``config[dotted]``, or ``default`` when a key on the way is absent or null.

    A key that is present but cannot be resolved (a broken interpolation) is a :class:`ConfigError`.
    """
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            if hasattr(node, "get"):
                node = node.get(part, _MISSING)
            else:
                node = getattr(node, part, _MISSING)
        except Exception as exc:  # noqa: BLE001 - an interpolation that cannot resolve: name the key
            raise ConfigError(dotted, "<unresolvable>", f"cannot be read: {type(exc).__name__}: {exc}") from exc
        if node is _MISSING:
            return default
    return default if node is None else node


def get_int(config: Any, dotted: str, default: int = 1, *, minimum: int = 1) -> int:
    """An integer setting (absent/null = ``default``); anything else is a ConfigError."""
    value = _get(config, dotted)
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        raise ConfigError(dotted, value, f"an integer >= {minimum}")
    try:
        number = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise ConfigError(dotted, value, f"an integer >= {minimum}") from None
    if number < minimum:
        raise ConfigError(dotted, value, f"an integer >= {minimum}")
    return number


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def get_bool(config: Any, dotted: str, default: bool = False) -> bool:
    """A boolean setting (absent/null = ``default``); a string must spell true/false/1/0/yes/no/on/off."""
    value = _get(config, dotted)
    return parse_bool(dotted, value, default)


def parse_bool(key: str, value: Any, default: bool = False) -> bool:
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
