"""Reward functions in worker processes: found from the launch directory and ``reward.module_paths``,
stopped at their time limit with the function and samples named, restarted after, weighted."""

import os
import time

import numpy as np
import pytest

from models.rewards.sources import FunctionRewards, function_names
from models.rewards.workers import RewardTimeout, chunk_bounds, score_function
from models.rewards import RewardError

pytestmark = pytest.mark.integration  # every test starts reward worker processes

USER_MODULE = '''
import os, sys, time

def match(prompts, responses, answer):
    return [float(r == a) for r, a in zip(responses, answer)]

def pid(prompts, responses):
    print("scoring in", os.getpid())  # a user's prints must not disturb the protocol
    return [float(os.getpid())] * len(prompts)

def slow_on(prompts, responses):
    if "slow" in responses:
        time.sleep(3600)
    return [1.0] * len(prompts)

def dies(prompts, responses):
    os._exit(3)
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's folder holding ``myrewards.py``, as the working directory (not on this process's path)."""
    (tmp_path / "myrewards.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_module_in_the_working_directory_gets_its_columns(user_dir):
    with pytest.raises(ImportError):
        __import__("myrewards")  # this process cannot import it: the worker finds it on its own
    assert score_function("myrewards:match", ["q"] * 3, ["1", "2", "3"], {"answer": ["1", "x", "3"]},
                          timeout_s=60) == [1.0, 0.0, 1.0]


def test_module_paths_are_searched(tmp_path, monkeypatch):
    folder = tmp_path / "image-rewards"
    folder.mkdir()
    (folder / "imagerewards.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match="cannot import module 'imagerewards'"):
        score_function("imagerewards:match", ["q"], ["1"], {"answer": ["1"]}, timeout_s=60)
    assert score_function("imagerewards:match", ["q"], ["1"], {"answer": ["1"]}, timeout_s=60,
                          module_paths=[str(folder)]) == [1.0]


def test_chunks_run_in_parallel_workers_in_order(user_dir):
    pids = score_function("myrewards:pid", ["q"] * 5, ["r"] * 5, timeout_s=60, num_workers=2)
    assert len(set(pids)) == 2 and pids[0] == pids[2] != pids[3] == pids[4]  # chunks [0, 3) and [3, 5)
    assert os.getpid() not in pids
    assert chunk_bounds(5, 2) == [(0, 3), (3, 5)] and chunk_bounds(2, 4) == [(0, 1), (1, 2)]


def test_a_hanging_call_is_stopped_with_its_samples_named_and_the_worker_restarts(user_dir):
    score_function("myrewards:slow_on", ["q"] * 4, ["a"] * 4, timeout_s=60, num_workers=2)  # workers up
    t0 = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"reward 'myrewards:slow_on' did not return within 2 s on samples 2-3 "
                                            r"of a batch of 4; its worker process was stopped"):
        score_function("myrewards:slow_on", ["q"] * 4, ["a", "b", "c", "slow"], timeout_s=2, num_workers=2)
    assert time.monotonic() - t0 < 30
    assert score_function("myrewards:slow_on", ["q"] * 4, ["a"] * 4, timeout_s=60, num_workers=2) == [1.0] * 4


def test_a_dying_worker_is_reported(user_dir):
    with pytest.raises(RewardError, match=r"reward 'myrewards:dies': its worker process died \(exit code 3\) while "
                                          r"scoring samples 0-1 of a batch of 2"):
        score_function("myrewards:dies", ["q"] * 2, ["a"] * 2, timeout_s=60)


def test_weighted_functions_and_their_names(user_dir):
    rewards = FunctionRewards(["myrewards:match", "tests.reward_fns:answer_length", "tests.reward_fns:answer_length"],
                              weights=[1.0, 0.5, -0.25], timeout_s=60)
    scores = rewards(["q", "q"], ["7", "x"], columns={"answer": ["7", "123"], "level": [1, 2]})
    assert list(scores.parts) == ["match", "answer_length", "answer_length_2"]
    np.testing.assert_allclose(scores.parts["match"], [1.0, 0.0])
    np.testing.assert_allclose(scores.total, [1.0 + 0.25 * 1, 0.25 * 3])  # 1·match + (0.5 − 0.25)·len(answer)
    assert function_names(["a.b:score", "c:Judge.score", "d:other"]) == ["score", "score_2", "other"]


def test_trl_reward_functions_in_workers_get_messages_columns_and_token_ids():
    """TRL's own functions, a factory among them, in their keyword form; accuracy_reward's None (a
    solution it cannot parse) is skipped by the weighted sum and by its mean."""
    soft = "trl.rewards:get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)"
    rewards = FunctionRewards(["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward", soft],
                              weights=[1.0, 0.5, 1.0], timeout_s=120, num_workers=2)
    chat = [[{"role": "user", "content": "2 + 3?"}]] * 3
    scores = rewards(["p"] * 3, [r"\boxed{5}", r"<think>2+3</think>\boxed{5}", r"\boxed{4}"],
                     columns={"solution": ["5", r"\frac{", "5"]}, messages=chat,
                     completion_ids=[[1, 2], [1, 2, 3], [1, 2, 3, 4, 5]])
    assert list(scores.parts) == ["accuracy_reward", "think_format_reward", "get_soft_overlong_punishment"]
    np.testing.assert_allclose(scores.parts["accuracy_reward"], [1.0, np.nan, 0.0])
    np.testing.assert_allclose(scores.parts["get_soft_overlong_punishment"], [0.0, -0.5, -1.0])  # <=2, (2-3)/2, >4
    np.testing.assert_allclose(scores.total, [1.0, 0.5 - 0.5, -1.0])
    assert scores.part_means("reward/")["reward/accuracy_reward_mean"] == 0.5
