"""TRL's reward functions as they are: the installed ``trl`` package's own ``trl.rewards`` called in
TRL's keyword form (picked by the signature), factories named in the config, a ``None`` meaning "no
reward from this function", and signatures that fit no form refused naming the accepted ones."""

from __future__ import annotations

import numpy as np
import pytest
from trl.rewards import accuracy_reward, think_format_reward

from models.rewards.sources import function_names, weighted_total
from models.rewards import RewardError, compute_rewards, parse_spec, resolve_reward_fn
from models.rewards.signatures import column_params
from models.config import ConfigError, RewardConfig

CHAT = [[{"role": "user", "content": "Ava has 2 apples and finds 3 more. How many apples does Ava have now?"}]] * 3
RESPONSES = [r"2 + 3 = 5. The answer is \boxed{5}.", r"<think>2 + 3</think> The answer is \boxed{6}.",
             r"<think>two plus three</think>\boxed{5}"]


def test_trl_accuracy_and_think_format_rewards_get_messages_and_the_solution_column():
    solution = ["5", "5", "5"]
    acc = compute_rewards(accuracy_reward, ["p"] * 3, RESPONSES, columns={"solution": solution, "level": [1, 2, 3]},
                          messages=CHAT)
    assert acc == [1.0, 0.0, 1.0]  # boxed 5, boxed 6, boxed 5: worked by hand
    fmt = compute_rewards(think_format_reward, ["p"] * 3, RESPONSES, messages=CHAT)
    assert fmt == [0.0, 1.0, 1.0]  # the two that open with <think>...</think>
    # what TRL's GRPOTrainer passes the same functions gives the same numbers
    completions = [[{"role": "assistant", "content": r}] for r in RESPONSES]
    assert accuracy_reward(prompts=CHAT, completions=completions, completion_ids=[[]] * 3, solution=solution) == acc


def test_a_solution_trl_cannot_parse_gives_none_and_the_weighted_sum_skips_it(capsys):
    acc = compute_rewards(accuracy_reward, ["p"] * 2, [r"\boxed{5}"] * 2, columns={"solution": ["5", r"\frac{"]},
                          messages=CHAT[:2])
    assert acc == [1.0, None]
    fmt = compute_rewards(think_format_reward, ["p"] * 2, ["<think>x</think>5", "5"], messages=CHAT[:2])
    scores = weighted_total({"acc": np.array([1.0, np.nan]), "fmt": np.array(fmt)}, [1.0, 0.5], 2)
    np.testing.assert_allclose(scores.total, [1.5, 0.0])  # sample 1: only fmt's 0.5 · 0.0
    assert scores.part_means("reward/") == {"reward/acc_mean": 1.0, "reward/fmt_mean": 0.5}  # acc over what it scored
    assert "WARNING" not in capsys.readouterr().out
    alone = weighted_total({"acc": np.array([1.0, np.nan])}, [2.0], 2)
    np.testing.assert_allclose(alone.total, [2.0, 0.0])
    assert "every reward function returned None for 1 of 2 samples (first: sample 1)" in capsys.readouterr().out
    assert alone.part_means("eval/") == {"eval/acc_mean": 1.0}


def test_factories_are_named_in_the_config_with_literal_arguments():
    spec = "trl.rewards:get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)"
    assert RewardConfig(function=spec).specs == [spec]
    assert function_names([spec, "trl.rewards:accuracy_reward"]) == ["get_soft_overlong_punishment", "accuracy_reward"]
    ids = [[7] * 5, [7] * 8, [7] * 12]  # <= 10 - 4: 0; (6 - 8) / 4; > 10: -1 (DAPO Eq. 13)
    assert compute_rewards(resolve_reward_fn(spec), ["p"] * 3, ["a"] * 3, completion_ids=ids) == [0.0, -0.5, -1.0]
    rep = resolve_reward_fn("trl.rewards:get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)")
    # 2-grams of 1,2,1,2,1,2: 5, of which 2 distinct: -(1 - 2/5); all distinct: 0
    assert compute_rewards(rep, ["p"] * 2, ["a", "b"], completion_ids=[[1, 2] * 3, [1, 2, 3, 4]]) == \
        [pytest.approx(-0.6), 0.0]


