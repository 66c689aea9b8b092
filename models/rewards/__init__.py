"""Reward functions: the plug-in interface, spec resolution (factories included), and result validation.

A reward function scores finished samples. Two forms are accepted, picked by its signature
(:mod:`models.rewards.signatures`): this project's positional one::

    fn(prompts: list[str], responses: list[str], **columns) -> list[float]

and TRL's keyword one (``GRPOTrainer``'s: ``trl.rewards.accuracy_reward`` works as it is)::

    fn(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]

``columns`` are the prompt row's other data columns (e.g. ``answer``, ``solution``), each a list
aligned with the samples. A positional function takes the columns it names as parameters, or all
of them with ``**kwargs``; the two-argument form ``fn(prompts, responses)`` takes none. Plain
functions (e.g. ``models.demos.reverse_task:reverse_reward``), a learned reward model and an HTTP reward client
all score the same samples; functions are called through :func:`compute_rewards`, which turns
every kind of misbehaviour into a :class:`RewardError` that names the function and the sample.
"""

from __future__ import annotations

import ast
import importlib
import math
import numbers
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple, runtime_checkable

from models.rewards.signatures import (ColumnParams, RewardError, RewardSignatureError, call_arguments,  # noqa: F401
                                      column_params, columns_for, options_for)


@runtime_checkable
class RewardSource(Protocol):
    """Anything that scores a batch of (prompt, response) texts."""

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Return one reward per sample, in order; `len(result) == len(prompts)`."""
        ...


class RewardSpec(NamedTuple):
    """A reward function as the config names it: ``module:attr``, or ``module:factory(args)``."""

    module: str
    attr: str
    """The attribute path in ``module`` (may be dotted: ``Class.method``)."""
    args: tuple = ()
    """Literal positional arguments of the factory call (with ``call``)."""
    kwargs: Dict[str, Any] = {}
    """Literal keyword arguments of the factory call (with ``call``)."""
    call: bool = False
    """``attr`` is a factory: the reward function is ``attr(*args, **kwargs)``."""

    @property
    def name(self) -> str:
        """The function's (or factory's) own name, e.g. ``accuracy_reward``."""
        return self.attr.split(".")[-1]


SPEC_FORMS = "'package.module:function' or 'package.module:factory(key=value, ...)'"


MOVED_MODULES = {
    "models.task": "models.demos.reverse_task",
    "models.verifiers": "models.rewards.verifiers",
    "models.reasoning_gym_tasks": "models.data.reasoning_gym",
    "models.episode_rollout": "models.environments.episode_rollout",
    "models.tool_tasks": "models.demos.tool_tasks",
    "models.rewards": "models.rewards",
}
"""Modules a spec may still name by their path before ``models/`` was grouped by concept (2026-11-25),
and where they are now: a config written then keeps working. Removal: no preset or code of the project names
an old path; remove the table (keeping ``models.rewards``) once no run started before 2026-11-25 is resumed or
retrained any more, and at the latest with the first release after 2027-05-25, naming the old paths in that
release's notes."""


def parse_spec(spec: str) -> RewardSpec:
    """``"package.module:function"`` (the attribute may be dotted), or a factory called with Python
    literals, ``"trl.rewards:get_soft_overlong_punishment(max_completion_len=256, soft_punish_cache=32)"``;
    a :class:`RewardError` naming the accepted forms otherwise."""
    if not isinstance(spec, str):
        raise RewardError(f"reward spec must look like {SPEC_FORMS}, got {spec!r}")
    head, call = spec, ""
    if spec.rstrip().endswith(")") and "(" in spec:
        head, call = spec[:spec.index("(")], spec[spec.index("("):].strip()
    if "(" in head or ")" in head:
        raise RewardError(f"reward spec {spec!r}: a factory's arguments go in one pair of parentheses at the end, "
                          f"{SPEC_FORMS}; in a YAML flow list ([...]) quote the spec, or its commas split it")
    parts = [part.strip() for part in head.split(":")]
    if len(parts) != 2 or not all(parts):
        raise RewardError(f"reward spec must look like {SPEC_FORMS}, got {spec!r}")
    parts[0] = MOVED_MODULES.get(parts[0], parts[0])
    if not call:
        return RewardSpec(*parts)
    args, kwargs = _literal_call(spec, call)
    return RewardSpec(parts[0], parts[1], args, kwargs, True)


def _literal_call(spec: str, call: str) -> Tuple[tuple, Dict[str, Any]]:
    """The literal arguments of ``call`` (``"(a=1, b='x')"``)."""
    try:
        node = ast.parse("f" + call, mode="eval").body
    except SyntaxError as err:
        raise RewardError(f"reward spec {spec!r}: the factory arguments {call} do not parse ({err.msg}); "
                          f"write {SPEC_FORMS}") from None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or any(k.arg is None for k in node.keywords):
        raise RewardError(f"reward spec {spec!r}: write the factory's arguments as {SPEC_FORMS}")
    try:
        return (tuple(ast.literal_eval(a) for a in node.args),
                {k.arg: ast.literal_eval(k.value) for k in node.keywords})
    except ValueError:
        raise RewardError(f"reward spec {spec!r}: factory arguments must be Python literals (numbers, strings, "
                          f"True/False/None, lists, dicts)") from None


