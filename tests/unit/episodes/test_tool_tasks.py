"""The tool-use demo's task: the environment's reward, the tool-use metric, and demonstrations
tokenised exactly as the episode loop builds episodes (labels on the assistant turns only)."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from models.chat_tokens import ChatTokens
from models.tool_demo import demonstration_ids
from models.tool_tasks import (ArithmeticEnv, called_tool_correctly, demonstration, final_number, problems,
                               used_calculator_correctly)
from models.tools import CALCULATOR


def test_problems_are_exact_and_long():
    rows = problems(50, 0)
    for r in rows:
        a, op, b = r["prompt"][len("What is "):-1].split()
        assert r["answer"] == str(int(a) * int(b) if op == "*" else int(a) + int(b))
        assert r["expression"] == f"{a}{op}{b}" and len(a) >= 4 and len(b) >= 4
    assert problems(50, 0) == rows and problems(50, 1) != rows


def test_reward_is_for_the_exact_final_answer():
    env = ArithmeticEnv({"prompt": "What is 2 + 2?", "answer": "4"})
    assert env.start()[-1] == {"role": "user", "content": "What is 2 + 2?"}
    assert not env.step({"role": "assistant", "content": ""}, [{"role": "tool", "content": "4"}]).done
    assert env.step({"role": "assistant", "content": "It is 4"}, []).reward == 1.0
    assert env.step({"role": "assistant", "content": "5"}, []).reward == 0.0
    assert final_number("x -12 and 7") == "7" and final_number("none") == ""


def test_tool_use_metric():
    row = problems(1, 0)[0]
    episode = json.dumps(demonstration(row))
    assert used_calculator_correctly(episode, row["expression"])
    assert not used_calculator_correctly(episode, "1+1")
    failed = demonstration(row)
    failed[3]["content"] = "error: the call is not JSON"
    assert called_tool_correctly(["p"] * 2, ["r"] * 2, episode=[episode, json.dumps(failed)],
                                 expression=[row["expression"]] * 2) == [1.0, 0.0]


def test_demonstrations_are_tokenised_as_episodes_are(qwen2_chat_dir):
    tok = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    chat = ChatTokens(tok, [CALCULATOR.schema()])
    row = problems(1, 3)[0]
    ids, labels = demonstration_ids(chat, row, tok.convert_tokens_to_ids("<|im_end|>"))
    full = chat.encode(chat.render(demonstration(row), False))
    assert ids == full[:-1]  # the template's rendering (its final newline follows the sampled <|im_end|>)
    learned = tok.decode([i for i, lab in zip(ids, labels) if lab != -100])
    assert learned == (f'Let me calculate.\n<tool_call>\n{{"name": "calculator", "arguments": {{"expression": '
                       f'"{row["expression"]}"}}}}\n</tool_call>{row["answer"]}<|im_end|>')


def test_config_refuses_what_episodes_cannot_do():
    import pytest

    from tasks.config import ConfigError
    from tasks.config_io import load_config

    cfg = load_config("tiny_tools", [])
    assert cfg.rollout.environment == "models.tool_tasks:ArithmeticEnv" and cfg.rollout.max_turns == 3
    with pytest.raises(ConfigError, match="data.apply_chat_template"):
        load_config("tiny_tools", ["data.apply_chat_template=true"])
    with pytest.raises(ConfigError, match="critic.remote_url"):
        load_config("tiny_ppo", ["rollout.environment=models.tool_tasks:ArithmeticEnv",
                                 "critic.remote_url=http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="rollout.environment"):
        load_config("tiny_tools", ["rollout.environment=models.tool_tasks.ArithmeticEnv"])
    with pytest.raises(ConfigError, match="rollout.max_turns"):
        load_config("tiny_tools", ["rollout.max_turns=0"])
