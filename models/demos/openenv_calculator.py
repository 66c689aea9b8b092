"""The tool demo's task written as an OpenEnv environment (``openenv-core``), as someone would write it
for TRL or SkyRL: an ``MCPEnvironment`` whose calculator is an MCP tool (FastMCP), and a typed action
for the answer. ``rollout.environment=openenv:models.demos.openenv_calculator:CalculatorEnvironment``
trains on it unchanged (docs/multi_turn.md); the tests run it offline, in this process."""

from __future__ import annotations

from typing import Any, Optional
from uuid import uuid4

from fastmcp import FastMCP
from pydantic import Field

from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State

from models.demos.tool_tasks import SYSTEM, final_number
from models.environments.tools import calculate


class AnswerAction(Action):
    """The assistant's final answer."""

    message: str = Field(..., description="The answer, as the assistant wrote it")


class QuestionObservation(Observation):
    """The question (after a reset) or the verdict (after an answer)."""

    text: str = Field(default="", description="What the agent reads")


class CalculatorEnvironment(MCPEnvironment):
    """One product question per episode; the ``calculator`` MCP tool; reward 1 for the exact answer."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("calculator")

        @mcp.tool()
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression exactly (+, -, *, /, //, %, **, parentheses)."""
            return calculate(expression)

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.answer = ""

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, prompt: str = "",
              answer: str = "", **kwargs: Any) -> QuestionObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.answer = str(answer)
        return QuestionObservation(text=f"{SYSTEM}\n{prompt}")

    def _step_impl(self, action: AnswerAction, timeout_s: Optional[float] = None, **kwargs: Any) -> QuestionObservation:
        self._state.step_count += 1
        correct = final_number(action.message) == self.answer
        return QuestionObservation(text="correct" if correct else "wrong", done=True, reward=float(correct))

    @property
    def state(self) -> State:
        return self._state
