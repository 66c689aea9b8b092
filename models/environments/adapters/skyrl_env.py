"""``skyrl:ENV_ID``: a SkyRL-Gym environment (``skyrl-gym``, the environments of NovaSky's SkyRL) built
by ``skyrl_gym.make(ENV_ID, env_config=..., extras=row)``. The row's columns are the environment's
``extras`` (``reward_spec: {ground_truth: ...}``, ``max_turns``, ``extra_info``, as SkyRL's datasets
hold them); ``init`` gets the row's ``prompt`` as a user message (after the row's ``system`` column).

- action: the assistant's text; the environment parses its own tool calls from it (SkyRL's tool
  groups, e.g. ``<tool><search>...</search></tool>``) and runs them in its ``step``;
- observation: ``step()``'s ``observations`` (chat messages) are appended as they are (a ``user`` or
  ``tool`` turn), rendered by the chat template;
- reward: ``step()``'s ``reward`` (per turn; the episode's is their sum); done: ``step()``'s ``done``.

Refused here: ``search`` and ``searchcode`` (a retrieval server at ``env_config.search_url``),
``text2sql`` (SQLite databases at ``env_config.db_path``), ``lcb`` (runs the model's code on this
machine outside any sandbox)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping

from models.environments.episodes import Environment, Step

REFUSED = {
    "search": "its search tool queries a retrieval server (env_config.search_url) this run does not start",
    "searchcode": "its search tool queries a retrieval server (env_config.search_url) this run does not start",
    "text2sql": "it runs queries against SQLite databases (env_config.db_path) that are not on this machine",
    "lcb": "it runs the model's code on this machine outside any sandbox (use the sandboxed Python tool)",
}
"""SkyRL-Gym's environments that need what a run here does not give, and why."""


def import_library() -> None:
    import skyrl_gym  # noqa: F401


def refuse(env_id: str) -> str:
    import skyrl_gym

    if env_id in REFUSED:
        return f"skyrl_gym {env_id!r}: {REFUSED[env_id]}"
    if ":" not in env_id and env_id not in skyrl_gym.registry:
        return f"skyrl_gym has no environment {env_id!r} (registered: {sorted(skyrl_gym.registry)})"
    return ""


class SkyRLEnvironment(Environment):
    env_id = ""
    env_config: Dict[str, Any] = {}

    def start(self) -> List[Dict[str, Any]]:
        import skyrl_gym

        extras = {k: v for k, v in self.row.items() if k not in ("prompt", "system")}
        extras.setdefault("extra_info", {})
        self.env = skyrl_gym.make(self.env_id, env_config=dict(self.env_config), extras=extras)
        system = [{"role": "system", "content": str(self.row["system"])}] if self.row.get("system") else []
        messages, _ = self.env.init(system + [{"role": "user", "content": str(self.row["prompt"])}])
        return [dict(m) for m in messages]

    def step(self, assistant: Dict[str, Any], tool_results: List[Dict[str, Any]]) -> Step:
        out = self.env.step(str(assistant.get("content") or ""))
        done = bool(out["done"])
        messages = [] if done else [dict(m) for m in out.get("observations") or []]
        return Step(messages=messages, reward=float(out.get("reward") or 0.0), done=done)

    def close(self) -> None:
        getattr(getattr(self, "env", None), "close", lambda: None)()


def factory(env_id: str) -> Callable[[Mapping[str, Any]], SkyRLEnvironment]:
    return type("SkyRLGymEnvironment", (SkyRLEnvironment,), {"env_id": env_id})
