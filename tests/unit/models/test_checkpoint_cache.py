"""The node's checkpoint cache: one download per node and content however many processes ask at once,
entries keyed by the committed files (not the URL), at most ``keep`` kept, a half-made entry redone."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from models.checkpoint import MARKER, download_checkpoint, read_marker, save_checkpoint
from models.checkpoint.cache import READY, cached, content_digest, entries
from tests.unit.models.test_checkpoint import hf_dir


def committed(tmp_path, name: str, weights: bytes) -> str:
    src = hf_dir(tmp_path / f"{name}-src", {"config.json": b'{"model_type": "llama"}', "model.safetensors": weights})
    url = str(tmp_path / name)
    save_checkpoint(src, url)
    return url


def counting_download(log: str):
    """The real verified download, each call recorded in ``log`` (one line per download)."""
    def download(url: str, folder: str) -> None:
        with open(log, "a") as f:
            f.write(f"{url}\n")
        download_checkpoint(url, folder)
    return download


def _rank(url: str, root: str, log: str, out: str) -> None:
    path = cached(url, read_marker(url), counting_download(log), root)
    with open(out, "w") as f:
        f.write(path)


@pytest.mark.slow
def test_ranks_of_a_node_share_one_download(tmp_path):
    url = committed(tmp_path, "actor", b"\x01" * 4096)
    root, log = str(tmp_path / "cache"), str(tmp_path / "downloads.log")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(url, root, log, str(tmp_path / f"rank{i}"))) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    paths = {(tmp_path / f"rank{i}").read_text() for i in range(4)}
    assert open(log).read().splitlines() == [url]  # four processes, one download
    (entry,) = paths
    assert os.path.basename(entry) == content_digest(read_marker(url))
    assert open(os.path.join(entry, "model.safetensors"), "rb").read() == b"\x01" * 4096
    assert os.path.isfile(os.path.join(entry, MARKER)) and os.path.isfile(entry + READY)
    assert sorted(os.listdir(entry)) == [MARKER, "config.json", "model.safetensors"]  # a plain checkpoint copy


def test_entries_are_keyed_by_content_and_bounded(tmp_path):
    root, log = str(tmp_path / "cache"), str(tmp_path / "downloads.log")
    a = committed(tmp_path, "a", b"\x0a" * 64)
    a_again = committed(tmp_path, "a-copy", b"\x0a" * 64)  # the same files at another URL
    b, c = committed(tmp_path, "b", b"\x0b" * 64), committed(tmp_path, "c", b"\x0c" * 64)
    get = lambda url: cached(url, read_marker(url), counting_download(log), root, keep=2)  # noqa: E731
    assert get(a) == get(a_again)
    get(b)
    get(a)  # a is now the most recently used
    get(c)  # the cache keeps two: b, the least recently used, goes
    assert {name for _, name in entries(root)} == {content_digest(read_marker(u)) for u in (a, c)}
    assert not os.path.exists(os.path.join(root, content_digest(read_marker(b))))
    get(b)  # back again: downloaded again
    assert open(log).read().splitlines() == [a, b, c, b]


def test_a_checkpoint_rewritten_at_its_url_is_a_new_entry(tmp_path):
    root, log = str(tmp_path / "cache"), str(tmp_path / "downloads.log")
    url = committed(tmp_path, "actor", b"\x01" * 64)
    first = cached(url, read_marker(url), counting_download(log), root)
    src = hf_dir(tmp_path / "new", {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\x02" * 64})
    save_checkpoint(src, url, overwrite=True)  # e.g. a retried update committing again
    second = cached(url, read_marker(url), counting_download(log), root)
    assert first != second and open(os.path.join(second, "model.safetensors"), "rb").read() == b"\x02" * 64


def test_an_entry_left_half_made_is_downloaded_again(tmp_path):
    root, log = str(tmp_path / "cache"), str(tmp_path / "downloads.log")
    url = committed(tmp_path, "actor", b"\x01" * 64)
    entry = os.path.join(root, content_digest(read_marker(url)))
    os.makedirs(entry)
    open(os.path.join(entry, "model.safetensors"), "wb").write(b"\x00" * 10)  # a process killed mid-download
    assert cached(url, read_marker(url), counting_download(log), root) == entry
    assert open(os.path.join(entry, "model.safetensors"), "rb").read() == b"\x01" * 64
    assert open(log).read().splitlines() == [url]


def test_a_corrupted_download_leaves_no_entry(tmp_path):
    root = str(tmp_path / "cache")
    url = committed(tmp_path, "actor", b"\x01" * 64)
    with open(os.path.join(url, "model.safetensors"), "r+b") as f:
        f.write(b"\xff")
    with pytest.raises(Exception, match="fails its blake3 check"):
        cached(url, read_marker(url), download_checkpoint, root)
    assert entries(root) == []


def _reader(url: str, root: str, out: str, done) -> None:
    """A process of the node reading its entry until ``done`` is set (e.g. a vLLM engine loading it)."""
    path = cached(url, read_marker(url), download_checkpoint, root, keep=1)
    with open(out, "w") as f:
        f.write(path)
    done.wait(120)


def test_an_entry_another_process_uses_is_not_evicted(tmp_path):
    """Two runs on one machine share the cache: one's use never removes what the other still reads
    (CI's failure of 2026-11-26: a vLLM engine pointed at a folder another run had evicted)."""
    root = str(tmp_path / "cache")
    a, b, c = (committed(tmp_path, n, bytes([i]) * 64) for i, n in enumerate("abc"))
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Event()
    reader = ctx.Process(target=_reader, args=(a, root, str(tmp_path / "path"), done))
    reader.start()
    try:
        for _ in range(600):
            if (tmp_path / "path").exists() and (tmp_path / "path").read_text():
                break
            reader.join(0.1)
        entry_a = (tmp_path / "path").read_text()
        cached(b, read_marker(b), download_checkpoint, root, keep=1)  # keep=1: a is beyond it, but in use
        assert open(os.path.join(entry_a, "model.safetensors"), "rb").read() == b"\x00" * 64
        assert os.path.isfile(entry_a + READY)
    finally:
        done.set()
        reader.join(120)
    assert reader.exitcode == 0
    cached(c, read_marker(c), download_checkpoint, root, keep=1)  # the reader is gone: a and b may go now
    assert {name for _, name in entries(root)} == {content_digest(read_marker(c))}
    assert not os.path.exists(entry_a)
