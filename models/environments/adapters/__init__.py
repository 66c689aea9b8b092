"""Environments other libraries wrote, used unchanged: ``rollout.environment`` names one as
``LIBRARY:WHAT`` and an adapter (one small module per library, imported only when named) makes it an
:class:`models.environments.episodes.Environment`. docs/multi_turn.md has a section per library.

| spec | library (the ``envs`` extra) | what is named |
|---|---|---|
| ``verifiers:NAME`` | ``verifiers`` (prime-rl) | an environment module loaded by ``verifiers.load_environment`` |
| ``openenv:module:Class`` | ``openenv-core`` | an OpenEnv ``Environment`` class, run in this process |
| ``openenv:http://host:port`` | ``openenv-core`` | an OpenEnv server someone started |
| ``textarena:ENV_ID`` | ``textarena`` | a single-player game of ``textarena.make`` |
| ``gem:ENV_ID`` | ``gem-llm`` | a game of ``gem.make`` |
| ``skyrl:ENV_ID`` | ``skyrl-gym`` | an environment of ``skyrl_gym.make`` |
| ``gym:module:factory`` | none | any Gymnasium-style text environment ``factory()`` returns |

Anything else is ``module:Class`` of this project's own protocol, as before. This module imports no
library: the config checks a spec's form with :func:`spec_error` (torch-free), the run's set-up calls
:func:`check_environment` before any model loads, and the rollout :func:`environment_factory`.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Mapping, NamedTuple, Tuple


class Library(NamedTuple):
    module: str
    """The adapter module (``models.environments.adapters.<module>``)."""
    package: str
    """The PyPI package it needs (empty: none)."""
    form: str
    """What follows ``LIBRARY:`` in the spec."""


LIBRARIES: Dict[str, Library] = {
    "verifiers": Library("verifiers_env", "verifiers", "NAME (an installed verifiers environment module)"),
    "openenv": Library("openenv_env", "openenv-core", "module:Class or http(s)://host:port"),
    "textarena": Library("textarena_env", "textarena", "ENV_ID (e.g. GuessTheNumber-v0)"),
    "gem": Library("gem_env", "gem-llm", "ENV_ID (e.g. game:GuessTheNumber-v0)"),
    "skyrl": Library("skyrl_env", "skyrl-gym", "ENV_ID (e.g. gsm8k_multi_turn)"),
    "gym": Library("gym_env", "", "module:factory (reset() -> obs, info; step(a) -> obs, reward, terminated, "
                                  "truncated, info)"),
}
"""Spec prefixes, each its adapter module, the package it needs and the form of the rest."""

EXTRA = "pip install '.[envs]'"
"""How to install every library an adapter uses (pyproject.toml's ``envs`` extra)."""


class EnvironmentUnavailable(ValueError):
    """What an environment needs is not here: its library, a dataset from a hub, a container, a server."""


def split_spec(spec: str) -> Tuple[str, str]:
    """``(library, rest)`` of an adapter's spec, ``("", spec)`` for this project's ``module:Class``."""
    head, _, rest = spec.partition(":")
    return (head, rest) if head in LIBRARIES else ("", spec)


def spec_error(spec: str) -> str:
    """Why ``spec`` is not a valid ``rollout.environment`` (empty when it is), importing nothing."""
    library, rest = split_spec(spec)
    if library:
        if library in ("openenv",) and rest.startswith(("http://", "https://")):
            return "" if len(rest.split("://", 1)[1].strip("/")) else f"{spec!r}: the URL names no host"
        needs_attr = library in ("openenv", "gym")
        ok = rest.count(":") == 1 and all(rest.split(":")) if needs_attr else bool(rest.strip())
        return "" if ok else f"{spec!r} must look like '{library}:{LIBRARIES[library].form}'"
    if spec.count(":") == 1 and all(spec.split(":")):
        return ""
    return (f"{spec!r} must look like 'package.module:Class' or 'LIBRARY:...' with LIBRARY one of "
            f"{sorted(LIBRARIES)} (docs/multi_turn.md)")


def adapter(library: str):
    """The adapter module of ``library``; a missing library is one line naming the extra."""
    lib = LIBRARIES[library]
    module = importlib.import_module(f"models.environments.adapters.{lib.module}")
    if lib.package:
        try:
            module.import_library()
        except ImportError as err:
            raise EnvironmentUnavailable(f"rollout.environment={library}:... needs the {lib.package!r} package, "
                                         f"not installed here ({err}): {EXTRA}") from None
    return module


def import_object(spec: str, what: str = "rollout.environment") -> Any:
    """The object ``module:attr`` names (errors name ``what`` and the spec)."""
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        raise EnvironmentUnavailable(f"{what}={spec!r}: cannot import module {module!r}: {err}") from err
    for name in attr.split("."):
        if not hasattr(obj, name):
            raise EnvironmentUnavailable(f"{what}={spec!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, name)
    return obj


def environment_factory(spec: str) -> Callable[[Mapping[str, Any]], Any]:
    """What builds one environment from a dataset row: this project's ``module:Class``, or the adapter's
    factory for ``LIBRARY:...`` (errors name the spec)."""
    library, rest = split_spec(spec)
    return adapter(library).factory(rest) if library else import_object(spec)


def check_environment(spec: str, rows) -> None:
    """Before any model loads: the library is installed, the environment needs nothing this machine
    cannot give (the adapter's ``refuse``), and one built from each probe row starts. Raises
    :class:`EnvironmentUnavailable` with the reason."""
    library, rest = split_spec(spec)
    if library:
        reason = getattr(adapter(library), "refuse", lambda _: "")(rest)
        if reason:
            raise EnvironmentUnavailable(f"rollout.environment={spec!r} cannot run here: {reason}")
    make = environment_factory(spec)
    for row in rows:
        try:
            env = make(dict(row))
            env.start()
        except EnvironmentUnavailable:
            raise
        except Exception as err:
            raise EnvironmentUnavailable(f"rollout.environment={spec!r} does not start on a training row "
                                         f"(columns {sorted(row)}): {type(err).__name__}: {err}") from err
        getattr(env, "close", lambda: None)()
