"""Storage faults on a real S3 API: a fault-injecting proxy (``tests/fault_proxy.py``) in front of
the moto server. Transient 503s and connection resets are retried with backoff; a permanent
failure, a missing permission and an unreachable endpoint fail with errors naming the URL;
a corrupted or truncated batch or checkpoint is detected and reported with its URL.

botocore's own retries are switched off (``AWS_MAX_ATTEMPTS=1``) so that what recovers from a
503 here is the project's retry (``models.storage.with_retry``); s3fs still retries resets.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from models import storage
from models.checkpoint import CheckpointError, download_checkpoint, save_model_checkpoint
from models.storage import RetryPolicy, StorageError
from models.data.batch import BatchCorruptError, RolloutBatch, checksum_url
from tests.conftest import _clear_s3fs_cache
from tests.processes import free_port
from tests.fault_proxy import FaultProxy
from tests.unit.models.test_checkpoint import tiny_model_and_tokenizer
from tests.unit.tasks.test_batch import rollout_batch

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def proxy(s3_server, s3_url, monkeypatch):
    """The fault proxy in front of moto, as the S3 endpoint of this test (no faults armed)."""
    with FaultProxy(s3_server) as p:
        for key in ("AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL"):
            monkeypatch.setenv(key, p.url)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        _clear_s3fs_cache()
        yield p
    _clear_s3fs_cache()


def _weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["503", "reset"])
def test_transient_errors_are_retried_for_batches_and_checkpoints(proxy, s3_url, tmp_path, mode):
    from transformers import AutoModelForCausalLM

    proxy.mode = mode
    url = storage.join(s3_url, "iter-000000", "rollouts.arrow")
    batch = rollout_batch()
    steps = []
    for op in (lambda: batch.write(url),
               lambda: RolloutBatch.read(url),
               lambda: save_model_checkpoint(*tiny_model_and_tokenizer(), storage.join(s3_url, "ckpt")),
               lambda: download_checkpoint(storage.join(s3_url, "ckpt"), str(tmp_path / "dl")),
               lambda: storage.exists(url)):
        before = (proxy.faults, proxy.requests)
        proxy.fail_next(2)
        steps.append(op())
        assert proxy.faults - before[0] == 2, "the faults were not hit"
        assert proxy.requests - before[1] >= 3  # the two failed requests were sent again
    assert steps[1].table.equals(batch.table)
    model, _ = tiny_model_and_tokenizer()
    loaded = AutoModelForCausalLM.from_pretrained(steps[3])
    for name, tensor in _weights(model).items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    assert steps[4] is True  # a 503 on HEAD is retried, never read as "does not exist"


def test_without_retries_the_same_fault_fails_naming_the_url(proxy, s3_url):
    url = storage.join(s3_url, "state.json")
    proxy.fail_next(1)
    with pytest.raises(StorageError, match=f"write failed for {url} after 1 attempt"):
        storage.write_bytes(url, b"{}", retry=RetryPolicy(attempts=1))
    proxy.fail_next(1)
    storage.write_bytes(url, b"{}", retry=RetryPolicy(attempts=2, initial_delay_s=0.01))
    assert storage.read_bytes(url) == b"{}"


def test_permanent_failure_gives_up_after_backoff_naming_the_url(proxy, s3_url):
    url = storage.join(s3_url, "iter-000001", "score.arrow")
    proxy.fail_next(100)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=f"write failed for {url} after 4 attempt"):
        storage.write_bytes(url, b"x", retry=RetryPolicy(attempts=4, initial_delay_s=0.1))
    assert time.monotonic() - t0 >= 0.1 + 0.2 + 0.4  # exponential backoff between the attempts
    assert proxy.faults == 4


def test_missing_permission_is_not_retried_and_names_the_url(proxy, s3_url):
    proxy.mode = "403"
    url = storage.join(s3_url, "run.json")
    proxy.fail_next(1)
    with pytest.raises(PermissionError, match=f"permission denied for {url}"):
        storage.write_bytes(url, b"{}")
    assert proxy.faults == 1 and proxy.requests == 1


def test_unreachable_endpoint_names_the_url(s3_env, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for key in ("AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL"):
        monkeypatch.setenv(key, dead)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    _clear_s3fs_cache()
    url = "s3://rlhf-test/nowhere/run.json"
    with pytest.raises(StorageError, match=f"read failed for {url} after 2 attempt"):
        storage.read_bytes(url, retry=RetryPolicy(attempts=2, initial_delay_s=0.01))


def _silent_flip(data: bytes, batch: RolloutBatch) -> bytes:
    """``data`` with one byte flipped such that Arrow and the schema checks still accept it
    (a value changed in place): what only a checksum can catch."""
    import pyarrow as pa

    for pos in range(len(data) // 3, len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        try:
            table = pa.ipc.open_file(pa.py_buffer(bytes(bad))).read_all()
            RolloutBatch(table)
        except Exception:  # noqa: BLE001 - this flip is caught anyway; look further
            continue
        if not table.equals(batch.table):
            return bytes(bad)
    raise AssertionError("no silent flip found")


def test_corrupted_or_truncated_batch_is_reported_with_its_url(s3_url):
    url = storage.join(s3_url, "iter-000003", "advantages.arrow")
    batch = rollout_batch()
    batch.write(url)
    data = storage.read_bytes(url)
    flipped = _silent_flip(data, batch)
    storage.write_bytes(url, flipped)
    with pytest.raises(BatchCorruptError, match=f"batch {url} fails its BLAKE3 check"):
        RolloutBatch.read(url)
    storage.write_bytes(url, data[: len(data) - 100])
    with pytest.raises(BatchCorruptError, match=f"batch {url} fails its BLAKE3 check"):
        RolloutBatch.read(url)
    storage.remove(checksum_url(url))  # without its checksum: truncation still caught, the flip is not
    with pytest.raises(BatchCorruptError, match=f"{url} is not an Arrow IPC file"):
        RolloutBatch.read(url)
    storage.write_bytes(url, flipped)
    assert not RolloutBatch.read(url).table.equals(batch.table)  # silently wrong: why the checksum exists


def test_truncated_or_corrupted_checkpoint_is_reported_with_its_url(proxy, s3_url, tmp_path):
    url = storage.join(s3_url, "iter-000004", "actor")
    save_model_checkpoint(*tiny_model_and_tokenizer(), url)
    # a byte flipped on the way (the stored object is fine): S3's response checksum catches it
    # and the object is fetched again; the copy then passes the marker's checksum
    proxy.mode = "corrupt"
    proxy.match = lambda method, path: method == "GET" and path.endswith("/model.safetensors")
    proxy.fail_next(1)
    download_checkpoint(url, str(tmp_path / "a"))
    gets = [hit for method, path, hit in proxy.log if method == "GET" and path.endswith("/model.safetensors")]
    assert gets == [True, False]
    # a byte flipped in the stored object: only the marker's checksum can tell
    weights = storage.join(url, "model.safetensors")
    data = storage.read_bytes(weights)
    storage.write_bytes(weights, data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    with pytest.raises(CheckpointError, match=f"checkpoint {url}: file 'model.safetensors' fails its blake3"):
        download_checkpoint(url, str(tmp_path / "b"))
    storage.write_bytes(weights, data[:-10])
    with pytest.raises(CheckpointError, match=rf"checkpoint {url}: file 'model.safetensors' has {len(data) - 10} "
                                              rf"bytes, COMMITTED.json says {len(data)}"):
        download_checkpoint(url, str(tmp_path / "c"))


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing: `make sandbox`")
def test_a_read_only_storage_root_fails_at_once_naming_the_url(tmp_path):
    """A read-only file system denies every try (``EROFS``, a plain ``OSError``): the run's first storage
    check says so at once, as a missing permission, instead of retrying it."""
    root = tmp_path / "runs"
    root.mkdir()
    code = ("import sys\nfrom models.run.preflight import check_storage\ntry:\n    check_storage(sys.argv[1])\n"
            "except Exception as err:\n    print(f'{type(err).__name__}: {err}')")
    out = subprocess.run(["bwrap", "--dev-bind", "/", "/", "--ro-bind", str(root), str(root), sys.executable, "-c",
                          code, str(root / "r")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith(f"PermissionError: write: permission denied for {root}/r/.write-check-"), out
    assert "Read-only file system" in out.stdout and "attempt" not in out.stdout
