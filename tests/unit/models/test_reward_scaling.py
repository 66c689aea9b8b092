"""Reward normalisation, scale and clip against plain numpy, and the out-of-range warning."""

import json

import numpy as np
import pytest

from models.rewards.scaling import RunningMoments, out_of_range, shape_rewards


def test_running_moments_equal_the_moments_of_everything_seen():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=n) for n in (1, 7, 64, 5)]
    moments = RunningMoments()
    for b in batches:
        moments = moments.update(b)
    seen = np.concatenate(batches)
    assert moments.count == seen.size
    assert moments.mean == pytest.approx(seen.mean(), rel=1e-12)
    assert moments.std == pytest.approx(seen.std(), rel=1e-12)  # population std, as OpenRLHF's


def test_state_round_trips_through_json_exactly():
    moments = RunningMoments().update([0.1, 0.7, 1e6]).update([1 / 3])
    assert RunningMoments.from_dict(json.loads(json.dumps(moments.to_dict()))) == moments
    assert RunningMoments.from_dict({}) == RunningMoments()


def test_shape_rewards_by_hand():
    raw = [0.0, 2.0, 4.0]
    assert shape_rewards(raw).rewards.tolist() == raw  # defaults: the raw reward
    assert shape_rewards(raw, scale=0.5, clip=1.5).rewards.tolist() == [0.0, 1.0, 1.5]
    shaped = shape_rewards(raw, normalize=True)  # mean 2, std sqrt(8/3)
    np.testing.assert_allclose(shaped.rewards, np.array([-2.0, 0.0, 2.0]) / np.sqrt(8 / 3), rtol=1e-6)
    assert shaped.moments == RunningMoments(3.0, 2.0, 8.0)
    again = shape_rewards([2.0], normalize=True, moments=shaped.moments)  # the next batch: moments of all 4
    assert again.moments.mean == 2.0 and again.rewards.tolist() == [0.0]
    assert shape_rewards([5.0, 5.0], normalize=True).rewards.tolist() == [0.0, 0.0]  # constant: no division by 0


def test_out_of_range_warning_names_the_numbers_and_the_settings():
    assert out_of_range([0.0, 1.0, 10.0], (-10.0, 10.0)) is None
    msg = out_of_range([0.5, 1e6, -20.0, 1.0], (-10.0, 10.0))
    assert msg.startswith("2 of 4 raw rewards are outside reward.expected_range [-10, 10] (min -20, max 1e+06)")
    assert "reward.scale" in msg and "reward.clip" in msg and "reward.normalize" in msg


def test_score_warns_and_logs_when_raw_rewards_leave_the_expected_range(capsys):
    """Rewards up to 1e6 were trained on silently; now the score task says so and logs the share."""
    from models.rewards.sources import as_scores
    from models.config import TrainConfig
    from models.stages.rewards import shaped_rewards
    from models.run.types import PolicyState
    from tests.stages import with_overrides

    cfg = with_overrides(TrainConfig(), "reward.clip=5.0")
    shaped, stats = shaped_rewards(cfg, PolicyState(3, "a"), as_scores([0.5, 1e6, 2.0, -40.0], "judge"))
    out = capsys.readouterr().out
    assert "WARNING iteration 3: 2 of 4 raw rewards are outside reward.expected_range [-10, 10]" in out
    assert stats["reward/raw_out_of_range_frac"] == 0.5 and stats["reward/judge_mean"] == pytest.approx(249990.625)
    assert shaped.rewards.tolist() == [0.5, 5.0, 2.0, -5.0] and stats["reward/shaped_mean"] == 0.625
    _, quiet = shaped_rewards(TrainConfig(), PolicyState(0, "a"), as_scores([0.0, 1.0], "judge"))
    assert capsys.readouterr().out == "" and quiet["reward/raw_out_of_range_frac"] == 0.0
