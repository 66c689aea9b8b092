"""``score_ranks`` (``actor.score_on_ranks``) as a real 2-process elastic launch (local execution, gloo,
``actor.sharding=fsdp2``: π_old, π_ref and the critic read by shard) against the one-process score of the same
rollout, the rewards from the tiny reward model (``reward.source=model``, its forwards on the ranks too): rank 0
writes the same score batch. Tolerance: 1e-5 absolute (float32 on CPU, the same micro-batches for the
log-probs and values; only the matmuls' thread count, and the reward model's micro-batches, differ)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flytekit import task

from models.config.io import config_from_json_dict, to_dict
from models.data import ragged
from models.stages.rollout import run_rollout
from models.stages.score import run_score
from tasks.deploy import elastic_for
from tasks.score import score_ranks
from tests.integration.test_sharded_actor_update import OVERRIDES
from tests.stages import tiny_run, with_overrides

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COLUMNS = ("old_logprobs", "ref_logprobs", "values")


def flat(batch, column: str) -> np.ndarray:
    return ragged.offsets_and_values(batch.column(column))[1].astype(np.float32)


def reward_model(root) -> str:
    """The tiny reward model, committed under ``root``: its URL."""
    from models.checkpoint import save_checkpoint
    from models.demos.tiny import TinyModelConfig, build_reward_model, save_model
    from models.demos.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    url = str(root / "rm")
    save_checkpoint(str(save_model(build_reward_model(TinyModelConfig(), tok), tok, root / "rm-src")), url)
    return url


def held_reward_model_scores(cfg, run, state, rollout, monkeypatch) -> dict:
    """The one-process score with the reward model made once beforehand, as a resident actor service holds it
    (``Scorers.rewards``): no reward source is made for the batch."""
    from models.stages import rewards
    from models.stages.score import Scorers, load_scorers

    source = rewards.reward_source(cfg, run)
    with monkeypatch.context() as m:
        m.setattr(rewards, "reward_source", lambda *a: pytest.fail("the reward model was loaded again"))
        out = run_score(cfg, run, state, rollout, load_scorers(cfg, run, state)._replace(rewards=source)).batch
    return {c: out.column(c).to_numpy() for c in ("reward", "reward_raw")}


def test_two_ranks_write_the_score_batch_one_process_writes(tmp_path, monkeypatch):
    with tiny_run(tmp_path, "tiny_ppo", OVERRIDES, "sharded-score", local_cache=False) as setup:
        rm = reward_model(tmp_path)
        data = to_dict(setup.cfg)
        data["reward"].update(source="model", model_path=rm)
        cfg = config_from_json_dict(data)
        run, state = dataclasses.replace(setup.run, reward_model_url=rm), setup.state
        rollout = run_rollout(cfg, run, state).batch
        one = run_score(cfg, run, state, rollout).batch  # read before the launch writes the same file again
        want = {c: flat(one, c) for c in COLUMNS} | {c: one.column(c).to_numpy() for c in ("reward", "reward_raw")}
        held = held_reward_model_scores(cfg, run, state, rollout, monkeypatch)
        cfg = with_overrides(cfg, "actor.score_on_ranks=true", "actor.sharding=fsdp2")
        launch = task(task_config=elastic_for(cfg, local=True))(score_ranks.task_function)
        out = launch(cfg=cfg, run=run, state=state, batch=rollout)
    assert out.batch.uri == one.uri and out.stats["time/score_load_s"] > 0
    for c in COLUMNS:
        assert np.ptp(want[c]) > 1e-3, c  # distinct per token: a misplaced row would show
        np.testing.assert_allclose(flat(out.batch, c), want[c], rtol=0, atol=1e-5, err_msg=c)
    for c in ("reward", "reward_raw"):
        assert np.ptp(want[c]) > 1e-3, c
        np.testing.assert_array_equal(held[c], want[c], err_msg=c)  # a held reward model: the same rewards
        np.testing.assert_allclose(out.batch.column(c).to_numpy(), want[c], rtol=0, atol=1e-5, err_msg=c)
