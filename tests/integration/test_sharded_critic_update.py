"""``critic_update`` as a real 2-process elastic launch (local execution, gloo) against the same task on
one process (the default ``critic.nnodes=critic.nproc_per_node=1``, which runs in the calling process):
the same losses and the same committed weights and AdamW moments, with ``critic.sharding=fsdp2`` (what
``auto`` picks on GPUs) and ``ddp``; with ``critic.optimizer_state_sharded`` each rank commits its own
shard of AdamW's moments, which the next 2-rank update reads back.

Every minibatch is the whole batch (``critic.minibatch_size`` = 32 samples), so one process and two
ranks, which shuffle their rows differently, take the same steps: the only difference left is the order
of float32 sums (the all-reduce, FSDP2's reduce-scatter), hence the tolerances: weights within
``rtol=1e-4, atol=1e-5``, the moments within ``rtol=1e-3`` of their largest entry's rounding, the losses
and gradient norms within ``rel=1e-4``."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from flytekit import task
from safetensors.torch import load_file

from models.training.files import optimizer_url
from tasks.deploy import elastic_for
from tasks.updates import critic_update
from tests.integration.test_sharded_actor_update import _local, stage_inputs
from tests.stages import with_overrides

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WHOLE_BATCH = ["critic.minibatch_size=32", "critic.micro_batch_size=8", "critic.epochs=2"]
"""2 optimiser steps, each on all 32 samples (8 prompts × 4): 8 per micro-batch, 2 per rank."""
TWO_RANKS = ["critic.nproc_per_node=2"]
LR = 1e-3
"""tiny_ppo's critic.lr."""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    with stage_inputs(tmp_path_factory.mktemp("sharded_critic"), "tiny_ppo") as kwargs:
        yield {**kwargs, "cfg": with_overrides(kwargs["cfg"], *WHOLE_BATCH)}


def launch(inputs, *overrides: str, state=None):
    """``critic_update`` on the topology ``overrides`` give (the run's local launch, as the workflow sets
    it); its committed weights and AdamW state (the files), and its statistics."""
    cfg = with_overrides(inputs["cfg"], *overrides)
    update = task(task_config=elastic_for(cfg, local=True, section="critic"))(critic_update.task_function)
    out = update(**{**inputs, "cfg": cfg, "state": state or inputs["state"]})
    opt = _local(optimizer_url(out.checkpoint_url))
    moments = {f: load_file(os.path.join(opt, f)) for f in sorted(os.listdir(opt)) if f.endswith(".safetensors")}
    return load_file(os.path.join(_local(out.checkpoint_url), "model.safetensors")), moments, out


@pytest.fixture(scope="module")
def one(inputs):
    return launch(inputs)


def assert_same_update(got, want):
    (weights, moments, out), (want_w, want_m, want_out) = got, want
    assert set(weights) == set(want_w) and set(moments) == set(want_m) == {"optimizer.safetensors"}
    lr, steps = float(out.stats.get("critic/lr", LR)), 2
    for name, w in want_w.items():
        # AdamW divides each element's step by the root of its own second moment, so an element whose
        # gradient sits at float32's rounding floor steps by an amount the order of the sums decides (up to
        # lr a step; seen: 1 element in 16,384 off by 1.4e-5 at lr 1e-3). Such elements are rare; a wrong
        # update (gradients not reduced, a rank's rows lost) moves most elements and the moments below.
        off = ~torch.isclose(weights[name], w, rtol=1e-4, atol=1e-5)
        assert int(off.sum()) <= max(1, w.numel() // 1000), (name, int(off.sum()), w.numel())
        torch.testing.assert_close(weights[name], w, rtol=1e-4, atol=1e-5 + 0.05 * lr * steps, msg=name)
    for name, m in want_m["optimizer.safetensors"].items():
        torch.testing.assert_close(moments["optimizer.safetensors"][name], m, rtol=1e-3,
                                   atol=1e-5 * float(m.abs().max()), msg=name)
    stats, want_stats = out.stats, want_out.stats
    assert stats["critic/steps"] == want_stats["critic/steps"] == 2
    for key in ("critic/loss", "critic/grad_norm"):
        assert stats[key] == pytest.approx(want_stats[key], rel=1e-4, abs=1e-7), key
    # a share of tokens: one whose value sits at the clip boundary flips with the order of the sums (seen with
    # FSDP2's reduce-scatter per micro-batch: 0.2527 against 0.2500, one token of ~370); a lost rank's tokens move it
    # by far more, and the loss and gradient norm above
    assert stats["critic/value_clip_frac"] == pytest.approx(want_stats["critic/value_clip_frac"], abs=0.01)


@pytest.mark.parametrize("sharding", ["fsdp2", "ddp"])
def test_two_ranks_commit_what_one_process_commits(inputs, one, sharding):
    """The same update; rank 0 commits a Hugging Face directory (gathered from the FSDP2 shards)."""
    from transformers import AutoModelForTokenClassification

    got = launch(inputs, *TWO_RANKS, f"critic.sharding={sharding}")
    assert_same_update(got, one)
    start = load_file(os.path.join(_local(inputs["state"].critic_url), "model.safetensors"))
    assert max(float((w - start[n]).abs().max()) for n, w in one[0].items()) > 1e-4  # it trained
    loaded = AutoModelForTokenClassification.from_pretrained(_local(got[2].checkpoint_url)).state_dict()
    assert all(torch.equal(loaded[n], w) for n, w in got[0].items())


def test_sharded_optimizer_state_is_committed_per_rank_and_read_back(inputs):
    """Each FSDP2 rank commits its shard of AdamW's moments; the next 2-rank update starts from them."""
    sharded = [*TWO_RANKS, "critic.sharding=fsdp2", "critic.optimizer_state_sharded=true"]
    _, moments, first = launch(inputs, *sharded)
    assert list(moments) == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    assert first.stats["critic/optimizer_steps_total"] == 2
    state = dataclasses.replace(inputs["state"], iteration=inputs["state"].iteration + 1,
                                critic_url=first.checkpoint_url)
    _, _, second = launch(inputs, *sharded, state=state)
    assert second.stats["critic/optimizer_steps_total"] == 4  # the shards loaded: 2 steps before, 2 now
