"""Full weights committed by every rank (``actor.checkpoint_by_rank``, ``critic.checkpoint_by_rank``:
``models/training/weight_shards.py``) through the update's own commit (``models/stages/updates.py``
``commit_trained``), on two gloo ranks under FSDP2, on S3 (moto): each rank uploads one file of the Hugging
Face sharded layout, and the folder loads with ``from_pretrained`` (and the rank-local loader) to exactly the
weights of rank 0's whole write. A rank whose weights are not finite makes both ranks fail, nothing committed."""

from __future__ import annotations

import json
import os

import pytest
import torch

from models import storage
from models.checkpoint import CheckpointError, download_checkpoint, is_committed
from models.config import ActorConfig, ConfigError, CriticConfig, LoraConfig
from models.stages.updates import commit_trained, load_for_update
from models.training.distributed import DistInfo, full_state_dict, unwrap
from models.training.sharded_load import INDEX
from models.training.weight_shards import applies, assign, converted, weight_file
from tests.processes import free_port
from tests.ranks import spawn
from tests.unit.models.test_sharded_load import role
from tests.unit.models.test_sharded_update import join_gloo

ROLES = {"actor": ("lm", ActorConfig), "critic": ("critic", CriticConfig)}
"""The trained model's attribute in the training wrapper and the config section of each role."""


def _writes(fn) -> dict:
    """``{file name: bytes}`` of the safetensors files this process uploads while ``fn`` runs."""
    with storage.count_bytes() as records:
        fn()
    return {t.url.rsplit("/", 1)[-1]: t.nbytes for t in records if t.op == "write" and t.url.endswith(".safetensors")}


def _commit_both(name: str, ckpt: str, root: str, info: DistInfo, tokenizer) -> dict:
    """On every rank: ``ckpt`` loaded by shard, committed whole and by rank (the bytes this rank uploads
    for each), then the by-rank folder read back by shard: equal to what was committed?"""
    from torch.distributed.tensor import DTensor

    auto, task, wrapper, _ = role(name)
    inner, section = ROLES[name]
    model = load_for_update(ckpt, auto, "float32", LoraConfig(), task, wrapper, False, info, "fsdp2")
    out = {"applies": applies(model, getattr(unwrap(model), inner), info)}
    for mode in ("whole", "by_rank"):
        config = section(checkpoint_by_rank=mode == "by_rank", keep_optimizer_state=False)
        url = storage.join(root, name, mode)
        out[mode] = _writes(lambda: commit_trained(model, None, tokenizer, url, ckpt, inner, config, {}, name, info))
    again = load_for_update(storage.join(root, name, "by_rank"), auto, "float32", LoraConfig(), task, wrapper,
                            False, info, "fsdp2")
    want, got = full_state_dict(model), full_state_dict(again)
    out["read_back_equal"] = set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    if name == "actor":  # a resident push's source: one gather per tensor, whole on rank 0 only, the tie kept once
        from models.training.weight_source import WeightSource

        source = WeightSource(model, info)
        pushed = dict(source.gathered(torch.device("cpu"), torch.bfloat16))  # cast on each rank, then gathered
        mine = {k[len("lm."):]: v.bfloat16() for k, v in (want or {}).items() if k.startswith("lm.")}
        out["push"] = {"aliases": source.aliases, "none": sorted(k for k, v in pushed.items() if v is None),
                       "equal": all(torch.equal(pushed[k], mine[k]) for k in pushed) if info.is_main else None,
                       "names": sorted(pushed)}
    if name == "actor":  # a non-finite weight on rank 1's rows: refused on both ranks, no rank left waiting
        param = next(p for n, p in model.named_parameters() if n.endswith("layers.1.mlp.up_proj.weight"))
        local = param.to_local() if isinstance(param, DTensor) else param
        if info.rank == 1:
            with torch.no_grad():
                local[0, 0] = float("nan")
        config = section(checkpoint_by_rank=True, keep_optimizer_state=False)
        try:
            commit_trained(model, None, tokenizer, storage.join(root, name, "nan"), ckpt, inner, config, {}, name, info)
            out["nan"] = "committed"
        except CheckpointError as err:
            out["nan"] = str(err)
    return out


