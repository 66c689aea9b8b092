"""fsspec storage helpers: URLs, atomic writes, directories, retries, error messages."""

import errno
import os

import pytest

from models import storage
from models.storage import RetryPolicy, StorageError

NO_WAIT = RetryPolicy(attempts=3, initial_delay_s=0.0)


def test_join_keeps_scheme_and_single_slashes():
    assert storage.join("s3://b/runs/", "r1", "/iter-000001/", "actor") == "s3://b/runs/r1/iter-000001/actor"
    assert storage.join("runs", "r1", "run.json") == "runs/r1/run.json"
    assert storage.join("/", "x") == "/x"
    assert storage.join("file:///tmp/a", "b") == "file:///tmp/a/b"


def test_s3_endpoint_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.delenv("FSSPEC_S3_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    fs, path = storage.fs_and_path("s3://bucket/key", key="k", secret="s")
    assert path == "bucket/key"
    assert fs.endpoint_url == "http://127.0.0.1:1"
    monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", "http://127.0.0.1:2")  # more specific wins
    assert storage.fs_and_path("s3://bucket/key", key="k", secret="s")[0].endpoint_url == "http://127.0.0.1:2"
    explicit = storage.fs_and_path("s3://bucket/key", endpoint_url="http://127.0.0.1:3", key="k", secret="s")[0]
    assert explicit.endpoint_url == "http://127.0.0.1:3"


def test_bytes_and_json_round_trip_locally_and_in_memory(tmp_path):
    for root in (str(tmp_path), f"file://{tmp_path}", "memory://storage-test"):
        url = storage.join(root, "deep", "a.json")
        storage.write_json(url, {"b": [1, 2], "a": "é"})
        assert storage.read_json(url) == {"b": [1, 2], "a": "é"}
        assert storage.exists(url)
        storage.write_bytes(url, b"v2")
        assert storage.read_bytes(url) == b"v2"
        storage.remove(url)
        assert not storage.exists(url)


def test_local_write_is_atomic_and_leaves_no_temp_files(tmp_path, monkeypatch):
    url = str(tmp_path / "state.json")
    storage.write_bytes(url, b"old")

    def crash(*args):
        raise KeyboardInterrupt  # the process dies between writing the temp file and renaming

    with monkeypatch.context() as m:
        m.setattr(os, "replace", crash)
        with pytest.raises(KeyboardInterrupt):
            storage.write_bytes(url, b"new")
    assert (tmp_path / "state.json").read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_missing_file_errors_name_the_url(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"read: not found: {tmp_path}/nope.json"):
        storage.read_json(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid UTF-8 JSON"):
        storage.read_json(str(tmp_path / "bad.json"))
    with pytest.raises(FileNotFoundError, match="remove: not found"):
        storage.remove(str(tmp_path / "nope"), missing_ok=False)


def test_put_get_list_move_and_remove_directories(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"A")
    (src / "sub" / "b.txt").write_bytes(b"BB")
    for root in (str(tmp_path / "dst"), "memory://dirs-test"):
        url = storage.join(root, "ckpt")
        storage.put_dir(str(src), url)
        assert storage.list_files(url) == {"a.txt": 1, "sub/b.txt": 2}
        moved = storage.join(root, "moved")
        storage.move_dir(url, moved)
        assert storage.list_files(url) == {}
        got = tmp_path / f"got-{len(root)}"
        assert storage.get_dir(moved, str(got)) == {"a.txt": 1, "sub/b.txt": 2}
        assert (got / "sub" / "b.txt").read_bytes() == b"BB"
        with pytest.raises(FileExistsError, match="destination is not empty"):
            storage.put_dir(str(src), url)
            storage.move_dir(url, moved)
        storage.remove(moved, recursive=True)
        assert storage.list_files(moved) == {}


def test_transient_errors_are_retried_then_succeed():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    assert storage.with_retry("read", "s3://b/k", flaky, NO_WAIT) == "ok"
    assert len(calls) == 3


def test_retries_give_up_with_the_url_and_count():
    calls = []

    def down():
        calls.append(1)
        raise TimeoutError("read timed out")

    with pytest.raises(StorageError, match=r"read failed for s3://b/k after 3 attempt\(s\): TimeoutError"):
        storage.with_retry("read", "s3://b/k", down, NO_WAIT)
    assert len(calls) == 3


@pytest.mark.parametrize("err", [FileNotFoundError("x"), PermissionError("denied"), ValueError("bad"),
                                 OSError(errno.EROFS, "Read-only file system")])
def test_permanent_errors_are_not_retried(err):
    calls = []

    def fail():
        calls.append(1)
        raise err

    with pytest.raises(type(err)):
        storage.with_retry("read", "s3://b/k", fail, NO_WAIT)
    assert len(calls) == 1


def test_retry_policy_checks_its_fields():
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
