"""The tool-use task: products of numbers too long to multiply in one's head (4–5 digit factors,
up to 10-digit results), with the calculator available. An environment (``rollout.environment=
models.demos.tool_tasks:ArithmeticEnv``), its data and the demonstrations of the warm start."""

from __future__ import annotations

import json
import random
import re
from typing import Any, Dict, List, Mapping

from models.environments.episodes import Environment, Step
from models.environments.tools import CALCULATOR

SYSTEM = "Use the calculator for arithmetic. Answer with the number only."


def problem(rng: random.Random) -> Dict[str, str]:
    """A row: ``prompt`` (the question) and ``answer`` (exact)."""
    a, b = rng.randint(1000, 99999), rng.randint(1000, 99999)
    # The question writes the expression as the tool call does, so the call is a token-by-token copy.
    # Products only: with sums mixed in, the demo's model never learned to copy the operator (its
    # probability stayed at 0.49 for the right one after 1000 steps; docs/multi_turn.md).
    return {"prompt": f"What is {a}*{b}?", "expression": f"{a}*{b}", "answer": str(a * b)}


def problems(n: int, seed: int) -> List[Dict[str, str]]:
    rng = random.Random(seed)
    return [problem(rng) for _ in range(n)]


def final_number(text: str) -> str:
    """The last integer in ``text`` (the answer the model gave), or ''."""
    found = re.findall(r"-?\d+", text or "")
    return found[-1] if found else ""


class ArithmeticEnv(Environment):
    """One question; the calculator as a tool; reward 1 when the final answer (a turn without a tool
    call) is the exact result, else 0. The episode ends at the first turn without a tool call."""

    tools = (CALCULATOR,)

    def start(self) -> List[Dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(self.row["prompt"])}]

    def step(self, assistant: Dict[str, Any], tool_results: List[Dict[str, Any]]) -> Step:
        if tool_results:
            return Step()
        correct = final_number(assistant.get("content", "")) == str(self.row["answer"])
        return Step(reward=float(correct), done=True)


def demonstration(row: Mapping[str, str], use_tool: bool = True) -> List[Dict[str, Any]]:
    """The conversation an expert has: one calculator call, then the result as the answer; with
    ``use_tool=False`` the answer straight away, "The answer is N." (right, but from a memory a small
    model does not have): its first token differs from the tool-using turn's, so the choice to call
    the tool is one token the model samples."""
    start = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
    if not use_tool:
        return start + [{"role": "assistant", "content": f"The answer is {row['answer']}."}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": row["expression"]}}}
    return start + [{"role": "assistant", "content": "Let me calculate.", "tool_calls": [call]},
                    {"role": "tool", "name": "calculator", "content": row["answer"]},
                    {"role": "assistant", "content": row["answer"]}]


def used_calculator_correctly(episode_json: str, expression: str) -> bool:
    """Whether an episode (the batch's ``episode`` column) called the calculator on the question's
    expression (spaces ignored) and got a result back without error."""
    messages = json.loads(episode_json)
    for m, nxt in zip(messages, messages[1:]):
        for call in m.get("tool_calls") or []:
            expr = str(call["function"]["arguments"].get("expression", "")).replace(" ", "")
            if expr == expression and nxt.get("role") == "tool" and not nxt["content"].startswith("error"):
                return True
    return False


def called_tool_correctly(prompts, responses, episode=None, expression=None) -> List[float]:
    """Metric as a reward function (weight 0 in ``configs/tiny_tools.yaml``): 1 where the episode
    called the calculator on the question's expression and got its result (``reward/`` and
    ``eval/called_tool_correctly_mean``)."""
    if episode is None or expression is None:
        raise ValueError("called_tool_correctly needs episodes (rollout.environment) and an 'expression' column")
    return [float(used_calculator_correctly(e, x)) for e, x in zip(episode, expression)]
