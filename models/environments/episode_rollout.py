"""Multi-turn rollout: dataset rows → environments → episodes → RolloutBatch columns and
``episode/*`` metrics (:mod:`models.environments.episodes` runs them)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np

from models.environments.episodes import Episode, EpisodeLimits, run_episodes
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
    prompts = tokenizer.batch_decode([ep.prompt_ids for ep in episodes], skip_special_tokens=False)
    responses = [ep.response_ids for ep in episodes]
    cols = RolloutColumns(
        prompt_id=np.repeat(np.asarray(prompt_ids, dtype=np.int64), spec.n),
        prompt_tokens=[ep.prompt_ids for ep in episodes], response_tokens=responses,
        sampler_logprobs=[ep.logprobs for ep in episodes],
        is_end=np.array([not ep.truncated for ep in episodes], dtype=bool),
        prompt=prompts, response=decode_responses(tokenizer, responses), generate_s=time.perf_counter() - t0)
    extra = {"loss_mask": [ep.loss_mask for ep in episodes],
             "episode_reward": np.array([ep.reward for ep in episodes], dtype=np.float32),
             "episode": [json.dumps(ep.messages, ensure_ascii=False) for ep in episodes]}
    return cols, extra, episode_stats(episodes)


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