@pytest.mark.parametrize("spec, match", [
    ("trl.rewards:get_soft_overlong_punishment(max_completion_len=n)", "must be Python literals"),
    ("trl.rewards:get_soft_overlong_punishment(max_completion_len=)", "do not parse"),
    ("trl.rewards:get_soft_overlong_punishment(**{'a': 1})", "write the factory's arguments as"),
    ("trl.rewards.accuracy_reward", "must look like 'package.module:function' or 'package.module:factory"),
    ("trl.rewards:get_soft_overlong_punishment(max_completion_len=256", "in a YAML flow list .* quote the spec"),
])
def test_a_malformed_factory_spec_is_a_config_error(spec, match):
    with pytest.raises(ConfigError, match=match):
        RewardConfig(function=spec)
    with pytest.raises(RewardError, match=match):
        parse_spec(spec)


def test_a_factory_that_raises_or_returns_no_function_names_the_spec():
    with pytest.raises(RewardError, match=r"the factory get_soft_overlong_punishment raised TypeError"):
        resolve_reward_fn("trl.rewards:get_soft_overlong_punishment(max_len=3)")
    with pytest.raises(RewardError, match=r"the factory dumps returned a str, not a reward function"):
        resolve_reward_fn("json:dumps(3)")


def keyword_only(completions, **kwargs):
    return [float(len(c)) for c in completions]


def kwargs_only(**kwargs):
    return [float(len(kwargs["completion_ids"][i])) + len(kwargs["answer"][i]) for i in range(len(kwargs["prompts"]))]


def named_trl_inputs(prompts, completions, answer):
    return [float(p == "q" and c == a) for p, c, a in zip(prompts, completions, answer)]


def test_the_form_is_picked_by_the_signature_and_text_prompts_stay_text():
    assert column_params(keyword_only).keyword and column_params(kwargs_only).keyword
    assert compute_rewards(keyword_only, ["q", "q"], ["ab", ""]) == [2.0, 0.0]  # text data: completions are texts
    assert compute_rewards(kwargs_only, ["q"], ["x"], columns={"answer": ["abc"]}, completion_ids=[[1, 2]]) == [5.0]
    assert compute_rewards(named_trl_inputs, ["q", "q"], ["4", "5"], columns={"answer": ["4", "4"]}) == [1.0, 0.0]
    positional = column_params(lambda p, r, answer=None: [0.0] * len(p))
    assert not positional.keyword and positional.named == ["answer"]


def no_form(responses):
    return [0.0] * len(responses)


def needs_state(completions, trainer_state, **kwargs):
    return [float(trainer_state.global_step)] * len(completions)


def test_signatures_that_fit_no_form_name_the_accepted_ones():
    with pytest.raises(RewardError, match=r"reward 'x:no_form'\(responses\) fits no accepted form: "
                                          r"fn\(prompts, responses, \*\*columns\) .* TRL's keyword form"):
        compute_rewards(no_form, ["q"], ["r"], spec="x:no_form")
    with pytest.raises(RewardError, match=r"requires \['trainer_state'\], TRL trainer object\(s\) this trainer does "
                                          r"not pass; give the parameter\(s\) a default"):
        compute_rewards(needs_state, ["q"], ["r"])
    with pytest.raises(RewardError, match=r"takes \['solution'\], which the prompt data does not have"):
        compute_rewards(accuracy_reward, ["q"], ["r"], columns={"answer": ["1"]})


def test_none_is_no_reward_only_in_trl_form():
    assert compute_rewards(lambda completions, **kw: [None, 1], ["q"] * 2, ["a"] * 2) == [None, 1.0]
    with pytest.raises(RewardError, match=r"sample 0 got None"):
        compute_rewards(lambda p, r: [None, 1], ["q"] * 2, ["a"] * 2)
