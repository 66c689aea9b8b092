"""One-step off-policy pipelining (``run.off_policy_steps=1``) in-process on the Qwen2-shaped chat
checkpoint, in the order the pipelined graph runs (``workflows/common.py``: iteration k+1's batch
sampled from state k's actor before update k): a run stopped after two iterations and resumed from
its ``state.json`` for a third equals one that ran three at once (the same batch 2, sampled from
actor 0 again; the same actor and critic 2, byte for byte), and ``rollout/policy_lag`` is 0, 1, 1."""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import pytest
import torch

from models.checkpoint import read_marker
from models.training.distributed import DistInfo
from models.data.batch import RolloutBatch
from tests.hub_runs import hub_run

pytestmark = [pytest.mark.integration]

OFF = ["run.off_policy_steps=1", "actor.tis_cap=2", "rollout.engine=hf", "run.save_interval=1",
       "run.eval_interval=0", "actor.ppo_epochs=2"]


def pipelined(cfg, run, state, stop: int) -> List[Dict[str, float]]:
    """Iterations ``state.iteration`` .. ``stop``−1 as the pipelined graph orders them; each one's stats."""
    from models.stages.advantages import run_advantages
    from models.stages.commit import run_commit
    from models.stages.rollout import run_rollout
    from models.stages.score import run_score
    from models.stages.actor import train_actor
    from models.stages.critic import train_critic

    sampled = run_rollout(cfg, run, *state.sampler())
    out = []
    for i in range(state.iteration, stop):
        ahead = run_rollout(cfg, run, state, 1) if i + 1 < stop else None  # before update i: its actor is older
        sc = run_score(cfg, run, state, sampled.batch)
        ad = run_advantages(cfg, run, state, sc.batch)
        actor = train_actor(cfg, run, state, ad.batch, DistInfo(0, 1, 0, torch.device("cpu")))
        critic = train_critic(cfg, run, state, ad.batch)
        stats = [sampled.stats, sc.stats, ad.stats, actor.stats, critic.stats]
        state = run_commit(cfg, run, state, stats, sc.batch, actor.checkpoint_url, critic.checkpoint_url)
        out.append({k: v for s in stats for k, v in s.items()})
        sampled = ahead
    return out


def test_a_resumed_pipelined_run_equals_an_uninterrupted_one(qwen2_chat_dir, tmp_path):
    with hub_run(tmp_path, qwen2_chat_dir, "tiny_ppo", OFF, "whole") as (cfg, run, state):
        whole = pipelined(cfg, run, state, 3)
        whole_layout = run.layout
    with hub_run(tmp_path, qwen2_chat_dir, "tiny_ppo", OFF + ["run.num_iterations=2"], "resumed") as (cfg, run, state):
        first = pipelined(cfg, run, state, 2)
        assert run.layout.read_state().extras["behaviour_url"] == run.layout.actor_url(0)
    with hub_run(tmp_path, qwen2_chat_dir, "tiny_ppo", OFF + ["run.num_iterations=3"], "resumed") as (cfg, run, state):
        assert (state.iteration, state.behaviour_url) == (2, run.layout.actor_url(0))  # from state.json
        rest = pipelined(cfg, run, state, 3)
        layout = run.layout

    assert [s["rollout/policy_lag"] for s in whole] == [0.0, 1.0, 1.0]
    for key in ("rollout/policy_lag", "rollout/reward_mean", "actor/loss", "critic/loss", "rollout/logprob_gap_max"):
        assert [s[key] for s in first + rest] == [s[key] for s in whole], key
    b_whole, b_resumed = (RolloutBatch.read(lay.batch_url(2, "rollouts")) for lay in (whole_layout, layout))
    assert b_resumed.metadata.policy_version == b_whole.metadata.policy_version == 1  # sampled by actor 0
    assert b_resumed.column("response_tokens").to_pylist() == b_whole.column("response_tokens").to_pylist()
    for url in ("actor_url", "critic_url"):
        assert read_marker(getattr(layout, url)(2))["files"] == read_marker(getattr(whole_layout, url)(2))["files"]
    # the lag is real: the update's π_old (actor 1) is not the sampler (actor 0), so the TIS weight differs from 1
    assert whole[2]["rollout/logprob_gap_max"] > 1e-3
    assert not np.isclose(whole[2]["actor/tis_weight_mean"], 1.0, atol=1e-6)
