"""Prompt datasets: JSONL/Parquet, folders and globs; every bad row reported with its place."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.prompts import PromptDataConfig, PromptDataError, load_prompts


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
    with pytest.raises(PromptDataError, match=r"line 2 \(row 1\): prompt has 5 tokens > max_prompt_tokens=4"):
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
