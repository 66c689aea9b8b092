"""Reward functions: the plug-in interface, spec resolution, the columns a function takes, and
result validation.

A reward function scores finished samples, TRL's convention::

    fn(prompts: list[str], responses: list[str], **columns) -> list[float]

one finite float per sample. ``columns`` are the prompt row's other data columns (e.g. ``answer``),
each a list aligned with the samples. A function takes the columns it names as parameters, or all
of them with ``**kwargs``; the two-argument form ``fn(prompts, responses)`` takes none. Plain
functions (e.g. ``models.task:reverse_reward``), a learned reward model and an HTTP reward client
all score the same samples; functions are called through :func:`compute_rewards`, which turns
every kind of misbehaviour into a :class:`RewardError` that names the function and the sample.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Protocol, Sequence, runtime_checkable


@runtime_checkable
class RewardSource(Protocol):
    """Anything that scores a batch of (prompt, response) texts."""

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Return one reward per sample, in order; `len(result) == len(prompts)`."""
        ...


class RewardError(RuntimeError):
    """A reward source could not be resolved, raised, or returned an invalid result."""


def resolve_reward_fn(spec: str) -> RewardSource:
    """Import `"package.module:function"` and return the callable it names.

    The attribute part may be dotted (`"pkg.mod:Class.method"`). Raises `RewardError`
    for a malformed spec, a module that cannot be imported, a missing attribute, or an
    attribute that is not callable.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise RewardError(f"reward spec must look like 'package.module:function', got {spec!r}")
    module_name, attr_path = (part.strip() for part in spec.split(":"))
    if not module_name or not attr_path:
        raise RewardError(f"reward spec must look like 'package.module:function', got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward spec {spec!r}: cannot import module {module_name!r}: {e}") from e
    for name in attr_path.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError as e:
            raise RewardError(
                f"reward spec {spec!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from e
    if not callable(obj):
        raise RewardError(
            f"reward spec {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable"
        )
    return obj


class ColumnParams(NamedTuple):
    """What a reward function takes besides ``(prompts, responses)``."""

    named: List[str]
    """Parameters after the first two that can be passed by keyword."""
    required: List[str]
    """Those of ``named`` without a default: the data must have such a column."""
    takes_all: bool
    """The function has ``**kwargs``: it is given every column."""


def column_params(fn: Any) -> ColumnParams:
    """The column parameters of ``fn`` (none for a callable whose signature cannot be read)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ColumnParams([], [], False)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p not in positional[:2]]
    return ColumnParams(named=[p.name for p in rest],
                        required=[p.name for p in rest if p.default is p.empty],
                        takes_all=any(p.kind == p.VAR_KEYWORD for p in params))


def columns_for(params: ColumnParams, columns: Optional[Mapping[str, Sequence[Any]]], name: str,
                options: Optional[Mapping[str, Any]] = None) -> Dict[str, list]:
    """The columns a function with ``params`` takes (all of them with ``**kwargs``). A required
    parameter that is neither a column nor one of ``options`` raises a :class:`RewardError`
    naming it and the columns there are."""
    columns, options = dict(columns or {}), dict(options or {})
    missing = [p for p in params.required if p not in columns and p not in options]
    if missing:
        raise RewardError(f"reward {name} takes {missing}, which the prompt data does not have as column(s) "
                          f"(its columns: {sorted(columns)})")
    keep = columns if params.takes_all else {k: v for k, v in columns.items() if k in params.named}
    return {k: list(v) for k, v in keep.items()}


def options_for(params: ColumnParams, options: Optional[Mapping[str, Any]], columns: Mapping[str, Any]) -> dict:
    """The settings of ``options`` (e.g. ``format_pattern``) that a function names as parameters,
    unless a data column of that name takes the place."""
    return {k: v for k, v in (options or {}).items() if k in params.named and k not in columns}


def _describe(fn: object, spec: str | None) -> str:
    if spec is not None:
        return repr(spec)
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return repr(f"{module}:{name}" if module else name)


