"""Episodes at their own pace in one vLLM step loop (continuous batching): :class:`EpisodeLoop` holds groups of
episodes (a synchronous rollout's batch, or an asynchronous run's units, :class:`models.hosts.stream.EpisodeStreamer`)
and can take a new group while others are under way.

Each episode is its own stream of requests: a turn that ends leaves the engine at once, its tool calls and its
environment's step run in a thread of their own while the other episodes' turns go on generating, and its next turn
joins the engine as soon as the step has answered. Turn ``t`` of episode ``k`` of a group is seeded
``sample_seed(stream_seed(seed, t), first_index + k, 0)``, the group's seed and the index of its first episode in
its batch, so a batch sampled in groups gives the episodes it gives whole. A group is finished when every one of
its episodes is (:meth:`EpisodeLoop.step` returns it).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any, Dict, List, Sequence, Tuple

from models.engines.base import SamplingSpec, stream_seed
from models.environments.chat_tokens import ChatTokens
from models.environments.episode_turns import Episode, EpisodeLimits, _record, _take_turn, _tool_messages
from models.environments.tools import ToolCallParser, run_tool_calls


class Group:
    """Episodes started together, with their chats and tools (per episode), the turn's sampling spec, the seed and
    the index of the first episode in its batch; ``pending``: how many are still in the engine or stepping; ``t0``:
    when it started."""

    def __init__(self, episodes: List[Episode], chats: List[ChatTokens], tools: Sequence[Dict[str, Any]],
                 turn_spec: SamplingSpec, seed: int, first_index: int = 0):
        self.episodes, self.chats, self.tools = episodes, chats, list(tools)
        self.turn_spec, self.seed, self.first_index = turn_spec, seed, first_index
        self.pending = len(episodes)
        self.t0 = time.perf_counter()


class EpisodeLoop:
    """Groups of episodes on ``engine`` (an in-process :class:`~models.engines.VLLMEngine`), one step loop; the tool
    calls run in ``pool``, the environments' steps in threads of the loop's own (a step may wait on its tools: never
    the same threads)."""

    def __init__(self, engine, tokenizer, parser: ToolCallParser, limits: EpisodeLimits, pool: ThreadPoolExecutor):
        self.engine, self.tokenizer, self.parser, self.limits, self.pool = engine, tokenizer, parser, limits, pool
        self.loop = engine.stream()
        self.in_engine: Dict[int, Tuple[Group, int]] = {}  # id(sample) -> its group and episode
        self.stepping: Dict[Future, Tuple[Group, int, Dict[str, Any]]] = {}  # a step -> group, episode, message
        self.groups: List[Group] = []
        self.steps = ThreadPoolExecutor(max_workers=64, thread_name_prefix="episode")

    @property
    def in_flight(self) -> int:
        """Episodes under way (in the engine, or their environment stepping)."""
        return sum(g.pending for g in self.groups)

    def add(self, group: Group) -> None:
        """``group``'s episodes, each its first turn into the engine."""
        self.groups.append(group)
        for k in range(len(group.episodes)):
            self._next_turn(group, k)

    def step(self, version: int = 0) -> List[Group]:
        """One step of the engine when a turn is in it (its tokens tagged ``version``), the turns it finished handed
        to their environments, the environments' answers recorded and the episodes that go on back in the engine;
        with no turn in the engine, waits for an environment. The groups whose episodes have all ended."""
        if self.in_engine:
            if not self.engine.stream_open(self.loop):  # restarted or closed: these requests went with it
                raise RuntimeError("the engine was restarted or closed while the episodes ran")
            self.loop.resume()  # another use of the engine took its turn meanwhile: the turns under way again
            from models.engines.vllm_steps import generations

            for sample in self.engine.stream_step(self.loop, version):
                group, k = self.in_engine.pop(id(sample))
                message, own = _take_turn(group.episodes[k], generations([sample], self.tokenizer,
                                                                         group.turn_spec)[0],
                                          self.tokenizer, self.parser, self.limits)
                if message is None:
                    group.pending -= 1
                else:
                    self.stepping[self.steps.submit(self._env_step, group, k, message, own)] = (group, k, message)
            self.loop.forget([s for s in self.loop.samples if s.done])
        if self.in_engine:
            finished = [f for f in self.stepping if f.done()]
        else:
            finished = list(wait(list(self.stepping), return_when=FIRST_COMPLETED).done) if self.stepping else []
        for future in finished:
            group, k, message = self.stepping.pop(future)
            tool_messages, answer = future.result()
            ep = group.episodes[k]
            _record(ep, group.chats[k], message, tool_messages, answer, self.limits)
            if ep.active and ep.turns < self.limits.max_turns:
                self._next_turn(group, k)
            else:
                group.pending -= 1
        done = [g for g in self.groups if not g.pending]
        self.groups = [g for g in self.groups if g.pending]
        for group in done:
            for ep in group.episodes:
                ep.truncated = ep.truncated or not ep.done
        return done

    def forget(self) -> None:
        """Every group given up (the engine restarted under them, the run moved): their requests out of the loop."""
        self.in_engine.clear()
        self.stepping.clear()  # (a step under way ends in its thread; its answer is dropped)
        self.groups = []
        self.loop.forget(list(self.loop.samples))  # last: an engine restarted under them may refuse it

    def close(self) -> None:
        self.steps.shutdown(wait=False, cancel_futures=True)
        self.engine.close_stream(self.loop)

    def _next_turn(self, group: Group, k: int) -> None:
        self.loop.resume()  # (another use of the engine may have suspended it while the environment stepped)
        ep = group.episodes[k]
        sample = self.engine.stream_samples([ep.prompt_ids + ep.response_ids],
                                            replace(group.turn_spec, seed=stream_seed(group.seed, ep.turns)),
                                            group.first_index + k)[0]
        self.in_engine[id(sample)] = (group, k)
        self.loop.add([sample])

    def _env_step(self, group: Group, k: int, message: Dict[str, Any], calls):
        results = run_tool_calls([(k, c) for c in calls], group.tools, self.limits.tool_timeout_s, self.pool).get(k, [])
        tool_messages = _tool_messages(group.episodes[k], results)
        return tool_messages, group.episodes[k].env.step(message, tool_messages)
