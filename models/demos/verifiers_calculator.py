"""The tool demo's task as a ``verifiers`` environment module, written as one for prime-rl's Environments
Hub is: ``load_environment()`` returns a ``ToolEnv`` with the calculator as a Python tool, its dataset
built locally (no hub), a ``Parser`` and a ``Rubric`` whose reward is the exact answer.
``rollout.environment=verifiers:models.demos.verifiers_calculator`` trains on it unchanged
(docs/multi_turn.md)."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

from models.demos.tool_tasks import SYSTEM, final_number, problems
from models.environments.tools import calculate


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (+, -, *, /, //, %, **, parentheses).

    Args:
        expression: The expression, e.g. 48213*9127.
    """
    return calculate(expression)


def exact_answer(completion, answer, **kwargs) -> float:
    """1 when the last assistant turn's last number is the answer."""
    last = [m for m in completion if m["role"] == "assistant"][-1]
    return float(final_number(str(last.get("content") or "")) == str(answer))


def load_environment(num_examples: int = 64, seed: int = 0, max_turns: int = 3) -> vf.Environment:
    rows = problems(num_examples, seed)
    dataset = Dataset.from_list([{"question": r["prompt"], "answer": r["answer"]} for r in rows])
    parser = vf.Parser()
    return vf.ToolEnv(dataset=dataset, tools=[calculator], system_prompt=SYSTEM, parser=parser,
                      rubric=vf.Rubric(funcs=[exact_answer], parser=parser), max_turns=max_turns)
