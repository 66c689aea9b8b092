"""Shared fixtures: a real S3 API (moto's server, loopback only) for storage tests.

``s3_server`` (session) starts ``python -m moto.server`` as a subprocess (its own process,
so no in-process moto patching can leak into other tests) and creates a bucket.
``s3_env`` points the standard AWS/fsspec environment at it for one test, and ``s3_url``
gives each test a fresh ``s3://bucket/<test-prefix>``.
"""

from __future__ import annotations

import uuid

import pytest

from tests.processes import S3_ENV_TO_UNSET, free_port, moto_s3_server, s3_client_env
from tests.timing import SuiteTiming

BUCKET = "rlhf-test"
_free_port = free_port  # other test modules import it from here


def pytest_configure(config):
    """The suite's cost at its end (``tests/timing.py``): total wall time, slowest tests and files."""
    config.pluginmanager.register(SuiteTiming(), "suite-timing")


def worker_group(nodeid: str) -> str:
    """What one pytest-xdist worker runs as a whole: a file (its module fixtures, e.g. a trained run or a
    started engine, are made once), and all of ``tests/cluster`` (its session fixtures, the compiled
    packages and the servers they are registered with, are made once)."""
    path = nodeid.split("::", 1)[0]
    return "tests/cluster" if path.startswith("tests/cluster/") else path


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: `make test` runs `-n 2`
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class TestGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return TestGroups(config, log)


def _clear_s3fs_cache() -> None:
    try:
        import s3fs
    except ImportError:  # pragma: no cover
        return
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_server():
    """Endpoint URL of a moto S3 server on 127.0.0.1 with a bucket ``BUCKET`` (one per session).

    The environment is left alone here; :func:`s3_env` points it at the server per test.
    """
    with moto_s3_server(BUCKET) as endpoint:
        yield endpoint


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Standard AWS/fsspec environment pointing at the moto server, for one test.

    Sets ``AWS_ENDPOINT_URL``, ``FSSPEC_S3_ENDPOINT_URL``, dummy credentials and region;
    clears s3fs's instance cache before and after so no filesystem keeps a stale endpoint.
    """
    for key, value in s3_client_env(s3_server).items():
        monkeypatch.setenv(key, value)
    for key in S3_ENV_TO_UNSET:
        monkeypatch.delenv(key, raising=False)
    _clear_s3fs_cache()
    yield s3_server
    _clear_s3fs_cache()


@pytest.fixture
def s3_url(s3_env, request):
    """A fresh ``s3://rlhf-test/<test name>-<uuid>`` prefix on the moto server."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40]
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def qwen2_chat_dir(tmp_path_factory):
    """A Qwen2-shaped chat checkpoint as users download them (``models/demos/hub_models.py``): tied
    embeddings, byte-level BPE, ChatML template, two eos ids and sampling defaults in
    ``generation_config.json``, LICENSE/README.md/.gitattributes. Read-only: copy it to change it."""
    from models.demos.hub_models import build_qwen2_chat

    return build_qwen2_chat(tmp_path_factory.mktemp("hub") / "qwen2-chat")


@pytest.fixture(scope="session")
def llama_bpe_dir(tmp_path_factory):
    """A Llama-shaped checkpoint with a byte-level BPE tokenizer that has no pad token (untied head)."""
    from models.demos.hub_models import HubModelConfig, build_llama_bpe

    return build_llama_bpe(tmp_path_factory.mktemp("hub") / "llama-bpe", HubModelConfig(num_kv_heads=2))


@pytest.fixture(scope="session")
def qwen2_sharp_dir(tmp_path_factory):
    """The Qwen2-shaped chat checkpoint with its head scaled ×10 (``HubModelConfig.logit_scale``): peaked
    next-token distributions, so sampling settings and stale weights make clear differences."""
    from models.demos.hub_models import HubModelConfig, build_qwen2_chat

    return build_qwen2_chat(tmp_path_factory.mktemp("hub") / "qwen2-sharp", HubModelConfig(logit_scale=10.0))
