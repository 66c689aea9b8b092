"""One-step off-policy pipelining (``run.off_policy_steps=1``, docs/off_policy.md): what the config
refuses, the iteration graph (which nodes Flyte may run at once), the decoupled-PPO loss by hand,
``rollout/policy_lag`` and the checkpoints the pipeline keeps."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from flytekit import workflow

from kernels.losses import PolicyLossConfig, PolicyLossInput, policy_loss
from models import storage
from models.checkpoint import is_committed, save_checkpoint
from models.config.io import load_config
from models.stages.commit import prune_checkpoints
from models.stages.score_metrics import policy_lag
from models.run.types import PolicyState, RunHandle
from tests.unit.models.test_checkpoint import hf_dir
from tests.unit.tasks.test_batch import rollout_batch
from workflows.common import chain_iterations

OFF = ["run.off_policy_steps=1", "actor.tis_cap=2"]
RUN = RunHandle("/tmp/runs", "r", "m", "/tmp/runs/r/reference", "/tmp/t.jsonl", "/tmp/e.jsonl")


def _cfg(preset: str, *overrides: str):
    return load_config(f"configs/{preset}.yaml", ["run.num_iterations=3", "run.eval_interval=0", *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["run.off_policy_steps=2"], "must be 0 (on-policy) or 1"),
    (["run.off_policy_steps=1"], "needs actor.tis_cap > 0"),
    (OFF + ["actor.old_logprobs=sampler", "actor.tis_cap=0", "rollout.engine=hf", "model.dtype=float32"],
     "actor.old_logprobs=sampler: the batch comes from an actor older than the one the update starts from"),
    (OFF + ["actor.old_logprobs=update", "actor.minibatch_size=64"],
     "actor.old_logprobs=update: the batch comes from an actor older than the one the update starts from"),
    (OFF + ["rollout.remote_url=http://127.0.0.1:9/"], "a rollout server holds one policy at a time"),
    (["run.max_staleness=-1"], "run.max_staleness must be >= 0"),
    (OFF + ["run.max_staleness=1"], "off_policy_steps is max_staleness's older name"),
    (["run.max_staleness=2", "actor.tis_cap=2"], "run.max_staleness=2 (asynchronous training) needs run.resident=true"),
    (["run.max_staleness=3", "run.resident=true"], "run.max_staleness=3 needs actor.tis_cap > 0"),
    (["run.max_staleness=2", "run.resident=true", "actor.tis_cap=2", "actor.lora.rank=4"],
     "asynchronous training pushes full weights only"),
    (["run.partial_rollouts=true"], "partial rollouts need asynchronous training"),
    (["run.stale_samples=keep"], "run.stale_samples"),
    (["run.stale_samples=reweight"], "run.stale_samples=reweight with run.max_staleness=0"),
    (["run.max_staleness=2", "run.resident=true", "run.stale_samples=reweight"],
     "run.stale_samples=reweight with run.max_staleness=2 and actor.tis_cap=0.0: samples staler than k"),
])
def test_what_off_policy_cannot_combine_with_is_refused_with_the_reason(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _cfg("tiny_grpo", *overrides)


def test_partial_rollouts_are_taken_with_the_vllm_engine():
    cfg = _cfg("tiny_grpo", "run.max_staleness=2", "run.resident=true", "actor.tis_cap=2", "run.partial_rollouts=true")
    assert (cfg.rollout.engine, cfg.run.partial_rollouts) == ("vllm", True)  # vLLM steps through generate_versions


def _graph(cfg, state: PolicyState, critic: bool):
    """``{node id: (task name, set of ancestor ids)}`` of one chunk as the dynamic workflow wires it."""
    @workflow
    def chunk() -> PolicyState:
        return chain_iterations(cfg, RUN, state, critic, cfg.run.num_iterations)

    nodes = {n.id: n for n in chunk.nodes}
    ancestors = {}

    def up(nid):
        if nid not in ancestors:
            direct = {u.id for u in nodes[nid].upstream_nodes}
            ancestors[nid] = direct.union(*(up(u) for u in direct))
        return ancestors[nid]

    return {nid: (n.flyte_entity.name.rsplit(".", 1)[-1], up(nid)) for nid, n in nodes.items()}


def _per_iteration(graph, task: str):
    return [nid for nid, (name, _) in sorted(graph.items(), key=lambda kv: int(kv[0][1:])) if name == task]


def _concurrent(graph, a: str, b: str) -> bool:
    return a not in graph[b][1] and b not in graph[a][1]


@pytest.mark.slow  # compiles four three-iteration chunks: ~20 s of CPU a preset
@pytest.mark.parametrize("preset, critic", [("tiny_ppo", True), ("tiny_grpo", False)])
def test_rollout_of_the_next_iteration_runs_beside_the_update(preset, critic):
    on = _graph(_cfg(preset), PolicyState(0, RUN.reference_url), critic)
    off = _graph(_cfg(preset, *OFF), PolicyState(0, RUN.reference_url), critic)
    for g, lagged in ((on, False), (off, True)):
        rollouts, updates = _per_iteration(g, "rollout"), _per_iteration(g, "actor_update")
        scores, commits = _per_iteration(g, "score"), _per_iteration(g, "commit_iteration")
        assert len(rollouts) == len(updates) == 3
        for k in range(2):
            # rollout(k+1) needs no result of update(k) (nor of the critic's) only when pipelined ...
            assert _concurrent(g, rollouts[k + 1], updates[k]) == lagged
            if critic:
                assert _concurrent(g, rollouts[k + 1], _per_iteration(g, "critic_update")[k]) == lagged
            # ... but score(k+1) always waits for commit(k): π_old is the actor update k wrote
            assert commits[k] in g[scores[k + 1]][1]
        if lagged:  # rollout(k+2) samples from state k+1, the output of commit(k)
            assert commits[0] in g[rollouts[2]][1] and commits[1] not in g[rollouts[2]][1]


@pytest.mark.parametrize("lagged", [OFF, ["run.max_staleness=1", "actor.tis_cap=2"]])
def test_a_resumed_chunk_samples_its_first_batch_from_the_older_actor(lagged):
    """State 2 (after iteration 1) names the actor of iteration 0 as the sampler of batch 2; ``max_staleness=1``
    is ``off_policy_steps=1`` under its new name."""
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Literal

    cfg = _cfg("tiny_grpo", *lagged)
    assert (cfg.run.staleness, cfg.run.pipelined, cfg.run.asynchronous) == (1, True, False)
    state = PolicyState(2, "/tmp/runs/r/iter-000001/actor", behaviour_url="/tmp/runs/r/iter-000000/actor")

    @workflow
    def chunk() -> PolicyState:
        return chain_iterations(cfg, RUN, state, False, cfg.run.num_iterations)

    first = next(n for n in chunk.nodes if n.flyte_entity.name.endswith(".rollout"))
    bound = {b.var: b.binding for b in first.bindings}
    ctx = FlyteContextManager.current_context()
    sampler = TypeEngine.to_python_value(ctx, Literal(scalar=bound["state"].scalar), PolicyState)
    assert (sampler.iteration, sampler.actor_url) == (1, "/tmp/runs/r/iter-000000/actor")
    assert bound["ahead"].scalar.primitive.integer == 1  # writes iter-000002/rollouts.arrow


def test_decoupled_ppo_loss_by_hand():
    """Hilton et al. 2022, eq. (3): −(π_prox/π_behav)·min(ρA, clip(ρ, 1±ε)A), ρ = π/π_prox, the behaviour
    weight truncated at C (actor.tis_cap). Token 1: π 0.5, π_prox 0.4, π_behav 0.25, A 1: ρ 1.25 → 1.2,
    weight 1.6: −1.92. Token 2: π 0.3, π_prox 0.3, π_behav 0.1, A −1: ρ 1, weight 3 → C 2: +2.
    Mean over both: 0.04."""
    lp = lambda *p: torch.log(torch.tensor([list(p)], dtype=torch.float64))  # noqa: E731
    inp = PolicyLossInput(logp=lp(0.5, 0.3), old_logp=lp(0.4, 0.3), adv=torch.tensor([[1.0, -1.0]], dtype=torch.float64),
                          mask=torch.ones(1, 2), sampler_logp=lp(0.25, 0.1))
    out = policy_loss(inp, PolicyLossConfig(clip_low=0.2, clip_high=0.2, tis_cap=2.0))
    assert math.isclose(float(out.pg_loss), (-1.92 + 2.0) / 2, rel_tol=1e-9)
    assert math.isclose(float(out.tis_weight_mean), (1.6 + 2.0) / 2, rel_tol=1e-9)


def test_policy_lag_is_measured_from_the_batch_and_bounded():
    batch = rollout_batch()
    sampled_by = lambda v: batch.with_metadata(policy_version=v)  # noqa: E731
    off, on = _cfg("tiny_grpo", *OFF), _cfg("tiny_grpo")
    assert policy_lag(off, PolicyState(3, "a"), sampled_by(2)) == {"rollout/policy_lag": 1.0}
    assert policy_lag(off, PolicyState(3, "a"), sampled_by(3)) == {"rollout/policy_lag": 0.0}
    assert policy_lag(on, PolicyState(3, "a"), sampled_by(3)) == {}
    with pytest.raises(ValueError, match="1 updates before iteration 3's; run.max_staleness=0 allows 0..0"):
        policy_lag(on, PolicyState(3, "a"), sampled_by(2))
    with pytest.raises(ValueError, match="2 updates before"):
        policy_lag(off, PolicyState(3, "a"), sampled_by(1))


@pytest.mark.parametrize("steps", [0, 1])
def test_the_sampler_of_the_next_batch_outlives_its_commit(tmp_path, steps):
    handle = replace(RUN, storage_root=str(tmp_path))
    cfg = _cfg("tiny_grpo", *(OFF if steps else []), "run.save_interval=10")
    for i in range(3):
        save_checkpoint(hf_dir(tmp_path / f"src{i}"), handle.layout.actor_url(i))
    for i in range(3):  # the commits of iterations 0..2: batch 3 samples from actor 1 when pipelined
        prune_checkpoints(cfg, handle, i)
    assert [is_committed(handle.layout.actor_url(i)) for i in range(3)] == [False, bool(steps), True]
    assert storage.exists(handle.layout.actor_url(0)) is False
