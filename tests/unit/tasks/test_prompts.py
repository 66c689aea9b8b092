"""Prompt datasets: JSONL/Parquet, folders and globs; every bad row reported with its place."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from models.data.prompts import PromptDataConfig, PromptDataError, load_prompts


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def load(url, tokenizer=None, **kw):
    return load_prompts(PromptDataConfig(url=url, **kw), tokenizer)


class WordTokenizer:
    """Stand-in for an HF tokenizer: one token per word plus one BOS token."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[0] * add_special_tokens + [1] * len(t.split()) for t in texts]}


def test_jsonl_good_keeps_other_columns_and_ids(tmp_path):
    url = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2=", "answer": "4", "prompt_id": 10},
                                             {"prompt": "héllo ✓", "answer": "5", "prompt_id": 3}])
    data = load(url)
    assert data.prompts == ["2+2=", "héllo ✓"]
    assert data.row_ids.tolist() == [10, 3]
    assert data.columns == {"answer": ["4", "5"]}
    assert data.shard(1, 2).prompts == ["héllo ✓"]


def test_parquet_good_without_ids_uses_row_index(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["a?", "b?", "c?"], "level": [1, 2, 3]}), path)
    data = load(str(path), prompt_column="question")
    assert data.prompts == ["a?", "b?", "c?"]
    assert data.row_ids.tolist() == [0, 1, 2]
    assert data.columns["level"] == [1, 2, 3]


def test_folder_and_glob_read_all_files_in_order(tmp_path):
    write_jsonl(tmp_path / "part-0.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    pq.write_table(pa.table({"prompt": ["c"]}), tmp_path / "part-1.parquet")
    (tmp_path / "README.txt").write_text("not data")
    assert load(str(tmp_path)).prompts == ["a", "b", "c"]
    assert load(str(tmp_path / "part-*.jsonl")).prompts == ["a", "b"]
    assert load(f"file://{tmp_path}/part-1.parquet").prompts == ["c"]


def test_each_bad_row_is_reported_with_file_and_row(tmp_path):
    url = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "fine"},
        {"text": "wrong key"},          # row 1: missing column
        {"prompt": ""},                 # row 2: empty
        {"prompt": 42},                 # row 3: not a string
        {"prompt": "x" * 11},           # row 4: too long
    ])
    with pytest.raises(PromptDataError) as info:
        load(url, max_prompt_chars=10)
    errors = info.value.errors
    assert len(errors) == 4
    assert "bad.jsonl line 2 (row 1): missing column 'prompt' (available columns: ['text'])" in errors[0]
    assert "line 3 (row 2): empty prompt" in errors[1]
    assert "line 4 (row 3): 'prompt' is int, not a string" in errors[2]
    assert "line 5 (row 4): prompt has 11 characters > max_prompt_chars=10" in errors[3]
    assert str(info.value).startswith("4 problem(s) in prompt data")


def test_non_utf8_and_invalid_json_lines(tmp_path):
    path = tmp_path / "enc.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n{"prompt": \n[1, 2]\n')
    with pytest.raises(PromptDataError) as info:
        load(str(path))
    errors = info.value.errors
    assert "enc.jsonl line 3 (row 1): not valid UTF-8 (byte 0xe9 at column 16)" in errors[0]
    assert "line 4 (row 2): invalid JSON" in errors[1]
    assert "line 5 (row 3): expected a JSON object, got list" in errors[2]


def test_parquet_missing_column_lists_available_columns(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["a"], "id": [1]}), path)
    with pytest.raises(PromptDataError, match=r"p.parquet: missing column 'prompt' \(available columns: "
                                              r"\['question', 'id'\]\)"):
        load(str(path))


def test_parquet_null_prompt_is_reported_by_row(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "c"]}), path)
    with pytest.raises(PromptDataError, match=r"p.parquet row 1: 'prompt' is NoneType"):
        load(str(path))


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(PromptDataError, match="nope.jsonl: file not found"):
        load(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_bytes(b"\n\n")
    with pytest.raises(PromptDataError, match="empty.jsonl: file is empty"):
        load(str(tmp_path / "empty.jsonl"))
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(PromptDataError, match=r"none.parquet: file is empty \(no rows\)"):
        load(str(tmp_path / "none.parquet"))
    with pytest.raises(PromptDataError, match="no .jsonl or .parquet files match"):
        load(str(tmp_path / "*.csv"))


def test_token_limit_uses_the_tokenizer(tmp_path):
    url = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "one two"}, {"prompt": "one two three four"}])
    assert len(load(url, WordTokenizer(), max_prompt_tokens=5)) == 2
    with pytest.raises(PromptDataError, match=r"line 2 \(row 1\): prompt has 5 tokens > data\.max_prompt_tokens=4"):
        load(url, WordTokenizer(), max_prompt_tokens=4)


