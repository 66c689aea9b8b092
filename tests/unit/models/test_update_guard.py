"""The step guard (models/training/step_guard.py, ``actor.guard`` / ``critic.guard``): a step whose |loss| or gradient
norm is above its bound is skipped like a non-finite one (no step, AdamW's moments untouched), named on
the console and counted; an update that skipped more than ``max_skipped_fraction`` of its steps fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.losses import PolicyLossConfig
from models.training.update import DivergedUpdate, LoopSettings, actor_loss_fn, make_optimizer, run_update
from tests.unit.models.test_sharded_update import LENGTHS, policy
from tests.unit.models.test_update_finite import CPU, minibatches, subset, train
from tests.unit.models.update_rows import padded_rows

GUARDED = LoopSettings(epochs=1, minibatch_size=4, micro_batch_size=2, grad_clip=1.0, seed=5, max_loss=1e3,
                       max_grad_norm=1e5, max_skipped_fraction=0.5, role="actor")


def with_huge_advantages(data, rows, value: float = 1e5):
    """``data`` with advantage ``value`` on every response token of ``rows``: a loss of about -1e5."""
    adv = data.adv.clone()
    adv[list(rows)] = value * data.response_mask[list(rows)]
    return data._replace(adv=adv)


def test_a_step_above_the_loss_bound_is_skipped_named_and_counted(capsys):
    data = padded_rows(LENGTHS)
    first, second = minibatches(GUARDED, len(LENGTHS))
    model, optimizer, stats = train(with_huge_advantages(data, first), GUARDED)
    assert (stats["steps"], stats["skipped_steps"], stats["nonfinite_steps"]) == (1, 1, 0)
    assert abs(stats["loss"]) < 10  # the mean over the step taken
    lines = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert len(lines) == 1 and lines[0].startswith("[actor] step 0 skipped (loss -")
    assert "above actor.guard.max_loss=1000); weights and AdamW's moments unchanged" in lines[0]

    alone = dataclasses.replace(GUARDED, minibatch_size=len(second))  # what the one finite step does alone
    ref_model, ref_optimizer, _ = train(subset(data, second), alone)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert float(optimizer.state[p]["step"]) == float(ref_optimizer.state[q]["step"]) == 1.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer.state[p][key], ref_optimizer.state[q][key], rtol=1e-5, atol=1e-8)


def test_no_bound_means_the_same_step_is_taken():
    data = with_huge_advantages(padded_rows(LENGTHS), minibatches(GUARDED, len(LENGTHS))[0])
    _, _, stats = train(data, dataclasses.replace(GUARDED, max_loss=0.0, max_grad_norm=0.0))
    assert (stats["steps"], stats["skipped_steps"]) == (2, 0) and abs(stats["loss"]) > 1e3


def test_most_steps_skipped_fails_naming_the_counts_and_the_bound():
    """Every step's gradient norm is above a bound set below it: 2 of 2 skipped, the update fails and the
    model and AdamW are as they started."""
    model = policy()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(model, 1e-2)
    tight = dataclasses.replace(GUARDED, max_grad_norm=1e-6)
    with pytest.raises(DivergedUpdate, match=r"2 of 2 optimiser steps of this actor update were skipped, more than "
                                             r"actor.guard.max_skipped_fraction=0.5 \(0 non-finite, 0 with \|loss\| "
                                             r"above actor.guard.max_loss=1000, 2 with a gradient norm above "
                                             r"actor.guard.max_grad_norm=1e-06; first: step 0, loss "):
        run_update(model, optimizer, padded_rows(LENGTHS), actor_loss_fn(PolicyLossConfig(), 1.0), tight, CPU)
    assert not optimizer.state and all(torch.equal(v, start[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("fraction,fails", [(0.5, False), (0.25, True)])
def test_half_the_steps_skipped_is_not_most(fraction, fails):
    """Two epochs of two minibatches; one row's huge advantages spoil one minibatch per epoch: 2 of 4."""
    settings = dataclasses.replace(GUARDED, epochs=2, max_skipped_fraction=fraction)
    data = with_huge_advantages(padded_rows(LENGTHS), [0])
    if fails:
        with pytest.raises(DivergedUpdate,
                           match=r"^2 of 4 optimiser steps .* actor.guard.max_skipped_fraction=0.25 \("):
            train(data, settings)
    else:
        assert train(data, settings)[2]["skipped_steps"] == 2
