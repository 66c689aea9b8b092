"""Multi-turn rollout: dataset rows → environments → episodes → RolloutBatch columns and
``episode/*`` metrics (:mod:`models.environments.episodes` runs them)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from models.environments.episode_loop import EpisodeLoop, Group
from models.environments.episodes import Episode, EpisodeLimits, per_episode, run_episodes, start_group
from models.engines.rollout import RolloutColumns, decode_responses
from models.environments.tools import ToolCallParser

EPISODE_COLUMNS = ("loss_mask", "episode_reward", "episode")
"""What an episode rollout adds to a RolloutBatch: the policy-token mask, the environment's reward
(summed over turns; reward functions take it as the ``episode_reward`` column) and the conversation
(JSON list of messages: turns, tool calls and results) that sample tables and decks show."""


def sample_episodes(engine, tokenizer, env_cls, rows: Sequence[Mapping[str, Any]], prompt_ids: Sequence[int],
                    spec, limits: EpisodeLimits, parser: ToolCallParser, max_workers: int = 16,
                    first_index: int = 0) -> Tuple[RolloutColumns, Dict[str, Any], Dict[str, float]]:
    """``spec.n`` episodes per row (each its own environment), prompt-major like :func:`models.engines.rollout.sample`.
    Returns the rollout columns, the :data:`EPISODE_COLUMNS` and the ``episode/*`` metrics. ``first_index``: the
    position of ``rows[0]`` in the whole batch (its episodes seeded as that batch's, :func:`run_episodes`)."""
    t0 = time.perf_counter()
    envs = [env_cls(dict(row)) for row in rows for _ in range(spec.n)]
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tool") as pool:
        episodes = run_episodes(engine, tokenizer, envs, spec, limits, parser, pool, first_index * spec.n)
    return episode_columns(tokenizer, episodes, prompt_ids, spec.n, t0)


def episode_columns(tokenizer, episodes: List[Episode], prompt_ids: Sequence[int], n: int, t0: float
                    ) -> Tuple[RolloutColumns, Dict[str, Any], Dict[str, float]]:
    """The rollout columns, :data:`EPISODE_COLUMNS` and ``episode/*`` metrics of ``episodes`` (``n`` per prompt of
    ``prompt_ids``, prompt-major), sampled since ``t0``."""
    prompts = tokenizer.batch_decode([ep.prompt_ids for ep in episodes], skip_special_tokens=False)
    responses = [ep.response_ids for ep in episodes]
    cols = RolloutColumns(
        prompt_id=np.repeat(np.asarray(prompt_ids, dtype=np.int64), n),
        prompt_tokens=[ep.prompt_ids for ep in episodes], response_tokens=responses,
        sampler_logprobs=[ep.logprobs for ep in episodes],
        is_end=np.array([not ep.truncated for ep in episodes], dtype=bool),
        prompt=prompts, response=decode_responses(tokenizer, responses), generate_s=time.perf_counter() - t0)
    extra = {"loss_mask": [ep.loss_mask for ep in episodes],
             "episode_reward": np.array([ep.reward for ep in episodes], dtype=np.float32),
             "episode": [json.dumps(ep.messages, ensure_ascii=False) for ep in episodes]}
    return cols, extra, episode_stats(episodes)


def rows_of(data) -> List[Dict[str, Any]]:
    """The rows of a ``PromptDataset`` as environments take them (their columns and ``prompt``)."""
    return [{"prompt": p, **cols} for p, cols in zip(data.prompts, data.row_columns())]


class UnitEpisodes:
    """A draw's prompts as multi-turn episodes a unit at a time, as the asynchronous producer samples them: a unit
    whole in one call (``__call__``, :func:`sample_episodes`: an engine that does not stream), or as a
    :class:`~models.environments.episode_loop.Group` of an :class:`~models.environments.episode_loop.EpisodeLoop` that
    runs other units' episodes beside it (:meth:`streams`: the engine runs episodes at their own pace).
    ``spec_for``: a draw's sampling spec as each turn takes it."""

    def __init__(self, tokenizer, env_cls, limits: EpisodeLimits, parser: ToolCallParser,
                 spec_for: Callable[[Any], Any] = lambda spec: spec, max_workers: int = 16):
        self.tokenizer, self.env_cls, self.limits, self.parser, self.spec_for = tokenizer, env_cls, limits, parser, \
            spec_for
        self.max_workers = max_workers
        self.pool: Optional[ThreadPoolExecutor] = None

    def __call__(self, engine, d, start: int, end: int) -> Tuple[RolloutColumns, Dict[str, Any], Dict[str, float]]:
        return sample_episodes(engine, self.tokenizer, self.env_cls, rows_of(d.data.take(range(start, end))),
                               d.prompt_ids[start:end], self.spec_for(d.spec), self.limits, self.parser,
                               self.max_workers, first_index=start)

    def streams(self, engine) -> bool:
        return per_episode(engine, self.limits)

    def loop(self, engine) -> EpisodeLoop:
        if self.pool is None:  # the tools' threads, for the producer's life
            self.pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="tool")
        return EpisodeLoop(engine, self.tokenizer, self.parser, self.limits, self.pool)

    def group(self, d, start: int, end: int) -> Group:
        """Prompts ``start`` … ``end − 1`` of draw ``d``, ``n`` episodes each, started, seeded as the whole draw's."""
        spec = self.spec_for(d.spec)
        rows = rows_of(d.data.take(range(start, end)))
        envs = [self.env_cls(dict(row)) for row in rows for _ in range(spec.n)]
        return start_group(envs, self.tokenizer, spec, self.limits, self.parser, start * spec.n)

    def columns(self, group: Group, d, start: int, end: int
                ) -> Tuple[RolloutColumns, Dict[str, Any], Dict[str, float]]:
        return episode_columns(self.tokenizer, group.episodes, d.prompt_ids[start:end], self.spec_for(d.spec).n,
                               group.t0)


def episode_stats(episodes: List[Episode]) -> Dict[str, float]:
    """``episode/turns_mean``, ``tool_calls_mean``, ``tool_errors_mean``, ``truncated_frac``, ``reward_mean``
    and ``policy_token_frac`` (share of response tokens the policy sampled)."""
    n = max(len(episodes), 1)
    tokens = sum(len(ep.loss_mask) for ep in episodes)
    return {"episode/turns_mean": sum(ep.turns for ep in episodes) / n,
            "episode/tool_calls_mean": sum(ep.tool_calls for ep in episodes) / n,
            "episode/tool_errors_mean": sum(ep.tool_errors for ep in episodes) / n,
            "episode/truncated_frac": sum(ep.truncated for ep in episodes) / n,
            "episode/reward_mean": sum(ep.reward for ep in episodes) / n,
            "episode/policy_token_frac": sum(sum(ep.loss_mask) for ep in episodes) / max(tokens, 1)}


def merged_episode_stats(parts: Sequence[Tuple[Dict[str, float], int]], loss_masks) -> Dict[str, float]:
    """The ``episode/*`` metrics of a batch sampled in parts (an asynchronous run's units; at least one), from each
    part's metrics and episode count: means over all episodes, ``policy_token_frac`` over all tokens of
    ``loss_masks``."""
    total = max(sum(n for _, n in parts), 1)
    out = {key: sum(stats[key] * n for stats, n in parts) / total for key in parts[0][0]}
    out["episode/policy_token_frac"] = sum(sum(m) for m in loss_masks) / max(sum(len(m) for m in loss_masks), 1)
    return out


def environment_reward(prompts, responses, episode_reward=None) -> List[float]:
    """Reward function (``reward.function=models.environments.episode_rollout:environment_reward``): the reward the
    environment gave each episode (summed over its turns). ``episode_reward`` is a batch column, not a
    data column (hence optional here: the set-up check of the data does not look for it)."""
    if episode_reward is None:
        raise ValueError("environment_reward needs episodes: set rollout.environment (docs/multi_turn.md)")
    return [float(r) for r in episode_reward]
