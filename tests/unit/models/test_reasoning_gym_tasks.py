"""reasoning-gym rows and the reward that calls each task's own ``score_answer``."""

import pytest

from models.data.reasoning_gym import extract_answer, generate_rows, reasoning_gym_reward


def score(rows, responses):
    return reasoning_gym_reward([r["question"] for r in rows], responses, [r["reasoning_gym"] for r in rows],
                                [r["answer"] for r in rows])


def test_rows_are_reproducible_and_carry_their_address():
    rows = generate_rows("chain_sum", 3, 11, {"max_terms": 2})
    assert rows == generate_rows("chain_sum", 3, 11, {"max_terms": 2})
    for i, row in enumerate(rows):
        assert row["reasoning_gym"] == {"task": "chain_sum", "seed": 11, "size": 3, "index": i,
                                        "options": {"max_terms": 2}}
        assert row["question"].endswith(row["metadata"]["expression"] + " =")
        assert str(eval(row["metadata"]["expression"])) == row["answer"]  # an independent reference


def test_reward_is_the_tasks_own_score():
    rows = generate_rows("chain_sum", 4, 0)
    right, wrong = rows[0]["answer"], str(int(rows[1]["answer"]) + 1)
    responses = [f"<think>adding</think><answer>{right}</answer>", f"<answer>{wrong}</answer>",
                 f"  {rows[2]['answer']}\n", "I do not know"]
    assert score(rows, responses) == [1.0, 0.0, 1.0, 0.0]
    legs = generate_rows("leg_counting", 2, 3)
    assert score(legs, [str(legs[0]["metadata"]["total_legs"]), "<answer>-1</answer>"]) == [1.0, 0.0]


def test_extract_answer_takes_the_last_tag_else_the_whole_response():
    assert extract_answer("<answer>1</answer> no, <answer> 2 </answer>") == "2"
    assert extract_answer("  42 \n") == "42"


def test_an_entry_that_changed_is_refused():
    rows = generate_rows("chain_sum", 2, 0)
    rows[1]["answer"] = "not what reasoning-gym makes"
    with pytest.raises(ValueError, match=r"chain_sum entry 1 \(seed 0\) now has answer .* was reasoning-gym's "
                                         r"version changed\?"):
        score(rows, ["1", "2"])
