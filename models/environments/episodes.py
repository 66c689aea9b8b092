"""Multi-turn episodes: the environment protocol and the two loops that run a batch's episodes.

- **Per episode** (``rollout.episode_pace=episode``; ``auto`` where the engine streams: vLLM in the task's or
  the service's process): each episode is its own stream of requests to vLLM's continuously batching engine
  (:meth:`models.engines.VLLMEngine.stream`). A turn that ends leaves the engine at once; its tool calls and
  its environment's step run in a thread of their own while the other episodes' turns go on generating, and
  the episode's next turn joins the engine as soon as the step has answered. A batch takes as long as its
  longest episode, not the sum of each turn's slowest one.
- **Lockstep** (``lockstep``; ``auto`` on engines that do not stream: the HF engine, the rollout server,
  replicas, the colocated ranks): ONE batched generate call per turn for every active episode; the turn's
  tool calls run concurrently, then each environment steps.

Both seed the turn ``t`` of episode ``k`` with ``sample_seed(stream_seed(seed, t), k, 0)`` as long as every
episode is still active (lockstep seeds by position among the active episodes), so with equal turn counts the
two give the same tokens (:func:`stream_seed`, :func:`models.engines.base.sample_seed`).

An environment (``rollout.environment=module:Class``) is built from one dataset row (its columns as
a dict, plus ``prompt``), gives the first messages (:meth:`Environment.start`) and its tools
(:attr:`Environment.tools`), and answers each assistant turn (:meth:`Environment.step`, given the
parsed message and the results of its tool calls) with more messages, a reward and whether the
episode is done. Per turn (lockstep; per episode the same, one episode at a time):

1. every active episode's ids (first prompt + everything since) go to the engine in one call;
   generation stops at the template's end-of-turn (every eos id) or at the end of a tool call
   (``</tool_call>``, as a stop token when the tokenizer has it as one, else a stop string), and the
   stop token is kept, with its log-prob, as the trainer scores it;
2. the turn is parsed (content, tool calls); the calls of all episodes run concurrently in a thread
   pool, each with ``tool_timeout_s``; errors are ``tool`` messages the model reads;
3. the environment answers; the new messages are appended as token ids
   (:class:`models.environments.chat_tokens.ChatTokens`), the sampled ones kept as sampled.

An episode ends when the environment says done, or truncated (``is_end = False``): a turn that hit
``max_new_tokens``, ``max_turns`` turns, or ``max_episode_tokens`` tokens after the first prompt.
Its row: ``response_tokens`` = everything after the first prompt, ``loss_mask`` 1 on sampled tokens
and 0 on template, tool and user tokens, sampler log-probs on sampled tokens (0 elsewhere).
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Sequence

from models.environments.chat_tokens import ChatTokens
from models.environments.episode_loop import EpisodeLoop, Group
from models.environments.episode_turns import Episode, EpisodeLimits, _record, _take_turn, _tool_messages
from models.engines.base import SamplingSpec, stream_seed
from models.environments.tools import Tool, ToolCallParser, run_tool_calls, tools_by_name


@dataclass
class Step:
    """An environment's answer to one assistant turn."""

    messages: List[Dict[str, Any]] = field(default_factory=list)
    """Messages after the tool results (e.g. a user turn); rendered by the chat template."""
    reward: float = 0.0
    """This turn's reward; an episode's reward is the sum over its turns."""
    done: bool = False


class Environment:
    """Base class of environments (subclass it, or implement the same three members).

    ``row``: the dataset row's columns (e.g. ``{"prompt": ..., "answer": "42"}``)."""

    tools: Sequence[Tool] = ()
    """Tools the model may call; their schemas go to the chat template (``tools=``)."""
    runs_tools = False
    """True: the environment runs the calls itself (an adapter of a library that does, e.g. ``verifiers``):
    the loop gives ``step`` the turn with its calls and no results, and shows the ``tool`` messages ``step``
    returns; the schemas for the template are then ``tool_schemas`` (set by ``start``)."""

    def __init__(self, row: Mapping[str, Any]):
        self.row = dict(row)

    def start(self) -> List[Dict[str, Any]]:
        """The first messages (system and user turns), before the first assistant turn."""
        return [{"role": "user", "content": str(self.row["prompt"])}]

    def step(self, assistant: Dict[str, Any], tool_results: List[Dict[str, Any]]) -> Step:
        """Answer an assistant turn (``{"role": "assistant", "content", "tool_calls"}``) whose calls gave
        ``tool_results`` (``tool`` messages). Default: done when the turn called no tool, reward 0."""
        return Step(done=not tool_results)


def load_environment(spec: str):
    """What builds an environment from a row: the class ``module:Class`` names, or an adapter's for another
    library's environment (``verifiers:NAME``, ``textarena:ENV_ID``, ...: :mod:`models.environments.adapters`)."""
    from models.environments.adapters import environment_factory

    return environment_factory(spec)


def tool_schemas(env) -> List[Dict[str, Any]]:
    """The schemas of ``env``'s tools for the chat template (an environment that runs its own: ``tool_schemas``)."""
    if getattr(env, "runs_tools", False):
        return list(getattr(env, "tool_schemas", None) or [])
    return [t.schema() for t in getattr(env, "tools", ())]  # a class of its own may have none


