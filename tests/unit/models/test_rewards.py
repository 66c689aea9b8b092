"""Reward plug-ins: spec resolution and result validation, with errors that name the culprit."""

import math
import re

import numpy as np
import pytest
import torch

from models.rewards import RewardError, RewardSource, compute_rewards, resolve_reward_fn
from models.demos.reverse_task import reverse_reward

HERE = "tests.unit.models.test_rewards"
NOT_CALLABLE = 3.0


def length_reward(prompts, responses):
    """Plug-in defined in the test module: response length."""
    return [len(r) for r in responses]


def fails_on_boom(prompts, responses):
    if "boom" in responses:
        raise KeyError("boom")
    return [0.0] * len(responses)


class Scorer:
    @staticmethod
    def score(prompts, responses):
        return [1.0] * len(prompts)


def test_resolve_the_task_reward_and_a_test_module_function():
    assert resolve_reward_fn("models.demos.reverse_task:reverse_reward") is reverse_reward
    fn = resolve_reward_fn(f"{HERE}:length_reward")
    assert compute_rewards(fn, ["a=", "b="], ["xyz", ""]) == [3.0, 0.0]
    assert resolve_reward_fn(f"{HERE}:Scorer.score")(["p"], ["r"]) == [1.0]


def test_functions_satisfy_the_protocol():
    assert isinstance(reverse_reward, RewardSource)
    assert not isinstance(NOT_CALLABLE, RewardSource)


@pytest.mark.parametrize("spec", ["models.demos.reverse_task.reverse_reward", "a:b:c", ":fn", "models.demos.reverse_task:", "", None])
def test_malformed_spec(spec):
    with pytest.raises(RewardError, match="must look like 'package.module:function'"):
        resolve_reward_fn(spec)


