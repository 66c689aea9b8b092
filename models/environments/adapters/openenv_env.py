"""``openenv:module:Class`` (an OpenEnv environment run in this process) and ``openenv:http://host:port``
(an OpenEnv server someone started, over its WebSocket session API): ``openenv-core`` (Meta's OpenEnv,
which TRL and SkyRL train on).

- start: ``reset(seed=..., **row)``, the row's columns passed where ``reset`` takes them (a server
  filters them by its own signature); the observation is the first user turn;
- action: the assistant's text as the environment's action class, in its one text field (the class is
  the type of ``step``'s ``action``, or of ``_step_impl``'s for an ``MCPEnvironment``; a server's comes
  from its ``/schema``);
- tools: an ``MCPEnvironment``'s MCP tools (``ListToolsAction``) are the episode's tools: their schemas go
  to the chat template, and a call the model writes is a ``CallToolAction`` whose result (or error) is the
  ``tool`` turn; a turn without a call is the action;
- observation: the observation's own fields (not ``done``, ``reward``, ``metadata``): its one text field,
  else the fields as JSON; reward: the observation's ``reward`` (None: 0); done: its ``done``.

Refused: ``from_docker_image`` / ``from_env`` environments (containers, Hub Spaces): start the server and
name its URL."""

from __future__ import annotations

import json
import typing
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from models.environments.adapters.text_turns import row_seed
from models.environments.episodes import Environment, Step
from models.environments.tools import Tool

BASE_FIELDS = ("done", "reward", "metadata")


def import_library() -> None:
    import openenv.core  # noqa: F401


def text_field(schema: Mapping[str, Any], what: str) -> str:
    """The one string field of an action's JSON schema (required ones first)."""
    props = schema.get("properties", {})
    strings = [k for k, v in props.items() if v.get("type") == "string" and k not in ("type",)]
    required = [k for k in strings if k in schema.get("required", ())]
    pick = required or strings
    if len(pick) != 1:
        raise ValueError(f"{what}: the action has {len(pick)} text fields ({pick}); the assistant's text fills one")
    return pick[0]


def observation_text(fields: Mapping[str, Any]) -> str:
    own = {k: v for k, v in fields.items() if k not in BASE_FIELDS}
    strings = [v for v in own.values() if isinstance(v, str)]
    return strings[0] if len(own) == 1 and strings else json.dumps(own, default=str, ensure_ascii=False)


def action_class(cls: type):
    """The ``Action`` subclass ``cls``'s ``step`` (or ``_step_impl``) takes."""
    from openenv.core.env_server.types import Action

    for name in ("_step_impl", "step"):
        fn = getattr(cls, name, None)
        hint = typing.get_type_hints(fn).get("action") if fn else None
        if isinstance(hint, type) and issubclass(hint, Action) and hint is not Action:
            return hint
    raise ValueError(f"{cls.__name__}.step's action is not annotated with an Action subclass: the adapter "
                     f"cannot tell which action carries the assistant's text")


def _kwargs_for(fn, row: Mapping[str, Any]) -> Dict[str, Any]:
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return dict(row)
    return {k: v for k, v in row.items() if k in params}


def _result_text(obs) -> str:
    if obs.error is not None:
        raise RuntimeError(obs.error.message)
    result = obs.result
    data = getattr(result, "data", None)
    if data is not None:
        return str(data)
    content = getattr(result, "content", None)
    if content:
        return "\n".join(str(getattr(c, "text", c)) for c in content)
    return str(result)


class InProcess(Environment):
    """An OpenEnv ``Environment`` class built per episode."""

    env_cls: type = object

    def __init__(self, row: Mapping[str, Any]):
        super().__init__(row)
        self.env = self.env_cls()
        self.action_cls = action_class(self.env_cls)
        self.field = text_field(self.action_cls.model_json_schema(), self.env_cls.__name__)
        self.tools = self._mcp_tools()

    def _mcp_tools(self) -> Tuple[Tool, ...]:
        from openenv.core.env_server.mcp_environment import MCPEnvironment
        from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

        if not isinstance(self.env, MCPEnvironment):
            return ()

        def caller(name):
            return lambda **arguments: _result_text(self.env.step(CallToolAction(tool_name=name, arguments=arguments)))

        return tuple(Tool(t.name, t.description, t.input_schema, caller(t.name))
                     for t in self.env.step(ListToolsAction()).tools)

    def start(self) -> List[Dict[str, Any]]:
        row = {k: v for k, v in self.row.items() if k != "seed"}
        obs = self.env.reset(seed=row_seed(self.row), **_kwargs_for(self.env.reset, row))
        return [{"role": "user", "content": observation_text(obs.model_dump())}]

    def step(self, assistant: Dict[str, Any], tool_results: List[Dict[str, Any]]) -> Step:
        if tool_results:
            return Step()  # the model reads the tools' results on its next turn
        obs = self.env.step(self.action_cls(**{self.field: str(assistant.get("content") or "")}))
        return _step(obs.model_dump())

    def close(self) -> None:
        self.env.close()


def _step(fields: Mapping[str, Any], reward: Optional[float] = None, done: Optional[bool] = None) -> Step:
    reward = fields.get("reward") if reward is None else reward
    done = bool(fields.get("done")) if done is None else done
    messages = [] if done else [{"role": "user", "content": observation_text(fields)}]
    return Step(messages=messages, reward=float(reward or 0.0), done=done)


class Remote(Environment):
    """An episode on an OpenEnv server: one WebSocket session (``GenericEnvClient``)."""

    url = ""
    field = ""

    def start(self) -> List[Dict[str, Any]]:
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(base_url=self.url).connect()
        row = {k: v for k, v in self.row.items() if k != "seed"}
        result = self.client.reset(seed=row_seed(self.row), **row)
        return [{"role": "user", "content": observation_text(result.observation)}]

    def step(self, assistant: Dict[str, Any], tool_results: List[Dict[str, Any]]) -> Step:
        result = self.client.step({self.field: str(assistant.get("content") or "")})
        return _step(result.observation, result.reward, bool(result.done))

    def close(self) -> None:
        self.client.close()


def _server_schema(url: str) -> Dict[str, Any]:
    import httpx

    response = httpx.get(url.rstrip("/") + "/schema", timeout=10.0)
    response.raise_for_status()
    return response.json()["action"]


def refuse(rest: str) -> str:
    if rest.startswith(("http://", "https://")):
        try:
            _server_schema(rest)
        except Exception as err:
            return f"the OpenEnv server at {rest} does not answer GET /schema ({type(err).__name__}: {err})"
    return ""


def factory(rest: str) -> Callable[[Mapping[str, Any]], Environment]:
    from models.environments.adapters import import_object

    if rest.startswith(("http://", "https://")):
        field = text_field(_server_schema(rest), rest)
        return type("OpenEnvRemote", (Remote,), {"url": rest, "field": field})
    cls = import_object(rest, "rollout.environment=openenv:...")
    action_class(cls)
    return type("OpenEnvEnvironment", (InProcess,), {"env_cls": cls})
