"""``reasoning-gym`` as a task source: procedural prompts with answers, scored by the task's own
verifier (``data.source=reasoning_gym``; Stojanovski et al. 2025, "Reasoning Gym: Reasoning
Environments for Reinforcement Learning with Verifiable Rewards").

:func:`generate_rows` makes the prompt rows of one task: ``question`` (the prompt), ``answer``,
``metadata`` (JSON-able) and ``reasoning_gym``, the entry's address ``{task, seed, size, index,
options}``. :func:`reasoning_gym_reward` (``models.data.reasoning_gym:reasoning_gym_reward``) rebuilds
each sample's entry from that address (the generators are deterministic) and returns the task's
``score_answer(answer, entry)`` for the response's answer: the last ``<answer>...</answer>`` if the
response has one (reasoning-gym's own prompts ask for it), else the whole response, stripped.
"""

from __future__ import annotations

import difflib
import functools
import json
from typing import Any, Dict, List, Mapping, Sequence

TAG = "answer"
"""The tag reasoning-gym's system prompts ask the answer to be in."""


def _jsonable(value: Any) -> Any:
    """``value`` as JSON would give it back (tuples become lists, other objects their text)."""
    return json.loads(json.dumps(value, default=str))


def task_names() -> List[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


@functools.lru_cache(maxsize=16)
def _dataset(task: str, seed: int, size: int, options_json: str):
    import reasoning_gym

    names = task_names()
    if task not in names:
        close = difflib.get_close_matches(task, names, n=3)
        raise ValueError(f"reasoning-gym has no task {task!r}" + (f" (did you mean {close}?)" if close else "")
                         + f"; {len(names)} tasks, e.g. {names[:6]}")
    options = json.loads(options_json)
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **options)
    except (TypeError, ValueError, AssertionError) as err:
        raise ValueError(f"reasoning-gym task {task!r} refuses options {options}: {err}") from err


def dataset(task: str, seed: int, size: int, options: Mapping[str, Any] | None = None):
    """The task's procedural dataset (cached: the same arguments give the same entries)."""
    return _dataset(task, int(seed), int(size), json.dumps(dict(options or {}), sort_keys=True))


def generate_rows(task: str, size: int, seed: int, options: Mapping[str, Any] | None = None) -> List[Dict[str, Any]]:
    """``size`` prompt rows of ``task`` drawn with ``seed`` (see the module docstring)."""
    ds = dataset(task, seed, size, options)
    rows = []
    for index in range(size):
        entry = ds[index]
        rows.append({"question": entry["question"], "answer": _jsonable(entry["answer"]),
                     "metadata": _jsonable(entry.get("metadata", {})),
                     "reasoning_gym": {"task": task, "seed": int(seed), "size": int(size), "index": index,
                                       "options": dict(options or {})}})
    return rows


def extract_answer(response: str) -> str:
    """The last ``<answer>...</answer>`` of ``response``, else the whole response (stripped)."""
    from reasoning_gym.utils import extract_answer as tagged

    found = tagged(response, tag_name=TAG)
    return found if found is not None else response.strip()


def reasoning_gym_reward(prompts: Sequence[str], responses: Sequence[str], reasoning_gym: Sequence[Mapping[str, Any]],
                         answer: Sequence[Any]) -> List[float]:
    """The task's own ``score_answer`` for each response (in [0, 1]); the entry is rebuilt from the
    ``reasoning_gym`` column and must still have the row's ``answer`` (else reasoning-gym changed
    since the data was made, and the row would be judged against another question)."""
    out = []
    for response, ref, expected in zip(responses, reasoning_gym, answer):
        ds = dataset(ref["task"], ref["seed"], ref["size"], ref.get("options"))
        entry = ds[ref["index"]]
        if _jsonable(entry["answer"]) != expected:
            raise ValueError(f"reasoning-gym {ref['task']} entry {ref['index']} (seed {ref['seed']}) now has answer "
                             f"{entry['answer']!r}, the data has {expected!r}: was reasoning-gym's version changed?")
        out.append(float(ds.score_answer(extract_answer(response), entry)))
    return out
