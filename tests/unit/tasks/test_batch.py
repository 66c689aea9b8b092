"""RolloutBatch: building, Arrow round trips, schema checks, stage discipline."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from models.data.batch import RolloutBatch
from models.data.batch_schema import (ADVANTAGE_COLUMNS, ROLLOUT_COLUMNS, BatchMetadata, BatchSchemaError,
                                validate_table)

META = BatchMetadata(iteration=7, policy_version=7, algorithm="grpo",
                     created_at="2025-01-02T03:04:05+00:00", extras={"run_name": "demo"})
PROMPTS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
RESPONSES = [[11, 12], [], [13, 14, 15], [16]]  # row 1: empty response
LOGP = [[-0.5, -1.5], [], [-0.1, -0.2, -0.3], [-2.0]]


def rollout_batch(prompts=PROMPTS, responses=RESPONSES, logp=LOGP) -> RolloutBatch:
    return RolloutBatch.from_rollout(
        META, prompt_id=list(range(len(prompts))), prompt_tokens=prompts, response_tokens=responses,
        sampler_logprobs=logp, is_end=[i % 2 == 0 for i in range(len(prompts))],
        prompt=[f"p{i}" for i in range(len(prompts))], response=[f"r{i}" for i in range(len(prompts))])


def test_round_trip_ragged_with_empty_response(tmp_path):
    url = str(tmp_path / "iter-000007" / "rollouts.arrow")
    written = rollout_batch().write(url)
    assert written.uri == url
    back = RolloutBatch.read(url)
    assert back.uri == url
    assert back.table.column("response_tokens").to_pylist() == RESPONSES
    assert back.table.column("prompt_tokens").to_pylist() == PROMPTS
    np.testing.assert_allclose(np.concatenate([np.asarray(x, np.float32) for x in
                                               back.table.column("sampler_logprobs").to_pylist()]),
                               np.float32([-0.5, -1.5, -0.1, -0.2, -0.3, -2.0]))
    assert back.table.column("is_end").to_pylist() == [True, False, True, False]
    assert back.table.column("response").to_pylist() == ["r0", "r1", "r2", "r3"]
    assert back.metadata == META
    assert back.column_names[:5] == list(ROLLOUT_COLUMNS)
    assert list(back.response_lengths()) == [2, 0, 3, 1]


def test_all_responses_empty(tmp_path):
    batch = rollout_batch(responses=[[], [], [], []], logp=[[], [], [], []]).write(str(tmp_path / "b.arrow"))
    back = RolloutBatch.read(batch.uri)
    out = back.to_padded(["response_tokens", "sampler_logprobs"])
    assert out["response_tokens"].shape == (4, 0)
    assert out["response_mask"].shape == (4, 0)
    inputs = back.to_model_inputs()
    assert inputs.response_positions.shape == (4, 0)
    assert inputs.input_ids.shape == (4, 4)
    assert not inputs.is_response.any()


def test_plain_pyarrow_can_read_a_batch(tmp_path):
    path = tmp_path / "rollouts.arrow"
    rollout_batch().write(str(path))
    with open(path, "rb") as f:  # exactly what the module docstring tells a new user
        table = pa.ipc.open_file(f).read_all()
    assert table.column("response_tokens")[0].as_py() == [11, 12]
    assert table.column("prompt_id").to_pylist() == [0, 1, 2, 3]
    assert table.schema.field("sampler_logprobs").type == pa.list_(pa.float32())
    assert table.schema.metadata[b"iteration"] == b"7"
    assert table.schema.metadata[b"algorithm"] == b"grpo"


def test_metadata_round_trip_and_missing_metadata(tmp_path):
    url = str(tmp_path / "b.arrow")
    rollout_batch().with_metadata(policy_version=6).write(url)
    meta = RolloutBatch.read(url).metadata
    assert (meta.iteration, meta.policy_version, meta.algorithm) == (7, 6, "grpo")
    assert meta.created_at == META.created_at and meta.extras == {"run_name": "demo"}
    bare = pa.table({"prompt_id": pa.array([1], pa.int64())})
    with pytest.raises(BatchSchemaError, match="lacks.*iteration"):
        RolloutBatch(bare)


def test_from_padded_tensor_and_mask_gives_ragged_rows():
    # Left-padded [B, T] token tensor (as a generation engine returns prompts) + mask.
    tokens = torch.tensor([[0, 0, 1, 2], [3, 4, 5, 6], [0, 0, 0, 7]])
    mask = tokens != 0
    batch = RolloutBatch.from_columns(META, prompt_id=torch.arange(3), prompt_tokens=(tokens, mask))
    assert batch.table.column("prompt_tokens").to_pylist() == [[1, 2], [3, 4, 5, 6], [7]]
    assert batch.table.schema.field("prompt_id").type == pa.int64()


def test_with_columns_cuts_padded_response_columns_to_response_lengths():
    batch = rollout_batch()
    logp = torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)  # [B, T_resp], padded junk beyond
    scored = batch.with_columns(old_logprobs=logp, reward=np.array([1.0, 0.0, 0.5, 2.0]))
    assert scored.table.column("old_logprobs").to_pylist() == [[0, 1], [], [6, 7, 8], [9]]
    assert scored.table.schema.field("reward").type == pa.float32()
    assert batch.column_names == rollout_batch().column_names  # the original is untouched
    assert scored.uri is None


def test_with_columns_refuses_to_overwrite(tmp_path):
    batch = rollout_batch().write(str(tmp_path / "b.arrow"))
    with pytest.raises(BatchSchemaError, match=r"\['sampler_logprobs'\] already exist"):
        batch.with_columns(sampler_logprobs=LOGP)


def test_missing_column_is_named(tmp_path):
    batch = rollout_batch()
    with pytest.raises(BatchSchemaError, match=r"missing column\(s\) \['old_logprobs', 'advantages'\]"):
        batch.validate(required=["old_logprobs", "advantages"])
    url = batch.write(str(tmp_path / "b.arrow")).uri
    with pytest.raises(BatchSchemaError, match="b.arrow: missing.*'reward'"):
        RolloutBatch.read(url, required=ADVANTAGE_COLUMNS[:8])


@pytest.mark.parametrize("name, array, actual", [
    ("old_logprobs", pa.array([[0.1, 0.2], [], [1.0, 2.0, 3.0], [4.0]], pa.list_(pa.float64())),
     "list<item: double>"),
    ("prompt_tokens", pa.array([1, 2, 3, 4], pa.int32()), "int32"),  # int instead of list<int32>
    ("reward", pa.array([1, 2, 3, 4], pa.int64()), "int64"),
    ("response_tokens", pa.array([[1]] * 4, pa.large_list(pa.int32())), "large_list"),
])
def test_mistyped_column_is_named_with_expected_and_actual_type(name, array, actual):
    table = rollout_batch().table.drop_columns([name]) if name in rollout_batch().column_names \
        else rollout_batch().table
    table = table.append_column(name, array)
    with pytest.raises(BatchSchemaError, match=f"column '{name}' has type {actual}.*expected"):
        validate_table(table)


def test_null_value_is_named_with_row():
    table = rollout_batch().table.append_column("reward", pa.array([1.0, None, 2.0, 3.0], pa.float32()))
    with pytest.raises(BatchSchemaError, match="column 'reward' is null at row 1"):
        validate_table(table)


def test_per_row_length_mismatch_names_the_row():
    bad = [[-0.5, -1.5], [], [-0.1, -0.2], [-2.0]]  # row 2 has 2 entries, response has 3
    with pytest.raises(BatchSchemaError, match=r"row 2: 'sampler_logprobs' has 2 entries but "
                                               r"'response_tokens' has 3"):
        rollout_batch(logp=bad)
    with pytest.raises(BatchSchemaError, match="row 0: 'advantages' has 3 entries"):
        rollout_batch().with_columns(advantages=[[1, 2, 3], [], [1, 2, 3], [1]])


def test_wrong_number_of_rows_is_refused():
    with pytest.raises(BatchSchemaError, match="'reward' has 3 rows, batch has 4"):
        rollout_batch().with_columns(reward=[1.0, 2.0, 3.0])


def test_read_columns_and_shard(tmp_path):
    url = rollout_batch().write(str(tmp_path / "b.arrow")).uri
    part = RolloutBatch.read(url, columns=["prompt_id", "response_tokens"], shard=(1, 3))
    assert part.column_names == ["prompt_id", "response_tokens"]
    assert part.table.column("prompt_id").to_pylist() == [2]  # 4 rows over 3 ranks: 2, 1, 1
    assert part.uri is None  # partial content is not the file
    assert part.metadata.iteration == 7


def test_open_is_lazy_and_reads_on_first_use(tmp_path):
    url = str(tmp_path / "later.arrow")
    lazy = RolloutBatch.open(url)  # the file does not exist yet: nothing is read
    assert "not loaded" in repr(lazy)
    rollout_batch().write(url)
    assert lazy.table.column("prompt_id").to_pylist() == [0, 1, 2, 3]
    with pytest.raises(FileNotFoundError, match="missing.arrow"):
        RolloutBatch.open(str(tmp_path / "missing.arrow")).num_rows


def test_non_arrow_file_is_reported_with_its_url(tmp_path):
    path = tmp_path / "junk.arrow"
    path.write_bytes(b"not arrow at all")
    with pytest.raises(BatchSchemaError, match="junk.arrow is not an Arrow IPC file"):
        RolloutBatch.read(str(path))


def test_extra_columns_are_kept_unchecked(tmp_path):
    batch = rollout_batch().with_columns(group_size=[4, 4, 4, 4])
    back = RolloutBatch.read(batch.write(str(tmp_path / "b.arrow")).uri)
    assert back.table.column("group_size").to_pylist() == [4, 4, 4, 4]


def test_ragged_rows_as_tensors_and_extra_list_columns_pad_to_their_own_width():
    rows = [torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.long), torch.tensor([4])]
    batch = RolloutBatch.from_columns(META, prompt_id=[0, 1, 2], response_tokens=rows)
    assert batch.table.column("response_tokens").to_pylist() == [[1, 2, 3], [], [4]]
    extra = batch.with_columns(kl=[[0.1, 0.2, 0.3, 0.4, 0.5], [], [0.0]])  # not a known column
    padded = extra.to_padded(["kl", "response_tokens"])
    assert padded["kl"].shape == (3, 5) and padded["response_tokens"].shape == (3, 3)
    torch.testing.assert_close(padded["kl"][2], torch.tensor([0.0, 0, 0, 0, 0], dtype=torch.float64))


def test_written_file_is_the_ipc_bytes_and_the_sidecar_their_blake3(tmp_path):
    import blake3

    from models.data.batch import checksum_url

    one = rollout_batch()
    chunked = RolloutBatch(pa.concat_tables([one.table, one.table.slice(1, 2)]), META)  # 2 record batches
    url = str(tmp_path / "b.arrow")
    chunked.write(url)
    data = (tmp_path / "b.arrow").read_bytes()
    assert data == chunked.to_ipc_bytes()
    assert (tmp_path / "b.arrow.blake3").read_text() == blake3.blake3(data).hexdigest()  # one-threaded reference
    assert checksum_url(url) == str(tmp_path / "b.arrow.blake3")
    back = RolloutBatch.read(url)
    assert back.table.column("response_tokens").to_pylist() == RESPONSES + RESPONSES[1:3]
