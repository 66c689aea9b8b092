"""Reversal task: prompt format, generator determinism and split disjointness, reward values."""

import json
import re

import pytest

from models.demos.reverse_task import (
    PromptGenerator,
    ReverseTaskConfig,
    ideal_response,
    parse_prompt,
    read_prompts_jsonl,
    reversal_score,
    reverse_reward,
    split_of,
    write_prompts_jsonl,
)

CFG = ReverseTaskConfig()


def test_config_checks():
    with pytest.raises(ValueError, match="min_len"):
        ReverseTaskConfig(min_len=5, max_len=4)
    with pytest.raises(ValueError, match="min_len"):
        ReverseTaskConfig(min_len=0)
    with pytest.raises(ValueError, match="distinct"):
        ReverseTaskConfig(letters="aab")
    with pytest.raises(ValueError, match="separator"):
        ReverseTaskConfig(letters="ab=")
    with pytest.raises(ValueError, match="eval_fraction"):
        ReverseTaskConfig(eval_fraction=1.0)
    assert CFG.max_new_tokens == 7  # 6 characters + <eos>


def test_prompt_format():
    prompts = PromptGenerator(CFG, "train", seed=0).prompts(200)
    assert all(re.fullmatch(r"[a-z]{3,6}=", p) for p in prompts)
    assert {len(p) - 1 for p in prompts} == {3, 4, 5, 6}
    assert parse_prompt("abcd=") == "abcd"
    assert ideal_response("abcd=") == "dcba"
    for bad in ["abcd", "ab=cd=", ""]:
        with pytest.raises(ValueError, match="prompt must be"):
            parse_prompt(bad)


def test_generator_is_deterministic_per_seed():
    a = PromptGenerator(CFG, "train", seed=3).prompts(50)
    b = PromptGenerator(CFG, "train", seed=3).prompts(50)
    c = PromptGenerator(CFG, "train", seed=4).prompts(50)
    assert a == b
    assert a != c
    # a stream continues where it left off rather than restarting
    gen = PromptGenerator(CFG, "train", seed=3)
    assert gen.prompts(20) + gen.prompts(30) == a


def test_train_and_eval_are_disjoint_for_any_seeds():
    streams = {seed: PromptGenerator(CFG, "train", seed).prompts(2000) for seed in range(3)}
    train = set().union(*streams.values())
    evals = {p for seed in range(3) for p in PromptGenerator(CFG, "eval", seed).prompts(500)}
    assert train.isdisjoint(evals)
    assert all(split_of(parse_prompt(p), CFG.eval_fraction) == "eval" for p in evals)
    # streams of different seeds do share strings, so seeds alone would not keep splits apart
    assert set(streams[0]) & set(streams[1])


def test_split_assignment_matches_eval_fraction():
    sources = [f"s{i}" for i in range(4000)]
    share = sum(split_of(s, 0.1) == "eval" for s in sources) / len(sources)
    assert 0.08 < share < 0.12  # binomial sd 0.005
    assert split_of("abc", 0.1) == split_of("abc", 0.1)


def test_demonstrations_score_one():
    demos = PromptGenerator(CFG, "eval", seed=0).demonstrations(20)
    prompts, responses = zip(*demos)
    assert all(r == p[:-1][::-1] for p, r in demos)
    assert reverse_reward(list(prompts), list(responses)) == [1.0] * 20


@pytest.mark.parametrize(
    "response, expected",
    [
        ("dcba", 1.0),  # exact
        ("dcxx", 0.5),  # half the positions right
        ("", 0.0),  # empty
        ("abcd", 0.0),  # copied instead of reversed: no position matches
        ("dcb", 0.75),  # one character short: 3 / 4
        ("dcbaa", 0.8),  # one extra character: 4 / 5
        ("xdcba", 0.0),  # shifted by one
        ("dcbadcba", 0.5),  # 4 matches over length 8
        ("DCBA", 0.0),  # case matters
    ],
)
def test_reward_hand_worked_values(response, expected):
    assert reverse_reward(["abcd="], [response]) == [pytest.approx(expected)]


def test_reward_batch_and_errors():
    assert reverse_reward(["abc=", "xy="], ["cba", "yy"]) == [1.0, 0.5]
    assert reversal_score("", "") == 1.0
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        reverse_reward(["abc=", "xy="], ["cba"])
    with pytest.raises(ValueError, match="prompt must be"):
        reverse_reward(["abc"], ["cba"])


def test_jsonl_round_trip(tmp_path):
    prompts = PromptGenerator(CFG, "eval", seed=1).prompts(5) + ['with "quotes" and \\ =']
    path = write_prompts_jsonl(tmp_path / "sub" / "p.jsonl", prompts)
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"prompt": p} for p in prompts]
    assert read_prompts_jsonl(path) == prompts


def test_read_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ab="}\n\n{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3"):
        read_prompts_jsonl(path)
