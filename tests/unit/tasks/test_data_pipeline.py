"""A user's GSM8K-like data on the realistic chat checkpoint, through the real task functions (HF
engine, one process): a non-default prompt column and a raw U+2028 set up and roll out (a file that
validates trains), chat-rendered prompts as the model sees them, every drawn prompt its own group,
the ``answer`` column in the batch, the reward functions, a reward that hangs, the evaluation and
MLflow's sample table; the running reward normalisation across a commit and a resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models.rewards.verifiers import math_reward
from models.data.batch_schema import decode_data_columns
from models.stages.evaluate import eval_rewards
from models.stages.commit import run_commit
from models.stages.samples import sample_table
from models.run.setup import setup_run
from tests.stages import tiny_run, to_advantages

pytestmark = pytest.mark.slow  # whole tasks on a tiny run, tens of seconds each (make test-unit leaves them to make test)

ROWS = [{"question": "Ava has 3 apples and buys 4 more. How many apples?", "answer": "#### 7", "level": 1},
        {"question": "Ben had 12 coins and lost 5. How many coins are left?", "answer": "#### 7", "level": 2},
        {"question": "Chen reads 2 books a day\u2028for 3 days. How many books?", "answer": "#### 6", "level": 1}]
"""GSM8K-like rows under a non-default prompt column; the last holds a raw U+2028 in its JSONL line
(validation and training once split such lines differently)."""
SYSTEM = "Answer with a number after ####."


def overrides(root, actor_dir, extra=()):
    train = root / "gsm.jsonl"
    train.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS), encoding="utf-8")
    assert "\u2028" in train.read_text(encoding="utf-8")
    return [f"model.actor_path={actor_dir}", f"data.train_prompts={train}", "data.prompt_column=question",
            "data.apply_chat_template=true", f"data.system_prompt='{SYSTEM}'", "run.algorithm=grpo",
            "reward.functions=[tests.reward_fns:answer_length, models.rewards.verifiers:math_reward]",
            "reward.weights=[0.1, 1.0]", "rollout.engine=hf", "rollout.prompts_per_iteration=8",
            "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=6", "actor.minibatch_size=16",
            "actor.micro_batch_size=8", "actor.nproc_per_node=1", "run.num_iterations=2", *extra]


@pytest.fixture(scope="module")
def chat_actor(tmp_path_factory, qwen2_chat_dir):
    """The Qwen2 chat checkpoint without LICENSE and .gitattributes, which checkpoint copies refuse
    until issue #16's checkpoint change lands."""
    import shutil

    out = tmp_path_factory.mktemp("actor") / "qwen2-chat"
    shutil.copytree(qwen2_chat_dir, out, ignore=shutil.ignore_patterns("LICENSE", ".gitattributes"))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory, chat_actor):
    root = tmp_path_factory.mktemp("gsm")
    with tiny_run(root, "tiny_grpo", overrides(root, chat_actor), "gsm") as setup:
        yield (setup, *to_advantages(*setup))


def test_prompts_are_the_chat_template_tokens_and_groups_are_draws(run, chat_actor):
    from transformers import AutoTokenizer

    setup, ro, _, _ = run
    tok = AutoTokenizer.from_pretrained(chat_actor)
    b = ro.batch
    rows = b.column("row_id").to_pylist()
    for prompt_tokens, text, row in zip(b.column("prompt_tokens").to_pylist(), b.column("prompt").to_pylist(), rows):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ROWS[row]["question"]}]
        want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        assert prompt_tokens == list(want["input_ids"])  # what the model saw, no token added in front
        assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = b.column("prompt_id").to_pylist()
    assert ids == [i for i in range(8) for _ in range(2)]  # 8 draws from 3 rows: 8 groups of exactly 2
    assert sorted(set(rows)) == [0, 1, 2] and len(rows) == 16  # rows repeat across groups, ids do not
    cols = decode_data_columns(b.column("data_columns").to_pylist())
    assert cols == {"answer": [ROWS[r]["answer"] for r in rows], "level": [ROWS[r]["level"] for r in rows]}


