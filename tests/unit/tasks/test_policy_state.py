"""PolicyState (what the tasks pass) and RunState (``state.json``) are one resume point in two forms:
the file a commit writes is the one earlier code wrote, and a resume reads back the state it left."""

from __future__ import annotations

import dataclasses

from models.run.layout import RunState
from models.run.types import PolicyState


def test_the_resume_point_is_numbered_by_the_completed_iteration_with_extras_only_when_set():
    point = PolicyState(4, "s3://b/run/iter-000003/actor", "", 0.01).resume_point()
    # Hand-written: what state.json held before the conversion moved here (iteration.py's commit).
    assert (point.iteration, point.actor_url, point.critic_url, dict(point.extras)) == \
        (3, "s3://b/run/iter-000003/actor", None, {"kl_coef": 0.01})


def test_a_resumed_state_is_the_state_that_was_committed():
    state = PolicyState(8, "a7", "c7", 0.013, {"count": 64.0, "mean": 0.5, "m2": 3.0}, "a6")
    assert PolicyState.resumed(state.resume_point(), kl_coef=0.5, off_policy=True) == state
    # On-policy now (run.off_policy_steps changed on resume): no behaviour actor to sample from.
    assert PolicyState.resumed(state.resume_point(), 0.5, off_policy=False) == \
        dataclasses.replace(state, behaviour_url="")


def test_an_old_state_json_without_extras_takes_the_configs_kl():
    state = PolicyState.resumed(RunState(iteration=2, actor_url="a2"), kl_coef=0.05, off_policy=True)
    assert state == PolicyState(3, "a2", "", 0.05, {}, "")
