"""Load a :class:`~models.config.TrainConfig` from a YAML preset plus ``section.field=value`` overrides.

Only entry points call these; the rest of the code receives a finished, frozen config.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from typing import Any, Dict, Iterable, List, Mapping

import yaml

from models.algorithms.checks import ignored_options
from models.config import ConfigError, TrainConfig, aliases

PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _field_types(cls) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return str(value)
    if origin in (list, List):
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    raise ConfigError(f"{where}: unsupported field type {tp}")


def from_dict(cls, data: Mapping[str, Any] | None, where: str = "config"):
    """Build dataclass ``cls`` from a plain mapping; unknown keys are errors that name the key."""
    if not isinstance(data or {}, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    data = dict(data or {})
    types = _field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ConfigError(f"unknown key(s) in {where}: {unknown}; known: {sorted(types)}")
    kwargs = {k: _coerce(v, types[k], f"{where}.{k}" if where != "config" else k) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg) -> Dict[str, Any]:
    """The config as plain nested dicts (YAML/JSON friendly). A :class:`TrainConfig`'s ``kl`` is the one the
    run uses (``TrainConfig.effective_kl``: an empty placement or estimator as the algorithm's), so a stored
    config and the MLflow params name what the run did; it reads back equal (``TrainConfig.__eq__``)."""
    data = dataclasses.asdict(cfg)
    if isinstance(cfg, TrainConfig):
        data["kl"] = dataclasses.asdict(cfg.effective_kl)
    return data


def flatten(cfg) -> Dict[str, Any]:
    """``{"actor.lr": 1e-5, ...}`` — the whole config as flat key/value pairs (MLflow params)."""
    return flat_items(to_dict(cfg))


def flat_items(data: Mapping[str, Any]) -> Dict[str, Any]:
    """Nested mappings as ``{"section.field": value}`` (leaves only)."""
    out: Dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value

    walk("", data)
    return out


def parse_override(text: str) -> tuple[List[str], Any]:
    """``"actor.lr=3e-4"`` → (["actor", "lr"], 3e-4); nested sections too: ``"actor.lora.rank=8"``
    → (["actor", "lora", "rank"], 8). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if len(path) < 2:
        raise ConfigError(f"override {text!r}: key must be section.field (e.g. actor.lr, actor.lora.rank)")
    return path, yaml.safe_load(raw) if raw.strip() else ""


def _set_path(data: Dict[str, Any], path: List[str], value: Any, text: str) -> None:
    """``data[path[0]][path[1]]... = value``, creating sections on the way."""
    node = data
    for depth, part in enumerate(path[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {text!r}: {'.'.join(path[:depth + 1])} is a value, not a section")
    node[path[-1]] = value


def resolve_preset(preset: str) -> pathlib.Path:
    """A preset path as given, or relative to the project root (so packaged code finds ``configs/``)."""
    p = pathlib.Path(preset)
    for candidate in (p, PROJECT_ROOT / p, PROJECT_ROOT / "configs" / p, PROJECT_ROOT / "configs" / f"{p}.yaml"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"preset {preset!r} not found (looked in the working directory and {PROJECT_ROOT / 'configs'})")


BASE_KEY = "base"
"""A preset's top-level ``base: <preset>`` starts it from another preset (a path relative to the file,
or a name under ``configs/``); its own sections are merged over the base's, key by key."""


def read_preset(path: pathlib.Path, _chain: tuple = ()) -> Dict[str, Any]:
    """The sections of the preset at ``path`` with its ``base`` chain resolved (nested dicts)."""
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"preset {path} must be a mapping of sections")
    base = loaded.pop(BASE_KEY, None)
    data = {k: dict(v or {}) for k, v in loaded.items()}
    if base is None:
        return data
    chain = _chain + (path.resolve(),)
    base_path = _resolve_base(str(base), path)
    if base_path.resolve() in chain:
        names = " -> ".join(str(p) for p in chain + (base_path.resolve(),))
        raise ConfigError(f"preset {path}: base {base!r} makes a cycle ({names})")
    return _merged(read_preset(base_path, chain), data)


def _resolve_base(base: str, preset: pathlib.Path) -> pathlib.Path:
    beside = preset.parent / base
    if beside.is_file():
        return beside
    try:
        return resolve_preset(base)
    except ConfigError:
        raise ConfigError(f"preset {preset}: base {base!r} not found (looked beside it and in "
                          f"{PROJECT_ROOT / 'configs'})") from None


def _merged(base: Dict[str, Any], over: Mapping[str, Any]) -> Dict[str, Any]:
    """``base`` with ``over`` on top; nested mappings (sections, ``actor.lora``) merge key by key."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    aliases.one_setting(out, over)
    return out


def given_values(preset: str = "", overrides: Iterable[str] = ()) -> Dict[str, Any]:
    """What the user wrote: the preset's sections with the overrides applied, as nested dicts (no
    defaults filled in, nothing checked)."""
    data: Dict[str, Any] = read_preset(resolve_preset(preset)) if preset else {}
    for text in overrides:
        path, value = parse_override(text)
        _set_path(data, path, value, text)
        aliases.one_setting(data, {path[0]: {path[1]: value}} if len(path) == 2 else {})
    return aliases.upgrade(data)


def given_keys(preset: str = "", overrides: Iterable[str] = ()) -> List[str]:
    """The flat keys (``actor.lr``, ``actor.lora.rank``) the preset and the overrides set, sorted."""
    return sorted(flat_items(given_values(preset, overrides)))


def load_config(preset: str = "", overrides: Iterable[str] = ()) -> TrainConfig:
    """Preset YAML (optional) + overrides → a checked :class:`TrainConfig`; an option the algorithm
    does not use is refused when written, even at its default (:mod:`models.algorithms.checks`)."""
    data = given_values(preset, overrides)
    cfg = from_dict(TrainConfig, data)
    ignored = ignored_options(cfg, explicit=set(flat_items(data)))  # written, even at its default
    if ignored:
        raise ConfigError(ignored[0])
    return cfg


def config_from_json_dict(data: Mapping[str, Any]) -> TrainConfig:
    """Inverse of :func:`to_dict` (used when a config travels as JSON, and for a run's stored config,
    whose old keys :func:`models.config.aliases.upgrade` maps onto today's)."""
    return from_dict(TrainConfig, aliases.upgrade(data, stored=True))
