"""The math demo's problems and answers: hand-worked solutions, gold answers recomputed from the
question text, the verifiers' verdicts on right and wrong answers, disjoint splits."""

from __future__ import annotations

import re

import pytest

from models.demos.math_task import (ADD_TEMPLATES, FORMAT_PATTERN, MathTaskConfig, ProblemGenerator, solution,
                              write_rows_jsonl)
from models.rewards.verifiers import format_reward, math_reward

CFG = MathTaskConfig(max_number=12)


def test_solution_hand_worked():
    assert solution(12, 7, "+") == ("12 + 7 = 19. The answer is \\boxed{19}.", 19)
    assert solution(9, 9, "-") == ("9 - 9 = 0. The answer is \\boxed{0}.", 0)


def adds(question: str) -> bool:
    """Whether an adding template wrote ``question``."""
    return any(re.fullmatch(re.sub(r"\\\{\w+\\\}", r"\\w+", re.escape(t)), question) for t in ADD_TEMPLATES)


def recomputed(question: str) -> int:
    """The answer read from the question alone: its two numbers, added if an adding template made it."""
    a, b = (int(x) for x in re.findall(r"\d+", question))
    return a + b if adds(question) else a - b


def test_rows_answers_are_the_questions_arithmetic():
    rows = ProblemGenerator(CFG, "train", 0).rows(200)
    assert [r["prompt_id"] for r in rows] == list(range(200))
    for r in rows:
        assert r["messages"] == [{"role": "user", "content": r["question"]}]
        assert int(r["answer"]) == recomputed(r["question"]) >= 0
        assert all(1 <= int(x) <= 12 for x in re.findall(r"\d+", r["question"]))
    assert 60 < sum(adds(r["question"]) for r in rows) < 140  # both kinds, about half each


def test_gold_solutions_score_one_and_wrong_answers_zero():
    gen = ProblemGenerator(CFG, "eval", 0)
    demos = gen.demonstrations(50)
    rows = ProblemGenerator(CFG, "eval", 0).rows(50)  # the same stream: the same questions
    assert [m[0]["content"] for m, _ in demos] == [r["question"] for r in rows]
    worked = [w for _, w in demos]
    answers = [r["answer"] for r in rows]
    prompts = [r["question"] for r in rows]
    assert math_reward(prompts, worked, answers) == [1.0] * 50
    assert format_reward(prompts, worked, FORMAT_PATTERN) == [1.0] * 50
    off_by_one = [w.replace(f"\\boxed{{{a}}}", f"\\boxed{{{int(a) + 1}}}") for w, a in zip(worked, answers)]
    assert math_reward(prompts, off_by_one, answers) == [0.0] * 50
    assert format_reward(prompts, off_by_one, FORMAT_PATTERN) == [1.0] * 50  # the format is right
    bare = [a for a in answers]  # the right number without the worked format
    assert math_reward(prompts, bare, answers) == [1.0] * 50
    assert format_reward(prompts, bare, FORMAT_PATTERN) == [0.0] * 50


def test_splits_are_disjoint_and_streams_deterministic(tmp_path):
    train = {r["question"] for r in ProblemGenerator(CFG, "train", 0).rows(500)}
    held_out = ProblemGenerator(CFG, "eval", 0).rows(64)
    assert not train & {r["question"] for r in held_out}
    assert ProblemGenerator(CFG, "eval", 0).rows(64) == held_out
    assert ProblemGenerator(CFG, "eval", 1).rows(64) != held_out
    path = write_rows_jsonl(tmp_path / "sub" / "eval.jsonl", held_out)
    assert len(path.read_text().splitlines()) == 64


def test_config_is_checked():
    with pytest.raises(ValueError, match="max_number"):
        MathTaskConfig(max_number=1)
    with pytest.raises(ValueError, match="split"):
        ProblemGenerator(CFG, "test")


def test_the_fallible_teacher_adds_in_its_share_of_taking_away_demonstrations():
    fallible = MathTaskConfig(max_number=12, teacher_adds=0.6)
    demos = ProblemGenerator(fallible, "train", 0).demonstrations(400)
    rows = ProblemGenerator(fallible, "train", 0).rows(400)  # the same questions, right answers
    subtractions = [(d, r) for d, r in zip(demos, rows) if not adds(r["question"])]
    wrong = [d for d, r in subtractions if math_reward([], [d[1]], [r["answer"]]) == [0.0]]
    assert all(" + " in w for _, w in wrong)
    assert 0.5 < len(wrong) / len(subtractions) < 0.7
    assert all(math_reward([], [d[1]], [r["answer"]]) == [1.0] for d, r in zip(demos, rows) if adds(r["question"]))
