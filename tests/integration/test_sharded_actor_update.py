"""``actor_update`` as a real 2-process elastic launch (local execution, gloo) with ``actor.sharding=fsdp2``,
the path ``auto`` takes on GPUs: it commits the checkpoint (full weights, or a LoRA adapter) and the
optimizer state DDP's update commits, and with ``model.dtype=bfloat16`` it trains float32 master
weights (FSDP2's mixed precision) and commits them in float32."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from flytekit import task
from flytekitplugins.kfpytorch import Elastic
from safetensors.torch import load_file

from models.training.files import optimizer_url
from tasks.updates import actor_update
from tests.stages import tiny_run, to_advantages, with_overrides

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OVERRIDES = ["rollout.engine=hf", "rollout.prompts_per_iteration=8", "rollout.n_samples_per_prompt=4",
             "actor.minibatch_size=16", "actor.micro_batch_size=4", "actor.nproc_per_node=2",
             "critic.minibatch_size=16", "critic.micro_batch_size=8", "run.num_iterations=1",
             "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8", "actor.lr=1e-4"]

update = task(task_config=Elastic(nnodes=1, nproc_per_node=2, monitor_interval=1))(actor_update.task_function)


@contextlib.contextmanager
def stage_inputs(root, preset: str):
    with tiny_run(root, preset, OVERRIDES, "sharded", local_cache=False) as setup:
        _, _, ad = to_advantages(*setup)
        yield dict(cfg=setup.cfg, run=setup.run, state=setup.state, batch=ad.batch)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    with stage_inputs(tmp_path_factory.mktemp("sharded"), "tiny_ppo") as kwargs:
        yield kwargs


def _local(url: str) -> str:
    return url.replace("file://", "")


def trained(inputs, sharding: str, dtype: str = "float32", weights_file: str = "model.safetensors"):
    """The committed weights and optimizer state of one elastic update, and its statistics."""
    cfg = with_overrides(inputs["cfg"], f"actor.sharding={sharding}", f"model.dtype={dtype}")
    out = update(**{**inputs, "cfg": cfg})
    weights = load_file(os.path.join(_local(out.checkpoint_url), weights_file))
    moments = load_file(os.path.join(_local(optimizer_url(out.checkpoint_url)), "optimizer.safetensors"))
    return weights, moments, out.stats


@pytest.fixture(scope="module")
def ddp(inputs):
    return trained(inputs, "ddp")


def assert_same_update(got, want):
    (weights, moments, stats), (want_w, want_m, want_stats) = got, want
    assert set(weights) == set(want_w) and set(moments) == set(want_m)
    for name, w in want_w.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-4, atol=1e-5, msg=name)
    for name, m in want_m.items():  # summation order differs (reduce-scatter, all-reduce): rounding of the largest
        torch.testing.assert_close(moments[name], m, rtol=1e-3, atol=1e-5 * float(m.abs().max()), msg=name)
    assert stats["actor/steps"] == want_stats["actor/steps"] == 4  # 32 samples / minibatch 16 × 2 epochs
    for key in ("actor/loss", "actor/grad_norm", "actor/approx_kl"):
        assert stats[key] == pytest.approx(want_stats[key], rel=1e-3, abs=1e-6), key
    # a share of tokens: one at the clip boundary flips with the order of the sums (as the critic's value clip did,
    # test_sharded_critic_update.py); a wrong update moves it by far more, and the loss and gradient norm above
    assert stats["actor/clip_frac"] == pytest.approx(want_stats["actor/clip_frac"], abs=0.01)


def test_fsdp2_update_commits_what_ddp_commits(inputs, ddp):
    assert_same_update(trained(inputs, "fsdp2"), ddp)
    start = load_file(os.path.join(_local(inputs["state"].actor_url), "model.safetensors"))
    assert max(float((w - start[n]).abs().max()) for n, w in ddp[0].items()) > 1e-4  # it trained


def test_fsdp2_lora_update_commits_the_adapter_ddp_commits(tmp_path):
    """LoRA: frozen base and trainable adapters share each FSDP2 unit; the adapter is gathered to save."""
    with stage_inputs(tmp_path, "tiny_ppo_lora") as kwargs:
        ddp = trained(kwargs, "ddp", weights_file="adapter_model.safetensors")
        assert_same_update(trained(kwargs, "fsdp2", weights_file="adapter_model.safetensors"), ddp)
    assert any(".lora_B." in n and float(w.abs().max()) > 0 for n, w in ddp[0].items())  # B starts at 0: it trained


def test_bfloat16_fsdp2_update_trains_and_commits_float32_weights(inputs, ddp):
    weights, moments, _ = trained(inputs, "fsdp2", "bfloat16")
    want_w = ddp[0]
    start = load_file(os.path.join(_local(inputs["state"].actor_url), "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.float32}
    assert {m.dtype for m in moments.values()} == {torch.float32}
    num = sum(float((weights[n] - w).norm() ** 2) for n, w in want_w.items())
    den = sum(float((w - start[n]).norm() ** 2) for n, w in want_w.items())
    assert 1e-4 < (num / den) ** 0.5 < 0.2  # float32's steps, up to bfloat16's compute error
