"""An iteration whose update takes no optimiser step (every advantage zero: GRPO with a constant reward)
carries AdamW's moments on unchanged: moments after (step, no step, step) are those after (step, step),
bit for bit, through the save and load every iteration's update process does (models/training/optimizer_carry.py); and an
iteration without a step before any step leaves the next one a fresh AdamW, not a state that "does not fit
this model (63 entries missing)"."""

from __future__ import annotations

import torch

from kernels.losses import PolicyLossConfig
from models.training.distributed import DistInfo
from models.training.update import LoopSettings, actor_loss_fn, run_update
from models.training.optimizer_carry import carried_optimizer, commit_optimizer
from tests.unit.models.test_sharded_update import LENGTHS, policy
from tests.unit.models.update_rows import padded_rows

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
SETTINGS = LoopSettings(epochs=1, minibatch_size=4, micro_batch_size=2, grad_clip=1.0, seed=5)


def iterations(root, advantages_zero, capsys=None):
    """Each entry one iteration's update process: AdamW from the state committed beside the previous
    checkpoint, ``run_update``, the state committed beside the new one. Returns the model, the last
    optimizer and the steps each update took."""
    model, data, taken, prev = policy(), padded_rows(LENGTHS), [], ""
    for i, zero in enumerate(advantages_zero):
        times = {}
        optimizer, _ = carried_optimizer(model, 1e-2, 0.0, prev, True, times, "actor", CPU)
        d = data._replace(adv=torch.zeros_like(data.adv)) if zero else data
        stats = run_update(model, optimizer, d, actor_loss_fn(PolicyLossConfig(), 1.0), SETTINGS, CPU)
        taken.append(int(stats["steps"]))
        prev = str(root / f"iter-{i:06d}" / "actor")
        commit_optimizer(model, optimizer, prev, True, times, "actor", CPU)
    return model, optimizer, taken


def moments(model, optimizer):
    return {(name, key): optimizer.state[p][key].clone() for name, p in model.named_parameters()
            for key in ("exp_avg", "exp_avg_sq", "step")}


def test_a_no_step_iteration_leaves_the_moments_to_the_next(tmp_path, capsys):
    model, opt, taken = iterations(tmp_path / "a", [False, True, False])
    ref_model, ref_opt, ref_taken = iterations(tmp_path / "b", [False, False])
    assert taken == [2, 0, 2] and ref_taken == [2, 2]
    got, want = moments(model, opt), moments(ref_model, ref_opt)
    assert float(want[("lm.model.norm.weight", "step")]) == 4.0  # the moments of four steps
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert "does not fit" not in capsys.readouterr().out


def test_a_first_iteration_without_a_step_starts_the_next_from_zero_quietly(tmp_path, capsys):
    """No step yet: the next iteration's AdamW is a fresh one, without a 'does not fit' notice."""
    model, opt, taken = iterations(tmp_path / "a", [True, False])
    ref_model, ref_opt, _ = iterations(tmp_path / "b", [False])
    assert taken == [0, 2]
    got, want = moments(model, opt), moments(ref_model, ref_opt)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert "does not fit" not in capsys.readouterr().out
