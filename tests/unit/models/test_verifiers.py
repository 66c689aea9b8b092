"""The verifiers on hand-written cases: equal answers written differently, and ones that must not match."""

import pytest

from models.rewards.verifiers import (exact_match_reward, extract_final_answer, format_reward, math_reward,
                              normalize_text)

GSM8K_SOLUTION = ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
                  "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer's market.\n#### 18")


@pytest.mark.parametrize("text, final", [
    (r"so \boxed{\frac{1}{2}} is it", r"\frac{1}{2}"),
    (r"\boxed{3} first, then \boxed{\sqrt{x^{2}}}", r"\sqrt{x^{2}}"),  # the last one, nested braces
    ("<think>2+2</think> <answer> 4 </answer>", "4"),
    ("steps...\n#### 1,000\nthanks", "1,000"),
    ("I think 12, no wait, 13.", "13"),
    ("about 50% of them", "50%"),
    ("3/4 of the cake", "3/4"),
    ("no numbers at all", None),
    (r"unclosed \boxed{12", "12"),  # an unbalanced box is no box: the last number
])
def test_extract_final_answer(text, final):
    assert extract_final_answer(text) == final


EQUAL = [  # (response, answer column): the same answer, written differently
    (r"The answer is \boxed{\frac{1}{2}}.", "0.5"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    ("#### 1,000", "1000"),
    ("It is 72.0", "72"),
    (r"\boxed{\dfrac{6}{8}}", "0.75"),
    ("<answer>1+x</answer>", "x+1"),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
    ("so 50%", "0.5"),
    ("The total is $18.", GSM8K_SOLUTION),  # the answer cell is a whole GSM8K solution
    ("#### 7", ["seven", "7"]),  # one of several accepted answers
]
NOT_EQUAL = [
    (r"\boxed{3}", "4"),
    ("I think 12, no wait, 13", "12"),  # the last number counts
    (r"\boxed{3.0001}", "3"),
    ("-3", "3"),
    (r"\boxed{\pi}", "3.14159"),
    ("no answer here", "3"),
    ("#### 17", GSM8K_SOLUTION),
]


@pytest.mark.parametrize("response, answer", EQUAL)
def test_math_reward_accepts_equal_answers(response, answer):
    assert math_reward(["q"], [response], [answer]) == [1.0]


@pytest.mark.parametrize("response, answer", NOT_EQUAL)
def test_math_reward_refuses_different_answers(response, answer):
    assert math_reward(["q"], [response], [answer]) == [0.0]


def test_math_reward_is_per_sample():
    assert math_reward(["q"] * 3, [r"\boxed{2}", "#### 3", "4"], ["2", "2", 4]) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("text, normal", [
    ('  "Paris."  ', "paris"), ("New   York", "new york"), ("1,234,567.5", "1234567.5"), ("$18", "18"),
    ("ＡＢＣ", "abc"), ("Straße", "strasse"), ("1,2", "1,2"),  # a pair, not a thousands separator
])
def test_normalize_text(text, normal):
    assert normalize_text(text) == normal


def test_exact_match_reward():
    responses = ["<answer>Paris</answer>", "The answer is Paris.", "#### 1,000", "paris!", "Lyon", r"\boxed{{2}}"]
    answers = ["paris", "Paris", "1000", "Paris", "Paris", "2"]
    # whole response compared when no final answer is marked; no symbolic equality ({2} is not 2)
    assert exact_match_reward([""] * 6, responses, answers) == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]


def test_format_reward():
    responses = ["<think>a</think> <answer>4</answer>", "<answer>4</answer>",
                 " <think>\nsteps\n</think>\n<answer>4</answer>\n", "<think>a</think><answer>4</answer> extra"]
    assert format_reward([""] * 4, responses) == [1.0, 0.0, 1.0, 0.0]
    assert format_reward([""] * 2, ["x #### 12", "12"], format_pattern=r".*####\s*\d+") == [1.0, 0.0]
