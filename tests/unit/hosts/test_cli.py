"""``python -m models.hosts``: argument checks that fail before any model is loaded."""

import pytest

from models.hosts.__main__ import main


def test_serve_needs_a_model():
    with pytest.raises(SystemExit, match="give --critic, --reward-model or both"):
        main(["serve"])


def test_token_comes_from_a_set_environment_variable(monkeypatch):
    monkeypatch.delenv("RS_UNSET_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="--token-env RS_UNSET_TOKEN: the environment variable is not set"):
        main(["serve", "--reward-model", "/nonexistent", "--token-env", "RS_UNSET_TOKEN"])


def test_the_token_itself_is_not_a_flag(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--token", "secret"])
    assert "unrecognized arguments: --token secret" in capsys.readouterr().err


def test_serve_rollout_needs_a_committed_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match=r"serve-rollout: checkpoint .*/missing is not committed"):
        main(["serve-rollout", "--checkpoint", str(tmp_path / "missing"), "--engine", "hf", "--storage-root",
              str(tmp_path)])


def test_serve_rollout_names_its_engines(capsys):
    with pytest.raises(SystemExit):
        main(["serve-rollout", "--checkpoint", "/x", "--engine", "trtllm", "--storage-root", "/"])
    assert "argument --engine: invalid choice: 'trtllm'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve-rollout", "--checkpoint", "/x"])  # the root its requests' checkpoints must lie inside
    assert "the following arguments are required: --storage-root" in capsys.readouterr().err
