"""One turn of a multi-turn episode, whichever loop runs it (:mod:`models.environments.episodes`' lockstep,
:mod:`models.environments.episode_loop`'s streams): the episode's record, its limits, the sampled turn appended and
parsed, the environment's answer appended as template tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from models.engines.base import Generation
from models.environments.chat_tokens import ChatTokens
from models.environments.tools import ToolCallParser


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_episode_tokens: int = 256
    tool_timeout_s: float = 10.0
    max_prompt_tokens: int = 0
    """The first prompt's budget (``data.max_prompt_tokens``; 0: none): the engine's context is this plus
    ``max_episode_tokens``, so a longer first prompt is refused as its episode starts, never truncated."""
    pace: str = "auto"
    """``rollout.episode_pace``: ``episode`` (each episode its own stream of requests; the engine must stream),
    ``lockstep`` (one batched call per turn), ``auto`` (per episode where the engine streams)."""


@dataclass
class Episode:
    """One episode's row and what happened in it."""

    env: Any
    prompt_ids: List[int]
    messages: List[Dict[str, Any]]
    response_ids: List[int] = field(default_factory=list)
    loss_mask: List[bool] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    done: bool = False
    truncated: bool = False

    def append(self, ids: Sequence[int], sampled: bool, logprobs: Sequence[float] = ()) -> None:
        self.response_ids += list(ids)
        self.loss_mask += [sampled] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)

    @property
    def active(self) -> bool:
        return not (self.done or self.truncated)


def _assistant_message(tokenizer, parser: ToolCallParser, tokens: Sequence[int]):
    content, calls = parser.parse(tokenizer.decode(list(tokens), skip_special_tokens=True))
    message = {"role": "assistant", "content": content}
    if any(not c.error for c in calls):
        message["tool_calls"] = [c.as_message_call() for c in calls if not c.error]
    return message, calls


def _take_turn(ep: Episode, g: Generation, tokenizer, parser: ToolCallParser, limits: EpisodeLimits
               ) -> Tuple[Optional[Dict[str, Any]], list]:
    """``ep``'s sampled turn ``g`` appended (cut at the episode's room); its assistant message and the calls the loop
    runs (none for an environment that runs its own), or None for the message when the turn ended the episode
    truncated."""
    room = limits.max_episode_tokens - len(ep.response_ids)
    ep.append(g.tokens[:room], True, g.logprobs[:room])
    ep.turns += 1
    message, parsed = _assistant_message(tokenizer, parser, g.tokens[:room])
    ep.tool_calls += len(parsed)
    if not g.is_end or len(g.tokens) > room:
        ep.truncated = True
        ep.messages.append(message)
        return None, []
    return message, [] if getattr(ep.env, "runs_tools", False) else parsed


def _tool_messages(ep: Episode, results) -> List[Dict[str, Any]]:
    """``results`` (:class:`models.environments.tools.ToolResult`) as ``tool`` messages, the failed ones counted."""
    ep.tool_errors += sum(r.error for r in results)
    return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


def _record(ep: Episode, chat: ChatTokens, message: Dict[str, Any], tool_messages: List[Dict[str, Any]], step: Any,
            limits: EpisodeLimits) -> None:
    """The environment's answer ``step`` to ``ep``'s turn ``message`` (whose calls gave ``tool_messages``), appended
    as template tokens."""
    ep.reward += float(step.reward)
    history, ep.messages = ep.messages, ep.messages + [message]
    new = tool_messages + list(step.messages)
    ep.messages += new
    if step.done:
        ep.done = True
        return
    ids = chat.continuation(history, new, ep.response_ids)
    if len(ep.response_ids) + len(ids) >= limits.max_episode_tokens:
        ep.truncated = True  # no room for the observation and a next turn
        return
    ep.append(ids, False)
