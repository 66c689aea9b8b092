"""TRL's dataset formats on the math demo's problems and its chat model's template (ChatML): a
conversational ``prompt`` column read as conversations with no other key, compressed JSONL, and the
reward path of a batch (its data columns and conversations as the batch carries them) scored by
TRL's own ``accuracy_reward`` and ``think_format_reward``."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma

import pytest
from transformers import AutoTokenizer
from trl.rewards import accuracy_reward, think_format_reward

from models.data.batch_schema import decode_data_columns
from models.data.prompts import PromptDataConfig, PromptDataError, load_prompts
from models.demos.math_demo import DEMO_TASK
from models.demos.math_task import ProblemGenerator
from models.rewards import compute_rewards
from models.rewards.verifiers import math_reward
from models.run.data import sample_columns

ROWS = ProblemGenerator(DEMO_TASK, "train", 0).rows(6)
"""The math demo's first training rows: ``messages`` (one user turn), ``question``, ``answer``."""
TRL_ROWS = [{"prompt": r["messages"], "solution": r["answer"]} for r in ROWS]
"""The same problems in TRL's conversational prompt-only format with a ``solution`` column."""


def chatml(question: str) -> str:
    """What the demo's chat template makes of one user turn, written by hand."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(qwen2_chat_dir):
    return AutoTokenizer.from_pretrained(qwen2_chat_dir)


def write(path, rows, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_conversational_prompt_column_is_a_conversation_and_its_batch_scores_with_trl(tmp_path, tokenizer):
    data = load_prompts(PromptDataConfig(url=write(tmp_path / "train.jsonl.gz", TRL_ROWS, gzip.open)), tokenizer)
    assert data.prompts == [chatml(r["question"]) for r in ROWS] and data.chat
    assert data.columns == {"solution": [r["answer"] for r in ROWS]}
    cols = sample_columns(data, 2)  # what the rollout writes beside each of 2 samples per prompt
    columns = decode_data_columns(cols["data_columns"])
    messages = [json.loads(m) for m in cols["prompt_messages"]]
    assert messages == [r["messages"] for r in ROWS for _ in range(2)]
    worked = [f"The answer is \\boxed{{{r['answer']}}}." for r in ROWS]  # the demo's answer format
    responses = [w for w in worked for _ in range(2)]
    responses[1::2] = [w.replace("boxed{", "boxed{1") for w in worked]  # a wrong number in every second one
    prompts = [data.prompts[i // 2] for i in range(len(responses))]
    acc = compute_rewards(accuracy_reward, prompts, responses, columns=columns, messages=messages)
    want = math_reward(prompts, responses, columns["solution"])  # the project's own verifier, independently
    assert acc == want and want == [1.0, 0.0] * len(ROWS)
    assert compute_rewards(think_format_reward, prompts, responses, columns=columns, messages=messages) == \
        [0.0] * len(responses)  # the demo writes no <think>
    think = compute_rewards(think_format_reward, prompts[:1], [f"<think>sum</think>{worked[0]}"], messages=messages[:1])
    assert think == [1.0]


def test_the_demo_format_and_the_trl_format_render_alike(tmp_path, tokenizer):
    demo = load_prompts(PromptDataConfig(url=write(tmp_path / "demo.jsonl", ROWS), messages_column="messages"),
                        tokenizer)
    trl = load_prompts(PromptDataConfig(url=write(tmp_path / "trl.jsonl", TRL_ROWS)), tokenizer)
    assert trl.prompts == demo.prompts and trl.messages == demo.messages


@pytest.mark.parametrize("suffix, opener", [(".bz2", bz2.open), (".xz", lzma.open)])
def test_compressed_jsonl_is_read(tmp_path, suffix, opener, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    rows = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    data = load_prompts(PromptDataConfig(url=write(tmp_path / f"p.jsonl{suffix}", rows, opener)))
    assert data.prompts == ["2+2=", "3+3="] and data.columns == {"answer": ["4", "6"]}
    hf = load_prompts(PromptDataConfig(url=str(tmp_path / f"p.jsonl{suffix}"), source="hf"))
    assert hf.prompts == data.prompts


def test_an_unknown_compression_or_a_corrupt_file_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "p.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(PromptDataError, match=r"p.jsonl.zst: a compression this reader lacks \(want .jsonl or "
                                              r".parquet, optionally compressed as .jsonl.gz, .jsonl.bz2, .jsonl.xz\)"):
        load_prompts(PromptDataConfig(url=str(tmp_path / "p.jsonl.zst")))
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(PromptDataError, match=r"bad.jsonl.gz: not a readable .gz file"):
        load_prompts(PromptDataConfig(url=str(tmp_path / "bad.jsonl.gz")))


def test_a_messages_column_the_rows_lack_names_the_key_to_set(tmp_path, tokenizer):
    url = write(tmp_path / "trl.jsonl", TRL_ROWS[:1])
    with pytest.raises(PromptDataError, match=r"missing column 'messages' .*its 'prompt' column holds conversations, "
                                              r"read as such when data.messages_column is empty: set "
                                              r"data.messages_column=''"):
        load_prompts(PromptDataConfig(url=url, messages_column="messages"), tokenizer)
    with pytest.raises(PromptDataError, match=r"'prompt' is a list \(a conversation\?\), which data.prompt_template "
                                              r"cannot fill"):
        load_prompts(PromptDataConfig(url=url, prompt_template="Q: {solution}"), tokenizer)


def test_an_environment_run_refuses_a_conversational_prompt_column(tmp_path, tokenizer, qwen2_chat_dir):
    """An environment writes the conversation itself from each row's text ``prompt``."""
    from models.config import ConfigError
    from models.config.io import load_config
    from models.run.setup import _checked_data

    url = write(tmp_path / "trl.jsonl", TRL_ROWS)
    cfg = load_config("tiny_tools", [f"model.actor_path={qwen2_chat_dir}", f"data.train_prompts={url}",
                                     "data.eval_prompts="])
    with pytest.raises(ConfigError, match=r"rollout.environment gets each row's plain text 'prompt' .* "
                                          r"data.prompt_column='prompt' holds conversations"):
        _checked_data(cfg, tokenizer)
