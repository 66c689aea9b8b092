"""``verifiers:NAME``: a ``verifiers`` environment (prime-rl's; its Environments Hub modules) loaded by
``verifiers.load_environment(NAME)``, driven through its own multi-turn protocol while this project's
loop samples every turn token-exactly (verifiers' own ``rollout`` would send text to an OpenAI client and
re-tokenise the conversation each turn; here no sampled token is ever re-tokenised).

Per episode: ``init_state`` and ``setup_state`` on the row (its ``prompt`` as the user turn after the
environment's ``system_prompt`` and ``few_shot``, its ``answer``, ``info``, ``task`` and ``example_id``);
per assistant turn: the turn is added to the state's trajectory, the environment's stop conditions are
checked (``is_completed``: ``max_turns``, a ToolEnv's turn without tool calls, its own ``@vf.stop``s),
and if it goes on, ``get_prompt_messages`` gives the environment's answer (``env_response``: a ToolEnv's
tool results, a game's next turn) as the next turn's messages. At the end the rubric scores the rollout
(``score_rollout``; its parser reads the completion): ``state["reward"]`` is the episode's reward.

- tools: a ToolEnv's ``oai_tools`` go to the chat template; a call the model writes is passed to its
  ``env_response`` in OpenAI's form (``id``, ``arguments`` as JSON), which runs it;
- an episode this project cuts first (``rollout.max_turns``, ``max_episode_tokens``, a turn past
  ``max_new_tokens``) ends truncated and unscored (reward 0): keep ``rollout.max_turns`` at least the
  environment's ``max_turns``.

Refused here: environments whose loader fetches a dataset from the Hugging Face hub (it is loaded with the
hub offline first), sandboxes (``SandboxEnv``, ``PythonEnv``: Prime Intellect's remote containers),
CLI-agent and Harbor environments (containers), judges (``JudgeRubric``: an LLM over the OpenAI API),
``EnvGroup`` (several environments, one per task) and non-chat (``message_type="completion"``) ones."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from typing import Any, Callable, Dict, List, Mapping

from models.environments.episodes import Environment, Step

_LOOP: Dict[str, Any] = {}
_LOOP_LOCK = threading.Lock()


def import_library() -> None:
    import verifiers  # noqa: F401


def run(coro):
    """``coro``'s result, run on one event loop in a background thread (verifiers' methods are async, and
    objects they create may hold on to the loop they first ran on)."""
    with _LOOP_LOCK:
        if "loop" not in _LOOP:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="verifiers-loop", daemon=True).start()
            _LOOP["loop"] = loop
    return asyncio.run_coroutine_threadsafe(coro, _LOOP["loop"]).result()


@functools.lru_cache(maxsize=8)
def load(name: str):
    """The environment ``verifiers.load_environment(name)`` builds (once per process)."""
    import verifiers as vf

    return vf.load_environment(name)


def _unsupported(env) -> str:
    import verifiers as vf

    kinds = {"SandboxEnv": "runs its tools in Prime Intellect's remote sandboxes (containers)",
             "CliAgentEnv": "runs an agent in a container", "HarborEnv": "runs tasks in containers",
             "EnvGroup": "groups several environments (one per task); name one of them"}
    for cls in type(env).__mro__:
        if cls.__name__ in kinds:
            return f"its environment is a {cls.__name__}: it {kinds[cls.__name__]}"
    rubrics = [env.rubric] + list(getattr(env.rubric, "rubrics", []))
    if any(type(r).__name__ == "JudgeRubric" or isinstance(r, getattr(vf, "JudgeRubric", ())) for r in rubrics):
        return "its rubric is a JudgeRubric, which asks an LLM judge over the OpenAI API"
    if env.message_type != "chat":
        return "it is a completion (non-chat) environment; the episode loop renders chat turns"
    return ""


def refuse(name: str) -> str:
    """Why ``name`` cannot run here: not installed, its loader needs the hub, or it needs containers."""
    import importlib.util
    import os

    from models.environ import environment

    module = name.replace("-", "_").split("/")[-1]
    if importlib.util.find_spec(module) is None:
        return (f"no verifiers environment module {module!r} is installed (install its package, e.g. "
                f"`prime env install {name}` or `pip install` its wheel)")
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    try:
        with environment({k: os.environ.get(k, v) for k, v in offline.items()}):
            env = load(name)
    except Exception as err:
        return (f"verifiers.load_environment({name!r}) failed with the Hugging Face hub offline (it fetches a "
                f"dataset from the hub, which this run does not do): {type(err).__name__}: {err}")
    return _unsupported(env)


def openai_calls(assistant: Mapping[str, Any], turn: int) -> List[Dict[str, Any]]:
    """The turn's tool calls in OpenAI's form (``id``, ``arguments`` as JSON text), as verifiers reads them."""
    return [{"id": f"call_{turn}_{i}", "type": "function",
             "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
            for i, c in enumerate(assistant.get("tool_calls") or [])]


class VerifiersEnvironment(Environment):
    """One rollout of ``vf_env`` on a row; it runs its own tools (``runs_tools``)."""

    name = ""
    runs_tools = True

    def start(self) -> List[Dict[str, Any]]:
        self.vf_env = env = load(self.name)
        prompt = ([{"role": "system", "content": env.system_prompt}] if env.system_prompt else []) \
            + list(env.few_shot or []) + [{"role": "user", "content": str(self.row["prompt"])}]
        row = {"prompt": prompt, "example_id": int(self.row.get("example_id", 0)),
               "task": str(self.row.get("task") or env.env_id or "default"), "answer": str(self.row.get("answer", "")),
               "info": self.row.get("info") or {}}
        self.state = run(env.init_state(row, client=None, model="policy", sampling_args={}))
        self.state = run(env.setup_state(self.state))
        self.tool_schemas = list(self.state.get("oai_tools") or [])
        self.prompt = list(self.state["prompt"])
        return [dict(m) for m in self.prompt]

    def step(self, assistant: Dict[str, Any], tool_results: List[Dict[str, Any]]) -> Step:
        from verifiers.types import TrajectoryStep

        env, state = self.vf_env, self.state
        message = {"role": "assistant", "content": assistant.get("content") or ""}
        calls = openai_calls(assistant, len(state["trajectory"]))
        if calls:
            message["tool_calls"] = calls
        run(env.add_trajectory_step(state, TrajectoryStep(
            prompt=self.prompt, completion=[message], response=None, tokens=None, reward=None, advantage=None,
            is_truncated=False, trajectory_id=state["trajectory_id"], extras={})))
        if not run(env.is_completed(state)):
            before = self.prompt + [message]
            nxt = list(run(env.get_prompt_messages(state)))
            if state.get("final_env_response") is None:
                if nxt[:len(before)] != before:
                    raise ValueError(f"verifiers environment {self.name!r} rewrote earlier turns: episodes here "
                                     f"are token-exact, so each turn must extend the conversation")
                self.prompt = nxt
                return Step(messages=[dict(m) for m in nxt[len(before):]])
            run(env.is_completed(state))
        run(env.render_completion(state))
        run(env.rubric.score_rollout(state))
        return Step(reward=float(state["reward"] or 0.0), done=True)


def factory(name: str) -> Callable[[Mapping[str, Any]], VerifiersEnvironment]:
    reason = _unsupported(load(name))
    if reason:
        raise ValueError(f"verifiers environment {name!r}: {reason}")
    return type("VerifiersEnv", (VerifiersEnvironment,), {"name": name})