def test_module_not_found():
    with pytest.raises(RewardError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward_fn("no_such_module_xyz:fn")


def test_attribute_missing():
    with pytest.raises(RewardError, match=f"module '{HERE}' has no attribute 'missing_fn'"):
        resolve_reward_fn(f"{HERE}:missing_fn")


def test_not_callable():
    with pytest.raises(RewardError, match="'NOT_CALLABLE' is a float, not callable"):
        resolve_reward_fn(f"{HERE}:NOT_CALLABLE")


def test_valid_results_become_floats():
    out = compute_rewards(lambda p, r: [1, 0.5, np.float32(0.25)], ["a"] * 3, ["b"] * 3)
    assert out == [1.0, 0.5, 0.25] and all(type(x) is float for x in out)
    assert compute_rewards(lambda p, r: torch.tensor([0.5, 2.0]), ["a"] * 2, ["b"] * 2) == [0.5, 2.0]
    assert compute_rewards(lambda p, r: np.array([-1.0]), ["a"], ["b"]) == [-1.0]
    assert compute_rewards(reverse_reward, ["abc=", "abc="], ["cba", "c"]) == [1.0, pytest.approx(1 / 3)]


def test_wrong_length_names_the_spec():
    with pytest.raises(RewardError, match=r"reward 'my:spec' returned 2 values for 3 samples"):
        compute_rewards(lambda p, r: [0.0, 0.0], ["a"] * 3, ["b"] * 3, spec="my:spec")


def test_input_length_mismatch():
    with pytest.raises(RewardError, match="2 prompts but 1 responses"):
        compute_rewards(reverse_reward, ["a=", "b="], ["a"])


@pytest.mark.parametrize(
    "bad, match",
    [
        ("0.5", r"sample 2 got '0.5' \(str\), expected a real number"),
        (None, r"sample 2 got None"),
        (True, r"sample 2 got True \(bool\)"),
        ([1.0], r"sample 2 got \[1.0\] \(list\)"),
        (math.nan, r"sample 2 got non-finite value nan"),
        (-math.inf, r"sample 2 got non-finite value -inf"),
    ],
)
def test_invalid_value_names_the_sample(bad, match):
    fn = lambda p, r: [0.0, 1.0, bad, 0.0]  # noqa: E731
    with pytest.raises(RewardError, match=match):
        compute_rewards(fn, ["a"] * 4, ["b"] * 4, spec="x:y")


def test_non_sequence_result():
    with pytest.raises(RewardError, match="returned float, expected a list of floats"):
        compute_rewards(lambda p, r: 1.0, ["a"], ["b"])


def test_raising_function_names_spec_and_first_failing_sample():
    fn = resolve_reward_fn(f"{HERE}:fails_on_boom")
    with pytest.raises(RewardError) as info:
        compute_rewards(fn, ["a", "b", "c"], ["ok", "boom", "boom"])
    msg = str(info.value)
    assert f"'{HERE}:fails_on_boom'" in msg  # default name from the function itself
    assert "first failing sample: 1" in msg and "KeyError" in msg
    assert isinstance(info.value.__cause__, KeyError)


def test_task_reward_on_malformed_prompt_is_a_reward_error():
    with pytest.raises(RewardError, match=r"'models.demos.reverse_task:reverse_reward'.*first failing sample: 1"):
        compute_rewards(reverse_reward, ["ab=", "no separator"], ["ba", "x"], spec="models.demos.reverse_task:reverse_reward")


# --- data columns (TRL's convention) -------------------------------------------------------------------
def with_answer(prompts, responses, answer):
    return [float(r == a) for r, a in zip(responses, answer)]


def with_kwargs(prompts, responses, **columns):
    return [float(len(columns))] * len(prompts)


def with_default(prompts, responses, answer, bonus=0.5, *, format_pattern="x"):
    return [float(r == a) + bonus + len(format_pattern) for r, a in zip(responses, answer)]


COLUMNS = {"answer": ["4", "5"], "level": [1, 2]}


def test_columns_reach_the_function_that_names_them():
    assert compute_rewards(with_answer, ["2+2", "2+3"], ["4", "6"], columns=COLUMNS) == [1.0, 0.0]
    assert compute_rewards(with_kwargs, ["a", "b"], ["x", "y"], columns=COLUMNS) == [2.0, 2.0]  # all of them
    assert compute_rewards(length_reward, ["a", "b"], ["xy", ""], columns=COLUMNS) == [2.0, 0.0]  # two-argument form
    # a parameter with a default that is no column keeps its default; an option reaches it by name
    assert compute_rewards(with_default, ["a", "b"], ["4", "x"], columns=COLUMNS) == [2.5, 1.5]
    assert compute_rewards(with_default, ["a", "b"], ["4", "x"], columns=COLUMNS,
                           options={"format_pattern": "abc"}) == [4.5, 3.5]


def test_a_missing_column_names_the_parameter_and_the_columns():
    with pytest.raises(RewardError, match=r"reward 'x:y' takes \['answer'\], which the prompt data does not have "
                                          r"as column\(s\) \(its columns: \['level'\]\)"):
        compute_rewards(with_answer, ["a"], ["b"], spec="x:y", columns={"level": [1]})


def test_failing_sample_search_slices_the_columns():
    def picky(prompts, responses, answer):
        if "bad" in answer:
            raise ValueError("cannot parse")
        return [0.0] * len(prompts)

    with pytest.raises(RewardError, match=r"first failing sample: 12\).*ValueError"):
        compute_rewards(picky, ["p"] * 3, ["r"] * 3, columns={"answer": ["ok", "bad", "ok"]}, offset=11)


@pytest.mark.parametrize("bad, what", [("0.5", "str '0.5'"), (b"1", "bytes b'1'"), ({"a": 1.0}, "dict {'a': 1.0}")])
def test_a_string_or_mapping_result_is_named_as_such(bad, what):
    """A string is iterable: it used to be read as one value per character ("returned 3 values for 4 samples")."""
    with pytest.raises(RewardError, match=rf"reward 'x:y' returned {re.escape(what)}, expected a list of 4 floats "
                                          r"\(one per sample\)"):
        compute_rewards(lambda p, r: bad, ["a"] * 4, ["b"] * 4, spec="x:y")


def test_a_spec_naming_a_module_by_its_old_path_still_resolves():
    """Configs written before models/ was grouped by concept keep working (models.rewards.MOVED_MODULES)."""
    from models.demos import reverse_task, tool_tasks
    from models.rewards import resolve_reward_fn, verifiers

    assert resolve_reward_fn("models.task:reverse_reward") is reverse_task.reverse_reward
    assert resolve_reward_fn("models.verifiers:math_reward") is verifiers.math_reward
    assert resolve_reward_fn("models.tool_tasks:called_tool_correctly") is tool_tasks.called_tool_correctly
    with pytest.raises(RewardError, match="cannot import module 'models.no_such_module'"):
        resolve_reward_fn("models.no_such_module:f")
