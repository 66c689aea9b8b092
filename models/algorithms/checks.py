"""The one rule for options an algorithm does not use, applied to a whole config.

An option of :data:`~models.algorithms.spec.OPTIONS` that ``run.algorithm`` does not honour is
refused when it is *set*: written in the preset or in an override (``explicit``: what
``load_config`` read), or holding a value other than its default (a config built in code, a
stored one). Left out, it is simply unused: defaults never trigger a refusal.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Iterator, List, Tuple

from models.algorithms import ALGORITHMS, get
from models.algorithms.spec import OPTIONS


def _leaves(value: Any, default: Any, path: str) -> Iterator[Tuple[str, Any, Any]]:
    """``(path, value, default)`` of every leaf field under ``path`` (nested sections walked)."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), getattr(default, f.name), f"{path}.{f.name}")
    else:
        yield path, value, default


def set_leaves(cfg: Any, option: str, explicit: Collection[str] = ()) -> List[Tuple[str, Any]]:
    """``(path, value)`` of the leaves of ``option`` that ``cfg`` sets (explicitly or off their default)."""
    section, _, name = option.partition(".")
    value = getattr(cfg, section)
    default = type(value)()  # the section's defaults
    if name:
        value, default = getattr(value, name), getattr(default, name)
    return [(path, v) for path, v, d in _leaves(value, default, option) if path in explicit or v != d]


def ignored_options(cfg: Any, explicit: Collection[str] = ()) -> List[str]:
    """One message per option ``cfg`` sets that its ``run.algorithm`` does not use (empty: none)."""
    spec = get(cfg.run.algorithm)
    out = []
    for option, reason in OPTIONS.items():
        if option in spec.honours:
            continue
        users = ", ".join(name for name, s in ALGORITHMS.items() if option in s.honours)
        for path, value in set_leaves(cfg, option, explicit):
            out.append(f"{path}={value!r} is set, but run.algorithm={spec.name} does not use it: {reason} "
                       f"(used by {users or 'none'}); leave it out")
    return out