def test_rewards_get_the_answer_column(run):
    _, _, sc, _ = run
    b = sc.batch
    answers = decode_data_columns(b.column("data_columns").to_pylist())["answer"]
    responses = b.column("response").to_pylist()
    math = np.asarray(math_reward([""] * len(responses), responses, answers))
    want = 0.1 * np.array([len(a) for a in answers]) + math  # 0.1·len(answer) + math_reward, by hand
    np.testing.assert_allclose(b.column("reward_raw").to_numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(b.column("reward").to_numpy(), want, rtol=1e-6)  # no scaling configured
    assert sc.stats["reward/answer_length_mean"] == pytest.approx(6.0)  # every answer is "#### n"
    assert sc.stats["reward/math_reward_mean"] == pytest.approx(math.mean())
    assert sc.stats["rollout/reward_mean"] == pytest.approx(want.mean())


def test_sample_table_and_evaluation_show_the_columns(run):
    setup, _, sc, _ = run
    table = sample_table(sc.batch, 4)
    assert table["answer"] == decode_data_columns(sc.batch.column("data_columns").to_pylist())["answer"][:4]
    assert table["row_id"] == sc.batch.column("row_id").to_pylist()[:4] and len(table["level"]) == 4
    assert table["prompt"][0].startswith("<|im_start|>system\n" + SYSTEM)
    metrics = eval_rewards(setup.cfg, setup.run, setup.state.actor_url)
    assert set(metrics) == {"eval/reward_mean", "eval/answer_length_mean", "eval/math_reward_mean"}
    assert metrics["eval/answer_length_mean"] == pytest.approx(6.0)  # held-out = training prompts here


def test_a_reward_that_hangs_in_score_fails_the_task_naming_it(run):
    """It used to hang the run forever; now the score task fails after reward.timeout_s, naming the
    function and the samples of the first worker that did not answer."""
    import time

    from models.rewards.workers import RewardTimeout
    from models.stages.score import run_score
    from tests.stages import with_overrides

    setup, ro, _, _ = run
    cfg = with_overrides(setup.cfg, "reward.weights=[]", "reward.functions=[tests.reward_fns:hang_unless_empty]",
                         "reward.timeout_s=3", "reward.num_workers=2")
    t0 = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"reward 'tests\.reward_fns:hang_unless_empty' did not return within 3 s "
                                            r"on samples 0-7 of a batch of 16"):
        run_score(cfg, setup.run, setup.state, ro.batch)
    assert time.monotonic() - t0 < 120


def test_running_normalisation_survives_commit_and_resume(tmp_path, chat_actor):
    """Iteration 1 of a resumed run normalises with the moments of iterations 0 and 1's raw rewards."""
    from models.stages.rollout import run_rollout
    from models.stages.score import run_score

    extra = ["reward.normalize=true", "reward.scale=2.0", "reward.clip=3.0"]
    with tiny_run(tmp_path, "tiny_grpo", overrides(tmp_path, chat_actor, extra), "norm") as (cfg, run, state):
        sc0 = run_score(cfg, run, state, run_rollout(cfg, run, state).batch)
        raw0 = sc0.batch.column("reward_raw").to_numpy().astype(np.float64)
        run_commit(cfg, run, state, [sc0.stats], sc0.batch, state.actor_url, "")
        assert run.layout.read_state().extras["reward_norm"]["count"] == raw0.size
        resumed = setup_run("tiny_grpo", [f"run.storage_root={tmp_path}"] + overrides(tmp_path, chat_actor, extra),
                            "norm")
        assert resumed.state.iteration == 1 and resumed.state.reward_norm["count"] == raw0.size
        sc1 = run_score(cfg, run, resumed.state, run_rollout(cfg, run, resumed.state).batch)
    raw = np.concatenate([raw0, sc1.batch.column("reward_raw").to_numpy().astype(np.float64)])
    expect = np.clip(2.0 * (raw[raw0.size:] - raw.mean()) / max(raw.std(), 1e-8), -3.0, 3.0)
    np.testing.assert_allclose(sc1.batch.column("reward").to_numpy(), expect, rtol=1e-5, atol=1e-6)
    assert sc1.stats["reward/norm_mean"] == pytest.approx(raw.mean())