def _worker(rank: int, world: int, port: int, cases: dict, root: str, out_dir: str) -> None:
    import torch.distributed as dist

    from models.checkpoint.local import load_tokenizer

    info = join_gloo(rank, world, port)
    try:
        for name, ckpt in cases.items():
            out = _commit_both(name, ckpt, root, info, load_tokenizer(ckpt))
            with open(os.path.join(out_dir, f"{name}-rank{rank}.json"), "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def critic_dir(qwen2_chat_dir, tmp_path_factory):
    """A critic (value head of one row: rank 1 holds none of it) on the Qwen2 chat model, with its tokenizer."""
    from models.training.critic_init import critic_from_actor

    return str(critic_from_actor(qwen2_chat_dir, tmp_path_factory.mktemp("critic") / "critic", seed=3))


@pytest.mark.slow  # starts two ranks
def test_each_rank_uploads_its_file_and_the_folder_loads_as_rank_0s_whole_write(qwen2_chat_dir, critic_dir,
                                                                                s3_url, tmp_path):
    """Both roles (the tied Qwen2 policy, its critic): by rank, each rank uploads exactly its
    ``model-0000{r+1}-of-00002.safetensors`` (without the option rank 1 uploads nothing); the folder has the
    two files and the index, the configs and tokenizer of the whole write, and ``from_pretrained`` reads
    bit-identical tensors from both; two ranks reading it back by shard hold what was committed."""
    from models.checkpoint import save_checkpoint

    cases = {}
    for name, src in (("actor", qwen2_chat_dir), ("critic", critic_dir)):
        cases[name] = storage.join(s3_url, "start", name)
        save_checkpoint(str(src), cases[name])
    spawn(_worker, (2, free_port(), cases, s3_url, str(tmp_path)))
    push = [json.loads((tmp_path / f"actor-rank{r}.json").read_text())["push"] for r in range(2)]
    assert push[0]["equal"] and push[0]["none"] == [] and push[1]["none"] == push[1]["names"] == push[0]["names"]
    assert push[0]["aliases"] == push[1]["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    for name in cases:
        ranks = [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in range(2)]
        assert all(r["applies"] and r["read_back_equal"] for r in ranks)
        assert list(ranks[1]["whole"]) == []  # rank 0 writes the whole folder alone
        files = [weight_file(r, 2) for r in range(2)]
        assert [list(r["by_rank"]) for r in ranks] == [[files[0]], [files[1]]]
        whole = download_checkpoint(storage.join(s3_url, name, "whole"), str(tmp_path / f"{name}-whole"))
        by_rank = download_checkpoint(storage.join(s3_url, name, "by_rank"), str(tmp_path / f"{name}-by-rank"))
        _same_folder(name, whole, by_rank, files)
        # balanced by bytes: the two files differ by less than their largest tensor
        sizes = [ranks[r]["by_rank"][files[r]] for r in range(2)]
        assert abs(sizes[0] - sizes[1]) < max(sizes)
    nan = [json.loads((tmp_path / f"actor-rank{r}.json").read_text())["nan"] for r in range(2)]
    # the owner of the NaN's tensor refuses its file; the other rank learns it and fails too
    owner = next(r for r, m in enumerate(nan) if "failed to write" not in m)
    assert "holds NaN or inf in 1 tensor(s) (model.layers.1.mlp.up_proj.weight)" in nan[owner]
    assert nan[1 - owner].endswith(f"rank {owner} failed to write its weights (CheckpointError: {nan[owner]}); "
                                   f"nothing was committed")
    assert not is_committed(storage.join(s3_url, "actor", "nan"))
    assert not [u for u in storage.list_files(s3_url) if ".tmp-" in u]  # the staging folder removed


def _same_folder(name: str, whole: str, by_rank: str, files: list) -> None:
    """``by_rank`` holds ``files`` and the index instead of ``whole``'s weights, the same other files, and
    ``from_pretrained`` reads the same tensors from both."""
    auto, *_ = role(name)
    weights = {f for f in os.listdir(whole) if f.endswith(".safetensors")}
    rest = set(os.listdir(whole)) - weights - {INDEX}
    assert set(os.listdir(by_rank)) == rest | set(files) | {INDEX}
    for f in rest - {"COMMITTED.json"}:
        assert (open(os.path.join(whole, f), "rb").read() == open(os.path.join(by_rank, f), "rb").read()), f
    from safetensors import safe_open

    with open(os.path.join(by_rank, INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    assert set(weight_map.values()) == set(files)
    for f in files:
        with safe_open(os.path.join(by_rank, f), framework="pt") as st:
            assert {k for k, v in weight_map.items() if v == f} == set(st.keys())
    # the tensors save_pretrained stores of the unsharded model: a tied head once, as the embedding (rank 0's
    # whole write, from a gathered state dict whose head is a copy, stores it twice)
    plain = os.path.join(os.path.dirname(by_rank), f"{name}-plain")
    auto.from_pretrained(whole, dtype=torch.float32).save_pretrained(plain)
    with safe_open(os.path.join(plain, "model.safetensors"), framework="pt") as st:
        assert set(weight_map) == set(st.keys())
    want = auto.from_pretrained(whole, dtype=torch.float32).state_dict()
    got = auto.from_pretrained(by_rank, dtype=torch.float32).state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_tensors_are_dealt_largest_first_to_the_lightest_rank():
    """Hand-worked: 10 → rank 0, 7 → 1, 5 → 1 (7 < 10), 4 → 0 (10 < 12), 1 → 1 (12 < 14); equal sizes go
    by name."""
    assert assign({"e": 1, "c": 5, "a": 10, "d": 4, "b": 7}, 2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}
    assert assign({"y": 3, "x": 3}, 2) == {"x": 0, "y": 1}
    assert assign({"a": 1}, 3) == {"a": 0}
    assert weight_file(0, 2) == "model-00001-of-00002.safetensors"


def test_one_process_commits_as_without_the_option(qwen2_chat_dir):
    """One process (no FSDP2 over ranks): not by rank; the critic server's critic refuses the option."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen2_chat_dir)
    assert not applies(model, model, DistInfo(0, 1, 0, torch.device("cpu")))
    with pytest.raises(ConfigError, match="critic.checkpoint_by_rank needs the critic inside the tasks"):
        CriticConfig(checkpoint_by_rank=True, remote_url="http://critic:8000")


def test_a_model_transformers_converts_on_save_is_not_written_by_rank():
    """Mixtral's experts are fused in memory and split by ``save_pretrained``: no rank holds the whole state
    to split, so its checkpoint is rank 0's whole write; Llama and Qwen2 store what they hold."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM

    shape = dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2)
    with torch.device("meta"):
        models = [LlamaForCausalLM(LlamaConfig(**shape)), Qwen2ForCausalLM(Qwen2Config(**shape)),
                  MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=2))]
    assert [converted(m) for m in models] == [False, False, True]
