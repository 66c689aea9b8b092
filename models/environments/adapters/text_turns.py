"""What the text-game adapters share: a game that takes the assistant's text as its action and answers
with an observation, a reward and whether it is over, as the episode loop's :class:`Environment`.

- the first observation is the first user turn (after the row's ``system`` column as a system turn,
  when it has one); every later observation is the next user turn, rendered by the chat template;
- the action is the assistant turn's text as the model wrote it (its content; a tool call the model
  wrote is part of neither: these games have no tools), parsed by the game itself;
- each step's reward is that turn's reward (an episode's reward is their sum), and the game's end
  (terminated or truncated) ends the episode (``is_end``), its observation then not shown;
- one game per row, the same for every sample of the row (a group plays the same game): its seed is
  the row's ``seed`` column, else a hash of its ``prompt``. Some libraries' games draw from Python's
  global ``random`` (textarena seeds it itself, gem's do not): it is seeded with the episode's seed
  under a lock, as the game starts.
"""

from __future__ import annotations

import random
import threading
import zlib
from typing import Any, Dict, List, Mapping, Tuple

from models.environments.episodes import Environment, Step

_GLOBAL_RANDOM = threading.Lock()
"""Held while a game seeds and draws from the global ``random`` module at its start."""


def row_seed(row: Mapping[str, Any]) -> int:
    """The row's ``seed`` column, else a stable hash of its ``prompt`` (the same for every sample of a row)."""
    if row.get("seed") is not None:
        return int(row["seed"])
    return zlib.crc32(str(row.get("prompt", "")).encode()) & 0x7FFFFFFF


def seeded(seed: int, start):
    """``start()`` with the global ``random`` (and numpy's) seeded with ``seed``, under a lock."""
    with _GLOBAL_RANDOM:
        random.seed(seed)
        try:
            import numpy as np

            np.random.seed(seed)
        except ImportError:  # pragma: no cover - numpy is a dependency
            pass
        return start()


def as_text(observation: Any) -> str:
    """An observation as the user turn's text: a string as it is, messages' contents joined, else ``str``."""
    if isinstance(observation, str):
        return observation
    if isinstance(observation, (list, tuple)) and all(isinstance(m, Mapping) for m in observation):
        return "\n".join(str(m.get("content", "")) for m in observation)
    return str(observation)


class TextGame(Environment):
    """Subclass with :meth:`reset` (the first observation) and :meth:`act` (one action's outcome)."""

    def __init__(self, row: Mapping[str, Any]):
        super().__init__(row)
        self.seed = row_seed(self.row)
        self.rewards: List[float] = []

    def reset(self) -> Any:
        """Start the game; its first observation."""
        raise NotImplementedError

    def act(self, action: str) -> Tuple[Any, float, bool]:
        """The game's answer to ``action``: (observation, reward, over)."""
        raise NotImplementedError

    def system(self) -> List[Dict[str, Any]]:
        return [{"role": "system", "content": str(self.row["system"])}] if self.row.get("system") else []

    def start(self) -> List[Dict[str, Any]]:
        return self.system() + [{"role": "user", "content": as_text(self.reset())}]

    def step(self, assistant: Dict[str, Any], tool_results: List[Dict[str, Any]]) -> Step:
        observation, reward, over = self.act(str(assistant.get("content") or ""))
        self.rewards.append(float(reward or 0.0))
        if over:
            return Step(reward=float(reward or 0.0), done=True)
        return Step(messages=[{"role": "user", "content": as_text(observation)}], reward=float(reward or 0.0))