def _first_failing_sample(fn: RewardSource, prompts: Sequence[str], responses: Sequence[str],
                          kwargs: Mapping[str, list], settings: Mapping[str, Any]) -> int | None:
    """Index of the first sample that makes `fn` raise on its own (error path only)."""
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        try:
            fn([prompt], [response], **{k: [v[i]] for k, v in kwargs.items()}, **settings)
        except Exception:
            return i
    return None


def compute_rewards(
    fn: RewardSource,
    prompts: Sequence[str],
    responses: Sequence[str],
    spec: str | None = None,
    columns: Optional[Mapping[str, Sequence[Any]]] = None,
    options: Optional[Mapping[str, Any]] = None,
    offset: int = 0,
) -> list[float]:
    """Call `fn` on the batch and validate its answer.

    Args:
        fn: the reward function.
        prompts, responses: texts of the batch, same length B.
        spec: how the function was named (e.g. "models.task:reverse_reward"), for errors;
            defaults to the function's module and qualified name.
        columns: the prompt rows' other columns, ``{name: [B] values}``; `fn` is given those it
            takes (:func:`columns_for`).
        options: settings from the config (e.g. ``format_pattern``), given as they are to a
            function that names them as parameters.
        offset: index of the first sample in the whole batch (errors name batch indices).
    Returns:
        B finite Python floats. Shape: (B,).
    Raises:
        RewardError: `fn` raised (the batch is then re-scored one sample at a time to
            find the first sample at fault), returned a non-sequence, a string or mapping, a
            sequence of the wrong length, or a value that is not a real number (bools included)
            or not finite; or `fn` takes a column the data lacks. The message names the function
            and, where one is at fault, the sample index.
    """
    name = _describe(fn, spec)
    if len(prompts) != len(responses):
        raise RewardError(f"reward {name}: {len(prompts)} prompts but {len(responses)} responses")
    params = column_params(fn)
    kwargs = columns_for(params, columns, name, options)
    settings = options_for(params, options, kwargs)
    bad_len = {k: len(v) for k, v in kwargs.items() if len(v) != len(prompts)}
    if bad_len:
        raise RewardError(f"reward {name}: column lengths {bad_len} differ from the {len(prompts)} samples")
    try:
        result = fn(list(prompts), list(responses), **kwargs, **settings)
    except Exception as e:
        where = _first_failing_sample(fn, prompts, responses, kwargs, settings)
        at = f" (first failing sample: {offset + where})" if where is not None else ""
        span = f"a batch of {len(prompts)}" if not offset else f"samples {offset}-{offset + len(prompts) - 1}"
        raise RewardError(f"reward {name} raised on {span}{at}: {e!r}") from e
    return _check_values(result, len(prompts), name, offset)


def _check_values(result: Any, n: int, name: str, offset: int = 0) -> list[float]:
    """``result`` as ``n`` finite floats, else a :class:`RewardError` that names the real cause."""
    if hasattr(result, "tolist"):  # numpy arrays and torch tensors
        result = result.tolist()
    if isinstance(result, (str, bytes, Mapping)):  # iterable, but not one value per sample
        raise RewardError(f"reward {name} returned {type(result).__name__} {_short(result)}, expected a list of "
                          f"{n} floats (one per sample)")
    try:
        values = list(result)
    except TypeError as e:
        raise RewardError(
            f"reward {name} returned {type(result).__name__}, expected a list of floats"
        ) from e
    if len(values) != n:
        raise RewardError(f"reward {name} returned {len(values)} values for {n} samples")
    rewards = []
    for i, value in enumerate(values):
        # numbers.Real covers int, float and numpy scalars; bool is excluded on purpose.
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward {name}: sample {offset + i} got {value!r} ({type(value).__name__}), "
                "expected a real number"
            )
        value = float(value)
        if not math.isfinite(value):
            raise RewardError(f"reward {name}: sample {offset + i} got non-finite value {value}")
        rewards.append(value)
    return rewards


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
