"""RolloutBatch as a Flyte type: only the URI travels between tasks (local execution)."""

import subprocess
import sys
import typing
from pathlib import Path

import pyarrow as pa
import pytest
from flytekit import task, workflow
from flytekit.core.type_engine import TypeEngine
from flytekit.models.core.types import BlobType

from models.data.batch import RolloutBatch
from tasks.batch_type import RolloutBatchTransformer
from tests.unit.tasks.test_batch import rollout_batch


@task
def make_written(url: str) -> RolloutBatch:
    return rollout_batch().write(url)


@task
def make_unwritten() -> RolloutBatch:
    return rollout_batch()


@task
def add_reward(batch: RolloutBatch, url: str) -> RolloutBatch:
    return batch.with_columns(reward=[float(n) for n in batch.response_lengths()]).write(url)


@task
def inspect(batch: RolloutBatch) -> typing.Tuple[str, typing.List[int], typing.List[typing.List[int]]]:
    return batch.uri, batch.table.column("prompt_id").to_pylist(), \
        batch.table.column("response_tokens").to_pylist()


@workflow
def pipeline(rollouts_url: str, score_url: str) -> typing.Tuple[RolloutBatch, RolloutBatch, str]:
    rollouts = make_written(url=rollouts_url)
    scored = add_reward(batch=rollouts, url=score_url)
    seen_uri, _, _ = inspect(batch=rollouts)
    return rollouts, scored, seen_uri


@workflow
def unwritten_pipeline() -> typing.Tuple[str, typing.List[int], typing.List[typing.List[int]]]:
    return inspect(batch=make_unwritten())


def test_literal_type_is_a_single_arrow_blob():
    lt = TypeEngine.to_literal_type(RolloutBatch)
    assert lt.blob.format == "arrow"
    assert lt.blob.dimensionality == BlobType.BlobDimensionality.SINGLE
    assert isinstance(TypeEngine.get_transformer(RolloutBatch), RolloutBatchTransformer)
    assert RolloutBatchTransformer().guess_python_type(lt) is RolloutBatch


def test_workflow_passes_the_uri_without_copying(tmp_path):
    rollouts_url = str(tmp_path / "iter-000000" / "rollouts.arrow")
    score_url = str(tmp_path / "iter-000000" / "score.arrow")
    rollouts, scored, seen_uri = pipeline(rollouts_url=rollouts_url, score_url=score_url)
    assert seen_uri == rollouts_url  # the downstream task got the very same file
    assert rollouts.uri == rollouts_url and scored.uri == score_url
    assert scored.table.column("reward").to_pylist() == [2.0, 0.0, 3.0, 1.0]
    assert scored.table.column("response_tokens").equals(rollout_batch().table.column("response_tokens"))
    assert sorted(p.name for p in (tmp_path / "iter-000000").iterdir()) == [
        "rollouts.arrow", "rollouts.arrow.blake3", "score.arrow", "score.arrow.blake3"]


def test_unwritten_batch_is_written_once_to_flyte_raw_output():
    uri, ids, responses = unwritten_pipeline()
    assert uri.endswith("batch.arrow")
    assert ids == [0, 1, 2, 3]
    assert responses == rollout_batch().table.column("response_tokens").to_pylist()
    with open(uri, "rb") as f:
        assert pa.ipc.open_file(f).read_all().num_rows == 4


@pytest.mark.slow
@pytest.mark.integration
def test_pyflyte_run_executes_the_workflow_locally(tmp_path):
    repo = Path(__file__).resolve().parents[3]
    pyflyte = Path(sys.executable).with_name("pyflyte")
    if not pyflyte.exists():
        pytest.skip(f"no pyflyte next to {sys.executable}")
    result = subprocess.run(
        [str(pyflyte), "run", "tests/unit/tasks/test_batch_type.py",
         "pipeline", "--rollouts_url", str(tmp_path / "r.arrow"), "--score_url", str(tmp_path / "s.arrow")],
        cwd=repo, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"o2='{tmp_path / 'r.arrow'}'" in result.stdout
    assert RolloutBatch.read(str(tmp_path / "s.arrow")).table.column("reward").to_pylist() == [2.0, 0.0, 3.0, 1.0]
