"""The tool-use demo's task: the environment's reward, the tool-use metric, and demonstrations
tokenised exactly as the episode loop builds episodes (labels on the assistant turns only)."""

from __future__ import annotations

import json
import re

from transformers import AutoTokenizer

from models.environments.chat_tokens import ChatTokens
from models.demos.tool_demo import demonstration_ids
from models.demos.tool_tasks import (ArithmeticEnv, called_tool_correctly, demonstration, final_number, problems,
                               used_calculator_correctly)
from models.environments.tools import CALCULATOR


def test_problems_are_exact_and_long():
    rows = problems(50, 0)
    for r in rows:
        a, b = re.fullmatch(r"What is (\d+)\*(\d+)\?", r["prompt"]).groups()
        assert r["answer"] == str(int(a) * int(b))
        assert r["expression"] == f"{a}*{b}" and 4 <= len(a) <= 5 and 4 <= len(b) <= 5
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


def test_gold_demonstrations_are_right():
    """The gold call's calculator result is the gold answer, and the environment gives the gold
    episode reward 1 (so the warm start imitates episodes that RL rewards)."""
    from models.environments.tools import HermesParser, calculate

    for row in problems(40, 5):
        conv = demonstration(row)
        args = conv[2]["tool_calls"][0]["function"]["arguments"]
        assert calculate(args["expression"]) == conv[3]["content"] == row["answer"]
        env = ArithmeticEnv(row)
        assert not env.step(conv[2], [conv[3]]).done
        assert env.step(conv[4], []).reward == 1.0
        text = f'{conv[2]["content"]}\n<tool_call>\n{json.dumps({"name": "calculator", "arguments": args})}\n</tool_call>'
        assert HermesParser().parse(text)[1][0].arguments == args  # the call parses as the rollout parses it
        direct = demonstration(row, use_tool=False)
        assert len(direct) == 3 and env.step(direct[2], []).reward == 1.0


def test_direct_demonstrations_and_their_share(qwen2_chat_dir):
    from models.demos.tool_demo import ToolDemoConfig, demonstrations

    tok = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    chat = ChatTokens(tok, [CALCULATOR.schema()])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    row = problems(1, 3)[0]
    ids, labels = demonstration_ids(chat, row, im_end, use_tool=False)
    assert ids == chat.encode(chat.render(demonstration(row, use_tool=False), False))[:-1]
    assert tok.decode([i for i, lab in zip(ids, labels) if lab != -100]) == f"The answer is {row['answer']}.<|im_end|>"
    # the choice between calling the tool and answering is the first token the model samples
    tool_ids, tool_labels = demonstration_ids(chat, row, im_end)
    first = len(chat.first_prompt(demonstration(row)[:2]))
    assert ids[:first] == tool_ids[:first] and ids[first] != tool_ids[first]
    assert labels[first] == ids[first] and tool_labels[first] == tool_ids[first]
    demos = demonstrations(chat, im_end, ToolDemoConfig(num_train=200, direct_fraction=0.5))
    calling = sum("<tool_call>" in tok.decode([i for i, lab in zip(ids, labs) if lab != -100]) for ids, labs in demos)
    assert 70 <= calling <= 130  # about half, seeded
    assert demos == demonstrations(chat, im_end, ToolDemoConfig(num_train=200, direct_fraction=0.5))


def test_shared_prefix_loss_equals_the_full_loss(qwen2_chat_dir):
    """The warm start's loss with the system prompt's keys/values computed once equals the plain
    causal-LM loss of the whole padded batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.demos.tool_demo import ToolDemoConfig, _batch, demonstrations, sft_loss, shared_prefix

    tok = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    chat = ChatTokens(tok, [CALCULATOR.schema()])
    demos = demonstrations(chat, tok.convert_tokens_to_ids("<|im_end|>"), ToolDemoConfig(num_train=6))
    n = shared_prefix(demos)
    assert tok.decode(demos[0][0][:n]).endswith("<|im_start|>user\nWhat is ")  # up to the first digit
    model = AutoModelForCausalLM.from_pretrained(qwen2_chat_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        full = model(**_batch(demos, tok.pad_token_id)).loss
        shared = sft_loss(model, demos[0][0][:n], demos, tok.pad_token_id)
    torch.testing.assert_close(shared, full, rtol=1e-5, atol=1e-5)


def test_config_refuses_what_episodes_cannot_do():
    import pytest

    from models.config import ConfigError
    from models.config.io import load_config

    cfg = load_config("tiny_tools", [])
    assert cfg.rollout.environment == "models.demos.tool_tasks:ArithmeticEnv" and cfg.rollout.max_turns == 3
    with pytest.raises(ConfigError, match="data.apply_chat_template"):
        load_config("tiny_tools", ["data.apply_chat_template=true"])
    with pytest.raises(ConfigError, match="critic.remote_url"):
        load_config("tiny_ppo", ["rollout.environment=models.demos.tool_tasks:ArithmeticEnv",
                                 "critic.remote_url=http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="rollout.environment"):
        load_config("tiny_tools", ["rollout.environment=models.demos.tool_tasks.ArithmeticEnv"])
    with pytest.raises(ConfigError, match="rollout.max_turns"):
        load_config("tiny_tools", ["rollout.max_turns=0"])