def turn_stops(tokenizer, parser: ToolCallParser, spec: SamplingSpec) -> SamplingSpec:
    """``spec`` plus the parser's end-of-call text: a stop token when it is one token of the vocabulary
    (kept in the output with its log-prob by both engines), else a stop string."""
    ids, strings = list(spec.stop_token_ids), list(spec.stop_strings)
    for text in parser.stop_strings:
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        (ids.extend(encoded) if len(encoded) == 1 else strings.append(text))
    return replace(spec, n=1, stop_token_ids=tuple(sorted(set(ids))), stop_strings=tuple(dict.fromkeys(strings)))


PACES = ("auto", "episode", "lockstep")


def streams(engine) -> bool:
    """Whether ``engine`` runs each episode as its own stream of requests (an in-process vLLM engine)."""
    return all(callable(getattr(engine, m, None)) for m in ("stream", "stream_samples", "stream_step", "stream_open",
                                                                 "close_stream"))


def per_episode(engine, limits: EpisodeLimits) -> bool:
    """Whether ``limits.pace`` runs episodes on ``engine`` each at its own pace (the module's docstring); ``episode``
    on an engine that does not stream is refused."""
    if limits.pace not in PACES:
        raise ValueError(f"rollout.episode_pace={limits.pace!r}: one of {', '.join(PACES)}")
    if limits.pace == "episode" and not streams(engine):
        raise ValueError(f"rollout.episode_pace=episode needs an engine that streams requests (vLLM in this process), "
                         f"not {type(engine).__name__}: set rollout.episode_pace=lockstep or auto")
    return limits.pace == "episode" or (limits.pace == "auto" and streams(engine))


def run_episodes(engine, tokenizer, envs: Sequence[Any], spec: SamplingSpec, limits: EpisodeLimits,
                 parser: ToolCallParser, pool: ThreadPoolExecutor, first_index: int = 0) -> List[Episode]:
    """Run one episode per environment, per episode or in lockstep (``limits.pace``, the module's docstring); turn
    ``t`` of episode ``k`` is seeded from ``stream_seed(spec.seed, t)``. ``first_index``: the position of ``envs[0]``
    in the whole batch (an asynchronous run samples a batch a few prompts at a time), added to every episode's
    (per episode) or active position's (lockstep) index in its seeds, so the episodes are those of the whole batch."""
    group = start_group(envs, tokenizer, spec, limits, parser, first_index)
    if per_episode(engine, limits):
        loop = EpisodeLoop(engine, tokenizer, parser, limits, pool)
        try:
            loop.add(group)
            while loop.groups:
                loop.step()
        finally:
            loop.close()
    else:
        _lockstep(engine, tokenizer, group.episodes, group.chats, group.tools, group.turn_spec, spec.seed, limits,
                  parser, pool, first_index)
        for ep in group.episodes:
            ep.truncated = ep.truncated or not ep.done
    return group.episodes


def start_group(envs: Sequence[Any], tokenizer, spec: SamplingSpec, limits: EpisodeLimits, parser: ToolCallParser,
                first_index: int = 0) -> Group:
    """One episode per environment, started: its first messages as the episode's first prompt (refused past
    ``limits.max_prompt_tokens``), its chat and its tools by name (none for an environment that runs its own), the
    turns sampled as ``spec`` says and stopped at the parser's end of a call (:func:`turn_stops`)."""
    episodes, chats = [], []
    for env in envs:
        messages = list(env.start())  # before the tools: an adapter may learn them as it starts
        chats.append(ChatTokens(tokenizer, tool_schemas(env) or None))
        episodes.append(Episode(env, chats[-1].first_prompt(messages), messages))
        if limits.max_prompt_tokens and len(episodes[-1].prompt_ids) > limits.max_prompt_tokens:
            raise ValueError(f"an environment's first prompt has {len(episodes[-1].prompt_ids)} tokens > "
                             f"data.max_prompt_tokens={limits.max_prompt_tokens} (its messages and tools through the "
                             f"chat template): {str(messages[-1].get('content', ''))[:80]!r}")
    env_tools = [() if getattr(env, "runs_tools", False) else tuple(getattr(env, "tools", ())) for env in envs]
    return Group(episodes, chats, [tools_by_name(t) for t in env_tools], turn_stops(tokenizer, parser, spec), spec.seed,
                 first_index)


def _lockstep(engine, tokenizer, episodes: List[Episode], chats: List[ChatTokens], tools, turn_spec: SamplingSpec,
              seed: int, limits: EpisodeLimits, parser: ToolCallParser, pool: ThreadPoolExecutor,
              first_index: int = 0) -> None:
    tag = uuid.uuid4().hex  # the episodes' sessions: each one's turns on one replica (engine replicas)
    for turn in range(limits.max_turns):
        active = [k for k, ep in enumerate(episodes) if ep.active]
        if not active:
            break
        contexts = [episodes[k].prompt_ids + episodes[k].response_ids for k in active]
        spec = replace(turn_spec, seed=stream_seed(seed, turn))
        at = {"first_index": first_index} if first_index else {}  # the engines' own default where there is none
        gens = engine.generate(contexts, spec, sessions=[(tag, k) for k in active], **at) \
            if getattr(engine, "sticky_sessions", False) else engine.generate(contexts, spec, **at)
        calls, assistants = [], {}
        for k, per_prompt in zip(active, gens):
            message, own = _take_turn(episodes[k], per_prompt[0], tokenizer, parser, limits)
            if message is not None:
                assistants[k] = message
                calls += [(k, c) for c in own]
        results = run_tool_calls(calls, tools, limits.tool_timeout_s, pool)
        for k, message in assistants.items():
            tool_messages = _tool_messages(episodes[k], results.get(k, []))
            _record(episodes[k], chats[k], message, tool_messages, episodes[k].env.step(message, tool_messages),
                    limits)
