"""``models.environ.environment``: settings for the length of a block, then each as it was, unset ones unset
again, also when the block fails (the vLLM binding, an elastic launch's threads, MLflow's retries use it)."""

from __future__ import annotations

import os

import pytest

from models.environ import environment


def test_settings_last_the_block_and_come_back_as_they_were(monkeypatch):
    monkeypatch.setenv("RLHF_T_SET", "user")
    monkeypatch.delenv("RLHF_T_UNSET", raising=False)
    with pytest.raises(RuntimeError, match="inside"), environment({"RLHF_T_SET": "1", "RLHF_T_UNSET": "2"}):
        assert (os.environ["RLHF_T_SET"], os.environ["RLHF_T_UNSET"]) == ("1", "2")
        raise RuntimeError("inside")
    assert os.environ["RLHF_T_SET"] == "user" and "RLHF_T_UNSET" not in os.environ
    with environment({}):
        assert os.environ["RLHF_T_SET"] == "user"