def test_bad_and_duplicate_ids(tmp_path):
    url = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "prompt_id": 1}, {"prompt": "b", "prompt_id": 1},
                                             {"prompt": "c", "prompt_id": "x"}])
    with pytest.raises(PromptDataError) as info:
        load(url)
    assert "row 1): duplicate 'prompt_id' 1 (first at" in info.value.errors[0]
    assert "row 2): 'prompt_id' is 'x', not an integer" in info.value.errors[1]


def test_error_list_is_capped_but_all_are_counted(tmp_path):
    url = write_jsonl(tmp_path / "p.jsonl", [{"prompt": ""}] * 30)
    with pytest.raises(PromptDataError) as info:
        load(url, max_errors=5)
    assert len(info.value.errors) == 5
    assert "30 problem(s)" in str(info.value) and "... and 25 more" in str(info.value)


# --- rendering with the realistic checkpoints' tokenizers ---------------------------------------------
@pytest.fixture(scope="module")
def qwen_tok(qwen2_chat_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen2_chat_dir)


def test_an_environments_first_prompt_over_the_budget_is_refused(qwen_tok):
    """Prompts over ``data.max_prompt_tokens`` are refused, never truncated (``test_bad_input.py``); with
    ``rollout.environment`` the prompt is the one the environment writes, tools and system message included."""
    from models.config import ConfigError
    from models.config.io import load_config
    from models.data.prompts import PromptDataset
    from models.demos.tool_tasks import CALCULATOR, SYSTEM
    from models.run.context import check_first_prompts

    tok = qwen_tok
    data = PromptDataset(["What is 12*13?", "What is 2*3?"], np.array([7, 9], dtype=np.int64), {"answer": ["156", "6"]})
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12*13?"}]
    n = len(tok.apply_chat_template(messages, tools=[CALCULATOR.schema()], add_generation_prompt=True,
                                    tokenize=True, return_dict=False))
    check_first_prompts(load_config("tiny_tools", [f"data.max_prompt_tokens={n}"]), data, tok, room=None)
    with pytest.raises(ConfigError, match=rf"1 first prompts .* longer than data\.max_prompt_tokens={n - 1}, or "
                                          rf"{n} beside rollout\.max_episode_tokens=160 .*: row 7: {n} tokens$"):
        check_first_prompts(load_config("tiny_tools", [f"data.max_prompt_tokens={n - 1}"]), data, tok, room=n)


def test_set_up_renders_the_first_prompts_of_the_longest_rows_beyond_its_limit(qwen_tok, monkeypatch):
    """Past ``FIRST_PROMPTS_CHECKED`` rows set-up renders those of the longest texts: the one long row is refused
    among many short ones, and a limit of 1 (the longest row only) still finds it."""
    from models.config import ConfigError
    from models.config.io import load_config
    from models.data.prompts import PromptDataset
    from models.run import context

    texts = [f"What is {i}*{i}?" for i in range(40)]
    texts[23] = "What is " + " * ".join(str(1000 + i) for i in range(40)) + "?"
    data = PromptDataset(texts, np.arange(100, 140, dtype=np.int64), {"answer": ["0"] * 40})
    cfg = load_config("tiny_tools", ["data.max_prompt_tokens=400"])  # a short row: about 320
    for limit in (256, 1):
        monkeypatch.setattr(context, "FIRST_PROMPTS_CHECKED", limit)
        with pytest.raises(ConfigError, match=r": 1 first prompts .*: row 123: \d+ tokens$"):
            context.check_first_prompts(cfg, data, qwen_tok, room=None)
    monkeypatch.setattr(context, "FIRST_PROMPTS_CHECKED", 1)
    context.check_first_prompts(cfg, data.take([0, 1, 2]), qwen_tok, room=None)  # the short rows fit


@pytest.fixture(scope="module")
def llama_tok(llama_bpe_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_bpe_dir)


GSM_ROWS = [{"question": "Ava has 3 apples and buys 4 more. How many now?", "answer": "7", "level": 1},
            {"question": "Ben had 12 coins and lost 5. How many are left?", "answer": "7", "level": 2}]


