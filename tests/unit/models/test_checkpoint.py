"""HF checkpoints with a commit marker: write, commit, verify, refuse partial/corrupt/pickle."""

import json
import os

import pytest
import torch

from models import storage
from models.checkpoint import (MARKER, CheckpointError, download_checkpoint, is_committed, load_model,
                               read_marker, save_checkpoint, save_model_checkpoint)


def tiny_model_and_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    return LlamaForCausalLM(config), tokenizer


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_and_tokenizer()


def hf_dir(path, files=None):
    """A minimal HF-looking directory without a model (fast)."""
    files = files or {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\x00" * 64,
                      "tokenizer/vocab.txt": b"a\nb\n"}
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return str(path)


def test_model_round_trip_through_a_committed_checkpoint(tmp_path, tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = tiny
    url = str(tmp_path / "iter-000001" / "actor")
    marker = save_model_checkpoint(model, tokenizer, url)
    assert is_committed(url)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(marker["files"])
    loaded = load_model(url, AutoModelForCausalLM)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(download_checkpoint(url))("a b")["input_ids"] == [2, 3]
    assert not [p for p in os.listdir(tmp_path / "iter-000001") if ".tmp-" in p]  # temp prefix gone


def test_marker_lists_sizes_and_checksums(tmp_path):
    import blake3

    src = hf_dir(tmp_path / "src")
    save_checkpoint(src, str(tmp_path / "ckpt"))
    marker = json.loads((tmp_path / "ckpt" / MARKER).read_text())
    entry = marker["files"]["tokenizer/vocab.txt"]
    assert entry == {"size": 4, "blake3": blake3.blake3(b"a\nb\n").hexdigest()}
    assert "created_at" in marker
    assert download_checkpoint(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt")  # local: in place
    copy = download_checkpoint(f"file://{tmp_path}/ckpt", str(tmp_path / "copy"))
    assert (tmp_path / "copy" / "tokenizer" / "vocab.txt").read_bytes() == b"a\nb\n"
    assert copy == str(tmp_path / "copy")


def test_download_is_a_committed_copy_reused_when_present(tmp_path):
    url = str(tmp_path / "ckpt")
    save_checkpoint(hf_dir(tmp_path / "src"), url)
    dst = str(tmp_path / "dl")
    download_checkpoint(f"file://{url}", dst)
    assert is_committed(dst)  # the copy carries the marker
    os.utime(os.path.join(dst, "config.json"), (0, 0))
    download_checkpoint(f"file://{url}", dst)  # same checkpoint: reused, not re-downloaded
    assert os.stat(os.path.join(dst, "config.json")).st_mtime == 0
    other = str(tmp_path / "other")
    save_checkpoint(hf_dir(tmp_path / "src2", {"config.json": b'{"x": 1}'}), other)
    with pytest.raises(CheckpointError, match="dl is not empty and holds a different checkpoint"):
        download_checkpoint(other, dst)
    save_checkpoint(dst, str(tmp_path / "again"))  # re-saving a downloaded copy works
    assert read_marker(str(tmp_path / "again"))["files"] == read_marker(url)["files"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_uncommitted_checkpoint_is_refused(tmp_path):
    partial = hf_dir(tmp_path / "partial")  # files, but no marker: like a crashed write
    assert not is_committed(partial)
    with pytest.raises(CheckpointError, match=r"partial is not committed \(no COMMITTED.json\) — it may "
                                              r"be partial from a crashed run"):
        download_checkpoint(partial)


def test_corrupted_file_is_detected_with_its_name(tmp_path):
    url = str(tmp_path / "ckpt")
    save_checkpoint(hf_dir(tmp_path / "src"), url)
    weights = tmp_path / "ckpt" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[10] ^= 0x01  # flip one bit, same size
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"ckpt: file 'model.safetensors' fails its blake3 check"):
        download_checkpoint(url)
    with pytest.raises(CheckpointError, match="model.safetensors' fails its blake3"):
        download_checkpoint(url, str(tmp_path / "elsewhere"))
    weights.write_bytes(bytes(data[:-1]))
    with pytest.raises(CheckpointError, match=r"'model.safetensors' has 63 bytes, COMMITTED.json says 64"):
        download_checkpoint(url)


def test_pickle_files_are_refused_on_write_and_read(tmp_path):
    src = hf_dir(tmp_path / "src", {"config.json": b"{}", "pytorch_model.bin": b"pickle"})
    with pytest.raises(CheckpointError, match="'pytorch_model.bin', a pickle-based file"):
        save_checkpoint(src, str(tmp_path / "a"))
    assert not storage.exists(str(tmp_path / "a"))  # nothing uploaded
    url = str(tmp_path / "b")
    save_checkpoint(hf_dir(tmp_path / "ok"), url)
    (tmp_path / "b" / "optimizer.pt").write_bytes(b"pickle")  # planted after commit
    with pytest.raises(CheckpointError, match="'optimizer.pt', a pickle-based file"):
        download_checkpoint(url)
    with pytest.raises(CheckpointError, match="not an allowed file type"):
        save_checkpoint(hf_dir(tmp_path / "py", {"config.json": b"{}", "modeling_x.py": b""}),
                        str(tmp_path / "c"))


def test_overwrite_and_crash_leftovers(tmp_path):
    url = str(tmp_path / "ckpt")
    save_checkpoint(hf_dir(tmp_path / "v1"), url)
    with pytest.raises(FileExistsError, match="already committed"):
        save_checkpoint(hf_dir(tmp_path / "v1"), url)
    v2 = hf_dir(tmp_path / "v2", {"config.json": b'{"v": 2}', "model.safetensors": b"\x01"})
    save_checkpoint(v2, url, overwrite=True)
    assert sorted(os.listdir(url)) == [MARKER, "config.json", "model.safetensors"]
    assert read_marker(url)["files"]["model.safetensors"]["size"] == 1
    # A crashed write leaves files without a marker; the next save replaces them.
    crashed = str(tmp_path / "crashed")
    hf_dir(tmp_path / "crashed", {"config.json": b"{}", "half.safetensors": b"\x00"})
    save_checkpoint(v2, crashed)
    assert sorted(os.listdir(crashed)) == [MARKER, "config.json", "model.safetensors"]


def test_trust_remote_code_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="trust_remote_code"):
        load_model(str(tmp_path), object, trust_remote_code=True)


def test_big_models_are_saved_in_shards_hashed_in_parallel(tmp_path, tiny):
    import blake3

    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    url = str(tmp_path / "sharded")
    marker = save_model_checkpoint(model, tokenizer, url, max_shard_size=weight_bytes // 3, workers=4)
    shards = sorted(rel for rel in marker["files"] if rel.endswith(".safetensors"))
    assert len(shards) >= 3 and "model.safetensors.index.json" in marker["files"]
    for rel in shards:  # each digest belongs to its own file
        data = (tmp_path / "sharded" / rel).read_bytes()
        assert marker["files"][rel] == {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}
    loaded = load_model(url, AutoModelForCausalLM)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)


def test_shard_size_splits_the_weights_over_the_cores_within_bounds():
    from models.checkpoint import MIN_SHARD_BYTES, shard_bytes

    gib = {"a": torch.empty(256, 1 << 20, device="meta")}  # 256 Mi float32 = 1 GiB (no memory)
    assert shard_bytes(gib, parts=2) == 512 << 20
    assert shard_bytes(gib, parts=3) == -(-(1 << 30) // 3)  # rounded up: never a 4th shard
    assert shard_bytes(gib, parts=64) == MIN_SHARD_BYTES  # no shards of 16 MiB
    assert shard_bytes({"a": torch.empty(2 << 30, device="meta")}, parts=1) == 5 * 10**9  # 8 GiB: capped


def test_consumed_local_files_are_linked_not_copied(tmp_path):
    src = hf_dir(tmp_path / "src")
    save_checkpoint(src, str(tmp_path / "copied"))
    save_checkpoint(src, str(tmp_path / "linked"), consume=True)
    inode = os.stat(os.path.join(src, "model.safetensors")).st_ino
    assert os.stat(tmp_path / "copied" / "model.safetensors").st_ino != inode
    assert os.stat(tmp_path / "linked" / "model.safetensors").st_ino == inode
    assert download_checkpoint(str(tmp_path / "linked")) == str(tmp_path / "linked")  # verifies checksums


def test_markers_with_sha256_from_before_blake3_are_still_checked(tmp_path):
    import hashlib

    url = str(tmp_path / "old")
    save_checkpoint(hf_dir(tmp_path / "src"), url)
    marker = json.loads((tmp_path / "old" / MARKER).read_text())
    for rel in marker["files"]:  # as a checkpoint committed by an earlier version wrote them
        data = (tmp_path / "old" / rel).read_bytes()
        marker["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / "old" / MARKER).write_text(json.dumps(marker))
    assert download_checkpoint(url) == url
    (tmp_path / "old" / "model.safetensors").write_bytes(b"\x01" + b"\x00" * 63)  # same size, other bytes
    with pytest.raises(CheckpointError, match="file 'model.safetensors' fails its sha256 check"):
        download_checkpoint(url)


def test_a_hub_snapshot_commits_as_it_is(qwen2_chat_dir, tmp_path):
    """LICENSE, README.md, .gitattributes, merges/vocab, the chat template and generation_config.json
    are committed and copied with the weights; the hidden .cache/ of a ``--local-dir`` download is not."""
    import shutil

    snapshot = tmp_path / "snapshot"
    shutil.copytree(qwen2_chat_dir, snapshot)
    (snapshot / ".cache" / "huggingface").mkdir(parents=True)
    (snapshot / ".cache" / "huggingface" / "model.safetensors.lock").write_text("")
    (snapshot / "LICENSE-MODEL").write_text("terms")
    (snapshot / "NOTICE").write_text("notice")
    url = str(tmp_path / "committed")
    save_checkpoint(str(snapshot), url)
    listed = set(read_marker(url)["files"])
    want = {p.name for p in snapshot.iterdir() if p.is_file()}
    assert listed == want and {"LICENSE", "README.md", ".gitattributes", "merges.txt", "vocab.json",
                               "chat_template.jinja", "generation_config.json"} <= listed
    copy = download_checkpoint(url, str(tmp_path / "copy"))
    assert (tmp_path / "copy" / "LICENSE").read_text() == (snapshot / "LICENSE").read_text()
    assert (tmp_path / "copy" / ".gitattributes").read_bytes() == (snapshot / ".gitattributes").read_bytes()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(copy).chat_template == AutoTokenizer.from_pretrained(snapshot).chat_template


@pytest.mark.parametrize("rel", ["original/consolidated.00.pth", "pytorch_model.bin", "training_args.bin"])
def test_a_hub_snapshot_with_pickled_weights_is_refused_with_the_conversion_hint(qwen2_chat_dir, tmp_path, rel):
    import shutil

    snapshot = tmp_path / "snapshot"
    shutil.copytree(qwen2_chat_dir, snapshot)
    (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
    (snapshot / rel).write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match=rf"'{rel}', a pickle-based file; only safetensors weights are allowed"
                                              rf".*save_pretrained\(out, safe_serialization=True\)"):
        save_checkpoint(str(snapshot), str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c")
