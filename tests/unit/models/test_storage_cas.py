"""Compare-and-swap writes (models/storage/cas.py) on a local folder and on S3 (moto): a create succeeds
once, a replace only from the version read, and of two writers that read the same version one wins."""

from __future__ import annotations

import threading

import pytest

from models import storage
from models.storage.cas import read_versioned, write_if


def check_cas(url: str) -> None:
    assert read_versioned(url) is None
    assert write_if(url, b"one", None)
    assert not write_if(url, b"other", None)  # it exists now
    data, v1 = read_versioned(url)
    assert data == b"one"
    assert write_if(url, b"two", v1)
    assert not write_if(url, b"late", v1)  # a writer that read the old version loses
    data, v2 = read_versioned(url)
    assert data == b"two" and v2 != v1
    assert not write_if(storage.join(url + "-missing"), b"x", v2)  # replace of nothing


def race(url: str, writers: int = 8) -> list:
    """``writers`` threads that all read the same version, then each try to replace it."""
    write_if(url, b"start", None)
    _, version = read_versioned(url)
    results, gate = [], threading.Barrier(writers)

    def go(i: int) -> None:
        gate.wait()
        results.append(write_if(url, f"w{i}".encode(), version))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_local_compare_and_swap(tmp_path):
    url = str(tmp_path / "run" / "lock.json")
    check_cas(url)
    assert sorted(race(str(tmp_path / "race.json"))) == [False] * 7 + [True]


@pytest.mark.integration  # a moto S3 server process (tests/conftest.py)
def test_s3_compare_and_swap(s3_url):
    check_cas(storage.join(s3_url, "lock.json"))
    assert sorted(race(storage.join(s3_url, "race.json"))) == [False] * 7 + [True]


def test_other_stores_are_refused():
    with pytest.raises(NotImplementedError, match=r"memory://x/lock\.json: compare-and-swap writes .* need a local "
                                                  r"folder or S3, not memory://"):
        read_versioned("memory://x/lock.json")
