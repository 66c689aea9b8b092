"""Finite or skip (models/training/update.py): a step whose loss or gradient norm is NaN/inf takes no optimiser
step and is counted; an update with no finite step fails before anything could be committed."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.losses import PolicyLossConfig
from models.training.distributed import DistInfo
from models.training.update import LoopSettings, NonFiniteUpdate, UpdateData, actor_loss_fn, make_optimizer, run_update
from tests.unit.models.test_sharded_update import LENGTHS, policy
from tests.unit.models.update_rows import padded_rows

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
SETTINGS = LoopSettings(epochs=1, minibatch_size=4, micro_batch_size=2, grad_clip=1.0, seed=5)


def with_nan_advantage(data: UpdateData, rows) -> UpdateData:
    """``data`` with a NaN advantage on the first response token of each of ``rows``."""
    adv = data.adv.clone()
    adv[list(rows), 0] = math.nan
    return data._replace(adv=adv)


def subset(data: UpdateData, rows) -> UpdateData:
    idx = torch.tensor(rows)
    return UpdateData(*(None if t is None else t[idx] for t in data))


def train(data: UpdateData, settings: LoopSettings = SETTINGS):
    model = policy()
    optimizer = make_optimizer(model, 1e-2)
    stats = run_update(model, optimizer, data, actor_loss_fn(PolicyLossConfig(), 1.0), settings, CPU)
    return model, optimizer, stats


def minibatches(settings: LoopSettings, n: int):
    """The rows of each minibatch, as run_update draws them (one rank, one epoch)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(settings.seed * 1_000_003)).tolist()
    return [perm[i:i + settings.minibatch_size] for i in range(0, n, settings.minibatch_size)]


def test_a_nonfinite_step_is_skipped_counted_and_leaves_no_trace():
    """One NaN advantage spoils the first minibatch: its step is skipped, and the model and AdamW's
    moments end where a run over the second minibatch alone ends (one step, not two)."""
    data = padded_rows(LENGTHS)
    first, second = minibatches(SETTINGS, len(LENGTHS))
    model, optimizer, stats = train(with_nan_advantage(data, [first[0]]))
    assert stats["nonfinite_steps"] == 1 and stats["steps"] == 1
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])  # means over the finite step

    ref_settings = LoopSettings(1, len(second), SETTINGS.micro_batch_size, SETTINGS.grad_clip, SETTINGS.seed)
    ref_model, ref_optimizer, _ = train(subset(data, second), ref_settings)
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(ref_model.parameters(), policy().parameters()))
    assert moved > 1e-3  # the finite step did move the weights
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        got, want = optimizer.state[p], ref_optimizer.state[q]
        assert float(got["step"]) == float(want["step"]) == 1.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-8)


def test_an_update_without_a_finite_step_fails_and_changes_nothing():
    data = with_nan_advantage(padded_rows(LENGTHS), range(len(LENGTHS)))
    model, optimizer = policy(), None
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(model, 1e-2)
    with pytest.raises(NonFiniteUpdate, match=r"all 2 optimiser steps of this update had a non-finite loss or "
                                              r"gradient norm \(first: step 0, loss nan"):
        run_update(model, optimizer, data, actor_loss_fn(PolicyLossConfig(), 1.0), SETTINGS, CPU)
    for k, v in model.state_dict().items():
        assert torch.equal(v, start[k]), k
    assert not optimizer.state  # AdamW never stepped: no moments, no step count


def test_an_infinite_gradient_is_skipped_too():
    """A finite loss whose gradient overflows (a huge advantage) is no step either."""
    data = padded_rows(LENGTHS)
    first, _ = minibatches(SETTINGS, len(LENGTHS))
    adv = data.adv.clone()
    adv[first[0], 0] = 3e38
    _, _, stats = train(data._replace(adv=adv))
    assert stats["nonfinite_steps"] == 1 and stats["steps"] == 1
