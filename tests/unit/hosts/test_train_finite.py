"""The critic server's ``train`` is finite or refused: a step whose loss or gradient overflows is skipped
and counted, a call with no finite step is refused (HTTP 422) with the critic and AdamW untouched."""

from __future__ import annotations

import pytest
import torch

from models.hosts.reward_critic import InvalidRequest, RewardCriticHost, ServiceConfig
from tests.unit.hosts.tiny_checkpoints import commit_tiny_models, samples

HUGE = 3e38  # finite in float32; its square is not


@pytest.fixture
def svc(tmp_path):
    urls = commit_tiny_models(tmp_path)
    return RewardCriticHost.load(ServiceConfig(critic_url=urls["critic"], lr=1e-3))


def weights(svc) -> dict:
    return {k: v.detach().clone() for k, v in svc.critic.state_dict().items()}


def test_train_without_a_finite_step_is_refused_and_changes_nothing(svc):
    prompts, responses = samples(4, seed=2)
    old = [[0.0] * len(r) for r in responses]
    before = weights(svc)
    with pytest.raises(InvalidRequest, match=r"train: all 2 optimiser steps of this update had a non-finite loss"):
        svc.train_on(prompts, responses, [[HUGE] * len(r) for r in responses], old,
                  minibatch_size=2, micro_batch_size=1, value_clip=0.0, seed=0)
    assert all(torch.equal(v, before[k]) for k, v in weights(svc).items())
    assert not svc.optimizer.state and svc.optimizer_steps == 0


def test_a_nonfinite_step_is_skipped_and_counted(svc):
    prompts, responses = samples(4, seed=2)
    old = [[0.0] * len(r) for r in responses]
    returns = [[1.0] * len(r) for r in responses]
    returns[0] = [HUGE] * len(responses[0])  # spoils the minibatch that holds sample 0, not the other
    stats = svc.train_on(prompts, responses, returns, old, minibatch_size=2, micro_batch_size=1, seed=0)
    assert (stats["steps"], stats["nonfinite_steps"]) == (1.0, 1.0)
    assert svc.optimizer_steps == 1 and {float(s["step"]) for s in svc.optimizer.state.values()} == {1.0}
