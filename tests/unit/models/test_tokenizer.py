"""Character tokenizer: ids, exact round trips, save/load through AutoTokenizer."""

import json
import string

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from models.demos.tokenizer import DEFAULT_ALPHABET, SPECIAL_TOKENS, build_char_tokenizer, save_tokenizer


_TOK = build_char_tokenizer()  # shared by the hypothesis test, which cannot take fixtures


@pytest.fixture(scope="module")
def tok():
    return _TOK


def test_special_token_ids_and_vocab_size(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == ("<pad>", "<bos>", "<eos>", "<unk>")
    # the alphabet is printable ASCII (tab and newlines aside): one id each after the four specials, and no other ids
    printable = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    assert sorted(tok.convert_tokens_to_ids(printable)) == list(range(len(SPECIAL_TOKENS), len(tok)))


def test_default_alphabet_covers_task_characters():
    for ch in string.ascii_lowercase + string.digits + " =":
        assert ch in DEFAULT_ALPHABET


def test_encode_is_bos_then_one_id_per_character(tok):
    # hand-worked: ids are 4 + position in the alphabet
    s = "ab c=1"
    expected = [1] + [4 + DEFAULT_ALPHABET.index(c) for c in s]
    assert tok(s).input_ids == expected
    assert tok("").input_ids == [1]
    assert tok(s, add_special_tokens=False).input_ids == expected[1:]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=DEFAULT_ALPHABET, max_size=40))
def test_round_trip_is_exact(s):
    # The literal texts "<pad>", "<eos>", ... are the one exception: they encode to the
    # special ids, as in every HF tokenizer (tested below).
    assume(not any(special in s for special in SPECIAL_TOKENS))
    tok = _TOK
    ids = tok(s).input_ids
    assert len(ids) == len(s) + 1
    assert tok.decode(ids, skip_special_tokens=True) == s
    assert tok.decode(ids) == "<bos>" + s


def test_whitespace_and_digits_are_not_normalised(tok):
    for s in ["  a  b  ", "007", " ", "x = 10 ", "a" * 30]:
        assert tok.decode(tok(s).input_ids, skip_special_tokens=True) == s


def test_unknown_characters_map_to_unk(tok):
    assert tok("a\u00e9\n", add_special_tokens=False).input_ids == [4 + DEFAULT_ALPHABET.index("a"), 3, 3]


def test_special_token_text_encodes_to_special_id(tok):
    ids = tok("ab<eos>", add_special_tokens=False).input_ids
    assert ids[-1] == tok.eos_token_id and len(ids) == 3


def test_batch_padding_uses_pad_id_on_the_right(tok):
    enc = tok(["ab", "abcd"], padding=True)
    assert enc.input_ids[0][-2:] == [0, 0]
    assert enc.attention_mask[0] == [1, 1, 1, 0, 0]


def test_custom_alphabet_and_its_checks():
    small = build_char_tokenizer("xy")
    assert len(small) == 6
    assert small("yx").input_ids == [1, 5, 4]
    with pytest.raises(ValueError, match="repeated"):
        build_char_tokenizer("abca")
    with pytest.raises(ValueError, match="empty"):
        build_char_tokenizer("")
    with pytest.raises(ValueError, match="printable"):
        build_char_tokenizer("ab\n")


def test_save_and_load_with_auto_tokenizer(tok, tmp_path):
    save_tokenizer(tok, tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2, 3)
    for s in ["hello world=", "  9 ", "<eos>z"]:
        assert loaded(s).input_ids == tok(s).input_ids
        assert loaded.decode(loaded(s).input_ids, skip_special_tokens=True) == tok.decode(
            tok(s).input_ids, skip_special_tokens=True
        )


def test_a_process_loads_each_tokenizer_once_and_another_one_anew(tmp_path):
    """``cached_tokenizer``: the checkpoints of a run carry one tokenizer (the reference in bfloat16, an iteration's
    actor in float32): loaded once; a folder with another tokenizer (another alphabet) loads that one."""
    from models.checkpoint.local import cached_tokenizer

    def checkpoint(name, alphabet, dtype):
        out = tmp_path / name
        save_tokenizer(build_char_tokenizer(alphabet), out)
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": dtype}))
        (out / "model.safetensors").write_bytes(name.encode())  # weights: not the tokenizer's
        return str(out)

    reference, actor = checkpoint("reference", "abc", "bfloat16"), checkpoint("actor", "abc", "float32")
    other = checkpoint("other", "cba", "float32")
    first = cached_tokenizer(reference)
    assert cached_tokenizer(actor) is first and first("ab").input_ids == [1, 4, 5]
    assert cached_tokenizer(other) is not first and cached_tokenizer(other)("ab").input_ids == [1, 6, 5]
    assert AutoTokenizer.from_pretrained(other)("ab").input_ids == [1, 6, 5]  # what the cache stands in for


def test_a_remote_checkpoints_tokenizer_is_fetched_without_its_weights(qwen2_chat_dir, s3_url, monkeypatch):
    """``load_tokenizer_only`` of a checkpoint on S3 fetches its top-level tokenizer files, a ``*.tiktoken`` one among
    them (a file a checkpoint may hold: ``check_file_allowed``), and not its weights; the tokenizer is the local
    one's."""
    import os
    import tempfile

    from models import storage
    from models.run import setup

    for name in os.listdir(qwen2_chat_dir):
        storage.put_file(os.path.join(qwen2_chat_dir, name), storage.join(s3_url, name))
    storage.write_bytes(storage.join(s3_url, "extra.tiktoken"), b"IQ== 0\n")
    made = []
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(setup.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    remote = setup.load_tokenizer_only(s3_url)
    fetched = sorted(os.listdir(made[0]))
    assert "extra.tiktoken" in fetched and not [f for f in fetched if f.endswith(".safetensors")], fetched
    local = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    text = "<|im_start|>user\nHello, 12 + 30?<|im_end|>"
    assert remote(text)["input_ids"] == local(text)["input_ids"] and len(remote) == len(local)
