"""What every config section's checks share: :class:`ConfigError` and the two checks that raise it."""

from __future__ import annotations

import enum


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent with another one."""


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check_choice(name: str, value: str, choices) -> None:
    allowed = [c.value if isinstance(c, enum.Enum) else c for c in choices]
    check(value in allowed, f"{name}={value!r} is not one of {allowed}")