def test_text_column_with_template_system_prompt_and_chatml(tmp_path, qwen_tok):
    """The hand-written ChatML of a system and a user turn, and the tokens the tokenizer's own
    ``apply_chat_template(tokenize=True)`` gives (no token added in front)."""
    url = write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    data = load(url, qwen_tok, prompt_column="question",
                prompt_template="{question}\nGive the final answer after ####.",
                apply_chat_template=True, system_prompt="You are careful.", max_prompt_tokens=512)
    assert data.prompts[0] == ("<|im_start|>system\nYou are careful.<|im_end|>\n<|im_start|>user\nAva has 3 apples and "
                               "buys 4 more. How many now?\nGive the final answer after ####.<|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert data.chat and data.messages[1] == [{"role": "system", "content": "You are careful."},
                                              {"role": "user", "content": GSM_ROWS[1]["question"] +
                                               "\nGive the final answer after ####."}]
    assert data.columns == {"answer": ["7", "7"], "level": [1, 2]}  # the prompt column is the prompt
    from models.engines.rollout import encode_prompts

    ids = encode_prompts(qwen_tok, data.prompts, add_special_tokens=False)
    assert ids[0] == list(qwen_tok.apply_chat_template(data.messages[0], tokenize=True, add_generation_prompt=True,
                                                       return_dict=True)["input_ids"])


def test_messages_column_on_llama_writes_one_bos(tmp_path, llama_tok):
    """The Llama-3 template writes ``<|begin_of_text|>`` itself: the prompt holds exactly one."""
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
             "answer": "hello"},
            {"messages": [{"role": "user", "content": "2 + 2?"}], "answer": "4"}]
    data = load(write_jsonl(tmp_path / "chat.jsonl", rows), llama_tok, messages_column="messages",
                system_prompt="Default system.")
    assert data.prompts[1] == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                               "Default system.<|eot_id|>"
                               "<|start_header_id|>user<|end_header_id|>\n\n2 + 2?<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert data.messages[0][0]["content"] == "Be brief."  # a conversation's own system turn stays
    from models.engines.rollout import encode_prompts

    bos = llama_tok.convert_tokens_to_ids("<|begin_of_text|>")
    ids = encode_prompts(llama_tok, data.prompts, add_special_tokens=not data.chat)
    assert [row.count(bos) for row in ids] == [1, 1] and all(row[0] == bos for row in ids)
    assert encode_prompts(llama_tok, data.prompts)[0][:2] == [bos, bos]  # what adding special tokens would do


def test_token_limit_counts_the_rendered_prompt(tmp_path, qwen_tok):
    url = write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS[:1])
    plain = len(qwen_tok(GSM_ROWS[0]["question"])["input_ids"])
    with pytest.raises(PromptDataError, match=r"row 0\): prompt has \d+ tokens > data\.max_prompt_tokens="):
        load(url, qwen_tok, prompt_column="question", apply_chat_template=True, max_prompt_tokens=plain + 2)


def test_byte_level_bpe_represents_every_character(tmp_path, qwen_tok):
    url = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "café 😀 中文"}])
    assert load(url, qwen_tok).prompts == ["café 😀 中文"]


def test_char_tokenizer_unknown_characters_refused_or_allowed(tmp_path, capsys):
    from models.demos.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    rows = [{"prompt": "abc="}, {"prompt": "café="}, {"prompt": "😀="}, {"prompt": "<unk> literal="},
            {"prompt": "中文="}]
    url = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(PromptDataError) as info:
        load(url, tok, max_errors=2)
    assert str(info.value).startswith("3 problem(s)")  # the literal "<unk>" text is not one
    assert info.value.errors == [
        f"{url} line 2 (row 1): characters the tokenizer cannot represent (they would become '<unk>'): 'é' U+00E9",
        f"{url} line 3 (row 2): characters the tokenizer cannot represent (they would become '<unk>'): '😀' U+1F600"]
    assert "data.allow_unknown_chars=true" in str(info.value)
    assert len(load(url, tok, allow_unknown_chars=True)) == 5
    assert "3 prompt(s) hold characters the tokenizer cannot represent" in capsys.readouterr().out


def test_chat_template_missing_is_reported(tmp_path):
    from models.demos.tokenizer import build_char_tokenizer

    with pytest.raises(PromptDataError, match="the tokenizer has no chat template"):
        load(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}]), build_char_tokenizer(), apply_chat_template=True)