def resolve_reward_fn(spec: str) -> RewardSource:
    """Import the callable ``spec`` names (:func:`parse_spec`); for a factory, the reward function it
    returns. Raises `RewardError` for a malformed spec, a module that cannot be imported, a missing
    attribute, a factory that raises, or a result that is not callable."""
    parsed = parse_spec(spec)
    try:
        obj = importlib.import_module(parsed.module)
    except ImportError as e:
        raise RewardError(f"reward spec {spec!r}: cannot import module {parsed.module!r}: {e}") from e
    for name in parsed.attr.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError as e:
            raise RewardError(
                f"reward spec {spec!r}: module {parsed.module!r} has no attribute {parsed.attr!r}"
            ) from e
    if parsed.call and callable(obj):
        try:
            obj = obj(*parsed.args, **parsed.kwargs)
        except Exception as e:
            raise RewardError(f"reward spec {spec!r}: the factory {parsed.attr} raised {e!r}") from e
        if not callable(obj):
            raise RewardError(f"reward spec {spec!r}: the factory {parsed.attr} returned a {type(obj).__name__}, "
                              f"not a reward function")
    if not callable(obj):
        raise RewardError(
            f"reward spec {spec!r}: {parsed.attr!r} is a {type(obj).__name__}, not callable"
        )
    return obj


def _describe(fn: object, spec: str | None) -> str:
    if spec is not None:
        return repr(spec)
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return repr(f"{module}:{name}" if module else name)


def _first_failing_sample(fn: RewardSource, args: Sequence[list], kwargs: Mapping[str, list],
                          settings: Mapping[str, Any], n: int) -> int | None:
    """Index of the first sample that makes `fn` raise on its own (error path only)."""
    for i in range(n):
        try:
            fn(*[a[i:i + 1] for a in args], **{k: v[i:i + 1] for k, v in kwargs.items()}, **settings)
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
    messages: Optional[Sequence[Any]] = None,
    completion_ids: Optional[Sequence[Sequence[int]]] = None,
) -> List[Optional[float]]:
    """Call `fn` in its form (:mod:`models.rewards.signatures`) on the batch and validate its answer.

    Args:
        fn: the reward function.
        prompts, responses: texts of the batch, same length B.
        spec: how the function was named (e.g. "models.demos.reverse_task:reverse_reward"), for errors;
            defaults to the function's module and qualified name.
        columns: the prompt rows' other columns, ``{name: [B] values}``; `fn` is given those it
            takes (:func:`columns_for`).
        options: settings from the config (e.g. ``format_pattern``), given as they are to a
            function that names them as parameters.
        offset: index of the first sample in the whole batch (errors name batch indices).
        messages: per sample, the conversation its prompt was rendered from (None for text
            prompts): TRL's keyword form gets ``prompts`` and ``completions`` as messages then.
        completion_ids: per sample, the response's token ids (TRL's ``completion_ids``).
    Returns:
        B finite Python floats; a TRL keyword-form function may also give None ("no reward
        from this function for this sample"). Shape: (B,).
    Raises:
        RewardError: `fn` raised (the batch is then re-scored one sample at a time to
            find the first sample at fault), returned a non-sequence, a string or mapping, a
            sequence of the wrong length, or a value that is not a real number (bools included)
            or not finite; or `fn` takes a column the data lacks, or fits no accepted form. The
            message names the function and, where one is at fault, the sample index.
    """
    name = _describe(fn, spec)
    if len(prompts) != len(responses):
        raise RewardError(f"reward {name}: {len(prompts)} prompts but {len(responses)} responses")
    params = column_params(fn, name)
    kwargs = columns_for(params, columns, name, options)
    settings = options_for(params, options, kwargs)
    bad_len = {k: len(v) for k, v in kwargs.items() if len(v) != len(prompts)}
    if bad_len:
        raise RewardError(f"reward {name}: column lengths {bad_len} differ from the {len(prompts)} samples")
    args, kwargs = call_arguments(params, prompts, responses, kwargs, messages, completion_ids)
    try:
        result = fn(*args, **kwargs, **settings)
    except Exception as e:
        where = _first_failing_sample(fn, args, kwargs, settings, len(prompts))
        at = f" (first failing sample: {offset + where})" if where is not None else ""
        span = f"a batch of {len(prompts)}" if not offset else f"samples {offset}-{offset + len(prompts) - 1}"
        raise RewardError(f"reward {name} raised on {span}{at}: {e!r}") from e
    return _check_values(result, len(prompts), name, offset, allow_none=params.keyword)


def _check_values(result: Any, n: int, name: str, offset: int = 0,
                  allow_none: bool = False) -> List[Optional[float]]:
    """``result`` as ``n`` finite floats (or None where ``allow_none``), else a :class:`RewardError`
    that names the real cause."""
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
        if value is None and allow_none:
            rewards.append(None)
            continue
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
