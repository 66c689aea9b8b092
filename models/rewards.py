"""Reward sources: the plug-in interface, spec resolution and result validation.

A reward source scores finished samples: `source(prompts, responses) -> list[float]`,
one finite float per sample. Plain functions (e.g. `models.task:reverse_reward`), a
learned reward model and an HTTP reward client all implement the same `RewardSource`
protocol, so the `score` stage calls them the same way, always through
`compute_rewards`, which turns every kind of misbehaviour into a `RewardError` that
names the source and the offending sample.
"""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Protocol, Sequence, runtime_checkable


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


def _describe(fn: object, spec: str | None) -> str:
    if spec is not None:
        return repr(spec)
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return repr(f"{module}:{name}" if module else name)


def _first_failing_sample(
    fn: RewardSource, prompts: Sequence[str], responses: Sequence[str]
) -> int | None:
    """Index of the first sample that makes `fn` raise on its own (error path only)."""
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        try:
            fn([prompt], [response])
        except Exception:
            return i
    return None


def compute_rewards(
    fn: RewardSource,
    prompts: Sequence[str],
    responses: Sequence[str],
    spec: str | None = None,
) -> list[float]:
    """Call `fn` on the batch and validate its answer.

    Args:
        fn: the reward source.
        prompts, responses: texts of the batch, same length B.
        spec: how the source was named (e.g. "models.task:reverse_reward"), for errors;
            defaults to the function's module and qualified name.
    Returns:
        B finite Python floats. Shape: (B,).
    Raises:
        RewardError: `fn` raised (the batch is then re-scored one sample at a time to
            find the first sample at fault), returned a non-sequence or a sequence of the wrong
            length, or a value that is not a real number (bools included) or not finite.
            The message names the source and, where one is at fault, the sample index.
    """
    name = _describe(fn, spec)
    if len(prompts) != len(responses):
        raise RewardError(f"reward {name}: {len(prompts)} prompts but {len(responses)} responses")
    try:
        result = fn(list(prompts), list(responses))
    except Exception as e:
        where = _first_failing_sample(fn, prompts, responses)
        at = f" (first failing sample: {where})" if where is not None else ""
        raise RewardError(f"reward {name} raised on a batch of {len(prompts)}{at}: {e!r}") from e
    if hasattr(result, "tolist"):  # numpy arrays and torch tensors
        result = result.tolist()
    try:
        values = list(result)
    except TypeError as e:
        raise RewardError(
            f"reward {name} returned {type(result).__name__}, expected a list of floats"
        ) from e
    if len(values) != len(prompts):
        raise RewardError(f"reward {name} returned {len(values)} values for {len(prompts)} samples")
    rewards = []
    for i, value in enumerate(values):
        # numbers.Real covers int, float and numpy scalars; bool is excluded on purpose.
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward {name}: sample {i} got {value!r} ({type(value).__name__}), "
                "expected a real number"
            )
        value = float(value)
        if not math.isfinite(value):
            raise RewardError(f"reward {name}: sample {i} got non-finite value {value}")
        rewards.append(value)
    return rewards
