"""Batches, checkpoints, prompts and run state through a real S3 API (moto server)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from models import storage
from models.checkpoint import CheckpointError, download_checkpoint, is_committed, load_model, \
    save_model_checkpoint
from models.data.batch import RolloutBatch
from models.data.prompts import PromptDataConfig, PromptDataError, load_prompts
from models.run.layout import RunInfo, RunLayout, RunState
from tests.unit.models.test_checkpoint import hf_dir, tiny_model_and_tokenizer
from tests.unit.tasks.test_batch import META, PROMPTS, RESPONSES, rollout_batch

pytestmark = pytest.mark.integration


def test_storage_helpers_on_s3(s3_url, tmp_path):
    url = storage.join(s3_url, "x", "a.json")
    storage.write_json(url, {"a": 1})
    assert storage.read_json(url) == {"a": 1} and storage.exists(url)
    with pytest.raises(FileNotFoundError, match=f"{s3_url}/nope"):
        storage.read_bytes(storage.join(s3_url, "nope"))
    storage.put_dir(hf_dir(tmp_path / "d"), storage.join(s3_url, "d"))
    assert set(storage.list_files(storage.join(s3_url, "d"))) == {
        "config.json", "model.safetensors", "tokenizer/vocab.txt"}
    storage.move_dir(storage.join(s3_url, "d"), storage.join(s3_url, "e"))
    assert storage.list_files(storage.join(s3_url, "d")) == {}
    storage.get_dir(storage.join(s3_url, "e"), str(tmp_path / "back"))
    assert (tmp_path / "back" / "tokenizer" / "vocab.txt").read_bytes() == b"a\nb\n"


def test_batch_round_trip_on_s3(s3_url):
    url = storage.join(s3_url, "iter-000007", "rollouts.arrow")
    rollout_batch().write(url)
    back = RolloutBatch.read(url)
    assert back.uri == url and back.metadata == META
    assert back.table.column("response_tokens").to_pylist() == RESPONSES
    assert back.table.column("prompt_tokens").to_pylist() == PROMPTS
    # plain pyarrow over the raw bytes, no project reader
    table = pa.ipc.open_file(pa.py_buffer(storage.read_bytes(url))).read_all()
    assert table.column("prompt_id").to_pylist() == [0, 1, 2, 3]
    shard = RolloutBatch.read(url, shard=(0, 2)).to_padded(["response_tokens"])
    torch.testing.assert_close(shard["response_tokens"], torch.tensor([[11, 12], [0, 0]]))
    lazy = RolloutBatch.open(url)
    assert len(lazy) == 4


def test_checkpoint_commit_and_verify_on_s3(s3_url, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny_model_and_tokenizer()
    layout = RunLayout(s3_url, "run-a")
    url = layout.actor_url(1)
    save_model_checkpoint(model, tokenizer, url)
    assert is_committed(url)
    assert not [k for k in storage.list_files(layout.iter_dir(1)) if ".tmp-" in k]
    loaded = load_model(url, AutoModelForCausalLM)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    # corrupt one object on S3: the download names the file
    weights = storage.join(url, "model.safetensors")
    data = bytearray(storage.read_bytes(weights))
    data[100] ^= 0xFF
    storage.write_bytes(weights, bytes(data))
    with pytest.raises(CheckpointError, match="'model.safetensors' fails its blake3 check"):
        download_checkpoint(url, str(tmp_path / "dl"))
    # an uncommitted prefix is refused, and state.json will not point at it
    storage.put_dir(hf_dir(tmp_path / "half"), layout.critic_url(1))
    with pytest.raises(CheckpointError, match="is not committed"):
        download_checkpoint(layout.critic_url(1))
    with pytest.raises(CheckpointError, match="critic is not committed"):
        layout.write_state(RunState(iteration=1, actor_url=url, critic_url=layout.critic_url(1)))


def test_run_layout_on_s3(s3_url, tmp_path):
    layout = RunLayout(s3_url, "run-b")
    layout.write_run_info(RunInfo(run_name="run-b", algorithm="ppo", config={"lr": 1e-6}))
    assert layout.read_run_info().config == {"lr": 1e-6}
    assert layout.read_state() is None
    from models.checkpoint import save_checkpoint

    save_checkpoint(hf_dir(tmp_path / "a"), layout.actor_url(0))
    layout.write_state(RunState(iteration=0, actor_url=layout.actor_url(0)))
    assert layout.read_state().actor_url == layout.actor_url(0)


def test_prompts_on_s3(s3_url, tmp_path):
    good = storage.join(s3_url, "prompts", "part-0.jsonl")
    storage.write_bytes(good, b"".join(json.dumps({"prompt": p}).encode() + b"\n" for p in ["a", "b"]))
    local = tmp_path / "part-1.parquet"
    pq.write_table(pa.table({"prompt": ["c"], "answer": ["3"]}), local)
    storage.write_bytes(storage.join(s3_url, "prompts", "part-1.parquet"), local.read_bytes())
    data = load_prompts(PromptDataConfig(url=storage.join(s3_url, "prompts")))
    assert data.prompts == ["a", "b", "c"] and data.columns["answer"] == [None, None, "3"]
    assert load_prompts(PromptDataConfig(url=storage.join(s3_url, "prompts", "*.jsonl"))).prompts == ["a", "b"]
    bad = storage.join(s3_url, "bad.jsonl")
    storage.write_bytes(bad, b'{"prompt": "ok"}\n{"prompt": ""}\n')
    with pytest.raises(PromptDataError, match=r"bad.jsonl line 2 \(row 1\): empty prompt"):
        load_prompts(PromptDataConfig(url=bad))
    with pytest.raises(PromptDataError, match="missing.jsonl: file not found"):
        load_prompts(PromptDataConfig(url=storage.join(s3_url, "missing.jsonl")))


def test_a_read_sees_a_file_another_process_wrote_after_a_listing(s3_url):
    """A listing this process cached (s3fs's dircache) never hides a file another process wrote since: the address
    book reads a service's address without an exists() first (which always dropped cached listings)."""
    import s3fs

    from models.service import book

    run = storage.join(s3_url, "run")
    book.publish(run, book.ServiceAddress("critic", "http://127.0.0.1:1", 40, "exec-1"))
    storage.list_files(storage.join(run, "services"))  # this process now holds the folder's listing
    other = s3fs.S3FileSystem(skip_instance_cache=True, **storage.fs_and_path(run)[0].storage_options)
    address = {"name": "engine", "url": "http://127.0.0.1:2", "pid": 41, "launch": "exec-1"}
    other.pipe_file(storage.fs_and_path(book.address_url(run, "engine"))[1], json.dumps(address).encode())
    assert book.read(run, "engine").pid == 41
