"""A checkpoint whose weights hold NaN or inf is never committed (models/checkpoint.check_finite): not
by an update, not as a copy of a user's checkpoint; a committed checkpoint it would replace stays."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from models.checkpoint import CheckpointError, is_committed, read_marker, save_checkpoint, save_model_checkpoint


@pytest.fixture(scope="module")
def qwen(qwen2_chat_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(qwen2_chat_dir), AutoTokenizer.from_pretrained(qwen2_chat_dir)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_update_with_nonfinite_weights_is_not_committed(qwen, tmp_path, bad):
    """The Qwen2 checkpoint ties its head to the embedding: one bad entry there spoils both."""
    model, tok = qwen
    url = str(tmp_path / "iter-000001" / "actor")
    before = save_model_checkpoint(model, tok, url)  # the committed checkpoint a retried update would replace
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.embed_tokens.weight"][3, 5] = bad
    with pytest.raises(CheckpointError, match=r"'model\.safetensors' holds NaN or inf in 1 tensor\(s\) "
                                              r"\(model\.embed_tokens\.weight\); weights that are not finite "
                                              r"are never committed"):
        save_model_checkpoint(model, tok, url, overwrite=True, state_dict=state)
    assert is_committed(url) and read_marker(url)["files"] == before["files"]  # the old one, intact
    assert not [p.name for p in (tmp_path / "iter-000001").iterdir() if ".tmp-" in p.name]


def test_a_user_checkpoint_with_nan_weights_is_refused(qwen2_chat_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "user"
    shutil.copytree(qwen2_chat_dir, src, ignore=shutil.ignore_patterns("LICENSE"))  # refused as a file type today
    weights = load_file(src / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.bfloat16) * float("inf")
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"holds NaN or inf in 2 tensor\(s\) \(model\.layers\.0\.mlp\.up_proj\."
                                              r"weight, model\.norm\.weight\)"):
        save_checkpoint(str(src), str(tmp_path / "reference"))
    assert not is_committed(str(tmp_path / "reference"))


def _peak_rss_since_reset() -> int:
    """This process's peak resident set (VmHWM) in bytes since :func:`_reset_peak`."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux 4.0+)


def test_the_scan_and_the_digest_read_blocks_not_the_whole_file(tmp_path, monkeypatch):
    """A bad value anywhere in a tensor that spans many blocks is found (here past the first block, and in its last
    element), in bfloat16 and float32; the digest is BLAKE3's of the bytes; neither grows the process's resident set by
    the file (a memory map did: the whole file by the end of the pass)."""
    import blake3
    from safetensors.torch import save_file

    from models.checkpoint import file_digest, nonfinite_tensors, tensor_file

    monkeypatch.setattr(tensor_file, "BLOCK", 1 << 20)
    big = torch.zeros(96 << 20, dtype=torch.uint8)  # 96 MiB of float32 zeros, finite
    tensors = {"a.finite": big.view(torch.float32), "b.late_nan": torch.zeros(3 << 20, dtype=torch.bfloat16),
               "c.last_inf": torch.zeros(1 << 19), "d.ints": torch.full((7,), -1, dtype=torch.int32)}
    tensors["b.late_nan"][(1 << 20) + 5] = float("nan")  # in the third block of 1 MiB
    tensors["c.last_inf"][-1] = float("-inf")
    path = str(tmp_path / "state.safetensors")
    save_file(tensors, path)
    del big, tensors
    with open(path, "rb") as f:
        expected = {"size": os.path.getsize(path), "blake3": blake3.blake3(f.read()).hexdigest()}
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("no /proc/self/clear_refs to reset the peak resident set")
    for scan, want in ((nonfinite_tensors, ["b.late_nan", "c.last_inf"]), (file_digest, expected)):
        _reset_peak()
        base = _peak_rss_since_reset()
        assert scan(path) == want
        assert _peak_rss_since_reset() - base < 40 << 20, scan.__name__  # a map of the 100 MiB file: ~100 MiB more


def test_a_file_that_is_no_safetensors_is_not_scanned(tmp_path):
    """Bytes whose first 8 give a header longer than the file (or no JSON object): no tensors to check, and no read
    of that many bytes (the scan read 8 EiB's worth and failed with MemoryError)."""
    from models.checkpoint import nonfinite_tensors
    from models.checkpoint.tensor_file import read_header

    for i, data in enumerate((b"not weights at all, just text", b"\x02\x00\x00\x00\x00\x00\x00\x00[]")):
        path = tmp_path / f"{i}.safetensors"
        path.write_bytes(data)
        assert nonfinite_tensors(str(path)) == []
        with pytest.raises(ValueError, match="is not a safetensors file"):
            read_header(str(path))


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_a_commit_hashes_and_checks_its_weights_from_one_read(tmp_path, monkeypatch):
    """``checked_digest``, what a commit records for a weights file: :func:`file_digest`'s digest and the finite
    check's verdict from one read of the file (the commit read it once for each: twice a checkpoint's size from disk
    where the page cache cannot hold it), across blocks, dtypes and tensors of every size; a file that is no
    safetensors file is hashed whole, unchecked."""
    from safetensors.torch import save_file

    from models.checkpoint import checked_digest, file_digest, tensor_file

    monkeypatch.setattr(tensor_file, "BLOCK", 1 << 20)
    tensors = {"a": torch.zeros(3 << 20), "b": torch.zeros((1 << 20) + 3, dtype=torch.bfloat16),
               "c": torch.zeros(5, dtype=torch.float16), "d": torch.arange(7, dtype=torch.int64)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    size = os.path.getsize(path)
    before = _bytes_read()
    got = checked_digest(path, "model.safetensors", "s3://b/run/iter-000001/actor")
    read = _bytes_read() - before
    assert got == file_digest(path) and got["size"] == size
    assert size <= read < 1.2 * size, (read, size)  # once; the two passes read 2x
    tensors["b"][(1 << 19) + 1] = float("nan")  # the second block of b's
    tensors["c"][-1] = float("inf")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"s3://b/run/iter-000001/actor: 'model\.safetensors' holds NaN or inf "
                                              r"in 2 tensor\(s\) \(b, c\)"):
        checked_digest(path, "model.safetensors", "s3://b/run/iter-000001/actor")
    with open(path, "r+b") as f:  # cut inside the last tensor: refused, as the separate check refused it
        f.truncate(size - 8)
    with pytest.raises(ValueError, match="truncated file"):
        checked_digest(path, "model.safetensors", "u")
    other = tmp_path / "x.safetensors"
    other.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]" + b"\x00" * 100)
    assert checked_digest(str(other), "x.safetensors", "u") == file_digest(str(other))