# --- the run's copy: read back by the same reader -----------------------------------------------------
def test_run_copy_round_trips_what_validated(tmp_path, qwen_tok):
    """U+2028/U+2029 and other line separators inside a JSON string validate and come back intact
    (``str.splitlines`` would have cut the line); ids and columns survive."""
    from models.run.data import read_run_prompts, write_run_prompts

    tricky = "line\u2028sep\u2029para\x85nel\x1c and \r in one"
    path = tmp_path / "u.jsonl"
    path.write_bytes((json.dumps({"prompt": tricky, "answer": [1, 2], "prompt_id": 7}, ensure_ascii=False)
                      + "\n" + json.dumps({"prompt": "b", "prompt_id": 9}) + "\n").encode())
    data = load(str(path))
    write_run_prompts(data, str(tmp_path / "run" / "train_prompts.jsonl"))
    back = read_run_prompts(str(tmp_path / "run" / "train_prompts.jsonl"))
    assert back.prompts == [tricky, "b"] and back.row_ids.tolist() == [7, 9]
    assert back.columns == {"answer": [[1, 2], None]} and not back.chat and back.messages is None
    chat = load(write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS), qwen_tok, prompt_column="question",
                apply_chat_template=True)
    write_run_prompts(chat, str(tmp_path / "run" / "chat.jsonl"))
    again = read_run_prompts(str(tmp_path / "run" / "chat.jsonl"))
    assert again.prompts == chat.prompts and again.chat and again.messages == chat.messages
    assert again.columns == chat.columns


def test_parquet_with_a_non_default_column_keeps_it_through_the_copy(tmp_path):
    from models.run.data import read_run_prompts, write_run_prompts

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["a?", "b?"], "answer": ["1", "2"]}), path)
    data = load(str(path), prompt_column="question")
    write_run_prompts(data, str(tmp_path / "copy.jsonl"))
    back = read_run_prompts(str(tmp_path / "copy.jsonl"))
    assert back.prompts == ["a?", "b?"] and back.columns == {"answer": ["1", "2"]}


# --- Hugging Face datasets ----------------------------------------------------------------------------
@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Offline, with a private cache, for this test only. ``datasets`` reads its offline switch once, at
    import: imported first here, under the variable, it would keep every later test of the process
    offline (an xdist worker's ``test_user_data.py`` then failed), so it is imported before the variable
    is set and its module values are patched (and restored) too."""
    import datasets.config

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


def test_hf_datasets_from_files_and_save_to_disk(tmp_path, hf_cache):
    import datasets

    jsonl = write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    data = load(jsonl, source="hf", prompt_column="question")
    assert data.prompts == [r["question"] for r in GSM_ROWS] and data.columns["answer"] == ["7", "7"]
    pq.write_table(pa.table({"question": ["x?"], "answer": ["3"]}), tmp_path / "p.parquet")
    assert load(str(tmp_path / "p.parquet"), source="hf", prompt_column="question").prompts == ["x?"]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM_ROWS),
                          "test": datasets.Dataset.from_list(GSM_ROWS[:1])}).save_to_disk(str(tmp_path / "saved"))
    test = load(str(tmp_path / "saved"), source="hf", prompt_column="question", split="test")
    assert test.prompts == [GSM_ROWS[0]["question"]] and test.columns["level"] == [1]


def test_hf_dataset_problems_are_reported(tmp_path, hf_cache):
    jsonl = write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    with pytest.raises(PromptDataError, match=r"gsm\.jsonl split train row 1: missing column 'prompt'"):
        load(jsonl, source="hf")
    with pytest.raises(PromptDataError, match=r"missing\.parquet: datasets\.load_dataset failed"):
        load(str(tmp_path / "missing.parquet"), source="hf")


def test_reasoning_gym_rows(tmp_path):
    from models.config import ReasoningGymConfig

    cfg = ReasoningGymConfig(task="chain_sum", size=20, eval_size=10, seed=5, options=["max_terms=2"])
    train = load("", source="reasoning_gym", prompt_column="question", reasoning_gym=cfg)
    held = load("", source="reasoning_gym", prompt_column="question", reasoning_gym=cfg, split="eval")
    assert len(train) == 20 and 0 < len(held) <= 10 and not set(train.prompts) & set(held.prompts)
    assert set(train.columns) == {"answer", "metadata", "reasoning_gym"}
    assert train.columns["reasoning_gym"][3] == {"task": "chain_sum", "seed": 5, "size": 20, "index": 3,
                                                 "options": {"max_terms": 2}}
    expr = train.columns["metadata"][0]["expression"]  # the answer is the expression's value
    assert str(eval(expr)) == train.columns["answer"][0]
