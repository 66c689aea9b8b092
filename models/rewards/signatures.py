"""How a reward function is called, read from its signature: this project's positional form or TRL's
keyword form, and the data columns and settings it takes.

Two forms are accepted (:func:`column_params` picks by the signature)::

    fn(prompts, responses, **columns) -> list[float]                    # positional (this project's)
    fn(completions, **kwargs) -> list[float | None]                     # keyword (TRL's GRPOTrainer)

A function is called in TRL's keyword form when it names a parameter ``completions`` or
``completion_ids``, or when it takes ``**kwargs`` and fewer than two positional parameters. It then
gets, by keyword, ``prompts`` and ``completions`` (message lists for conversational data:
``prompts[i]`` the row's conversation, ``completions[i] == [{"role": "assistant", "content": text}]``;
texts otherwise), ``completion_ids`` (the response's token ids) and every data column, as TRL's
``GRPOTrainer._calculate_rewards`` passes them; a ``None`` in its result means "no reward from this
function for this sample". TRL's trainer objects (``trainer_state``, ``log_extra``, ``log_metric``,
``environments``) are not passed: such a parameter needs a default. Any other function with two
positional parameters (or ``*args``) is called positionally with the prompt and response texts.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence

TRL_INPUTS = ("prompts", "completions", "completion_ids")
"""What TRL passes every reward function by keyword besides the data columns."""
TRL_TRAINER_ARGS = ("trainer_state", "log_extra", "log_metric", "environments")
"""TRL trainer objects a TRL reward function may take; this trainer has none to pass."""
FORMS = ("fn(prompts, responses, **columns) (positional: the prompt and response texts, then the data columns "
         "it names), or TRL's keyword form fn(completions, **kwargs) (a parameter named completions or "
         "completion_ids, or **kwargs with fewer than two positional parameters: prompts=, completions=, "
         "completion_ids= and every data column by keyword)")
"""The accepted forms, for errors."""


class RewardError(RuntimeError):
    """A reward source could not be resolved, raised, or returned an invalid result."""


class RewardSignatureError(RewardError):
    """A reward function cannot be called: its signature fits neither accepted form, or it requires
    what the data and the trainer do not give."""


class ColumnParams(NamedTuple):
    """What a reward function takes besides its prompts and responses (JSON-friendly: it crosses
    from the reward worker to the task)."""

    named: List[str]
    """Parameters (after the first two, in the positional form) that can be passed by keyword."""
    required: List[str]
    """Those of ``named`` without a default: the data must have such a column."""
    takes_all: bool
    """The function has ``**kwargs``: it is given every column."""
    keyword: bool = False
    """TRL's keyword form (see the module docstring); else the positional one."""


def column_params(fn: Any, name: str = "") -> ColumnParams:
    """How ``fn`` is called (positionally for a callable whose signature cannot be read); a
    :class:`RewardSignatureError` naming the accepted forms when its signature fits neither."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ColumnParams([], [], False)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params)
    var_args = any(p.kind == p.VAR_POSITIONAL for p in params)
    names = {p.name for p in by_name}
    if names & {"completions", "completion_ids"} or (takes_all and len(positional) < 2 and not var_args):
        stuck = [p.name for p in params if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
        if stuck:
            raise RewardSignatureError(f"reward {name or _name(fn)}{_sig(fn)}: TRL's keyword form passes everything "
                                       f"by keyword, but {stuck} are positional-only; accepted forms: {FORMS}")
        required = [p.name for p in by_name if p.name not in TRL_INPUTS and p.default is p.empty]
        return ColumnParams([p.name for p in by_name], required, takes_all, True)
    if len(positional) < 2 and not var_args:
        raise RewardSignatureError(f"reward {name or _name(fn)}{_sig(fn)} fits no accepted form: {FORMS}")
    rest = [p for p in by_name if p not in positional[:2]]
    return ColumnParams(named=[p.name for p in rest], required=[p.name for p in rest if p.default is p.empty],
                        takes_all=takes_all)


def _name(fn: Any) -> str:
    return repr(getattr(fn, "__qualname__", None) or type(fn).__qualname__)


def _sig(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return ""


def missing_inputs(params: ColumnParams, columns: Mapping[str, Any], options: Mapping[str, Any]) -> List[str]:
    """Required parameters that neither a column, a setting nor (keyword form) TRL's inputs fill."""
    given = set(columns) | set(options) | (set(TRL_INPUTS) if params.keyword else set())
    return [p for p in params.required if p not in given]


def columns_for(params: ColumnParams, columns: Optional[Mapping[str, Sequence[Any]]], name: str,
                options: Optional[Mapping[str, Any]] = None) -> Dict[str, list]:
    """The columns a function with ``params`` takes (all of them with ``**kwargs``). A required
    parameter that is neither a column nor one of ``options`` raises a :class:`RewardSignatureError`
    naming it and the columns there are (or, for TRL's trainer objects, that none is passed)."""
    columns, options = dict(columns or {}), dict(options or {})
    missing = missing_inputs(params, columns, options)
    trainer = [p for p in missing if p in TRL_TRAINER_ARGS]
    if trainer:
        raise RewardSignatureError(f"reward {name} requires {trainer}, TRL trainer object(s) this trainer does not "
                                   f"pass; give the parameter(s) a default (e.g. None)")
    if missing:
        raise RewardSignatureError(f"reward {name} takes {missing}, which the prompt data does not have as column(s) "
                                   f"(its columns: {sorted(columns)})")
    keep = columns if params.takes_all else {k: v for k, v in columns.items() if k in params.named}
    return {k: list(v) for k, v in keep.items()}


def options_for(params: ColumnParams, options: Optional[Mapping[str, Any]], columns: Mapping[str, Any]) -> dict:
    """The settings of ``options`` (e.g. ``format_pattern``) that a function names as parameters,
    unless a data column of that name takes the place."""
    return {k: v for k, v in (options or {}).items() if k in params.named and k not in columns}


def call_arguments(params: ColumnParams, prompts: Sequence[str], responses: Sequence[str],
                   columns: Mapping[str, list], messages: Optional[Sequence[Any]] = None,
                   completion_ids: Optional[Sequence[Sequence[int]]] = None) -> tuple:
    """``(args, kwargs)``: every value a list aligned with the samples (settings apart). Keyword form:
    ``prompts`` and ``completions`` as TRL gives them (conversations where every sample has its
    ``messages``), ``completion_ids`` (empty lists where unknown), the columns; each only if taken."""
    if not params.keyword:
        return [list(prompts), list(responses)], dict(columns)
    chat = messages is not None and len(messages) == len(prompts) and all(m is not None for m in messages)
    given = {**columns, "prompts": [list(m) for m in messages] if chat else list(prompts),
             "completions": [[{"role": "assistant", "content": r}] for r in responses] if chat else list(responses),
             "completion_ids": [list(c) for c in completion_ids] if completion_ids is not None
             else [[] for _ in responses]}
    return [], {k: v for k, v in given.items() if params.takes_all or k in params.named}
