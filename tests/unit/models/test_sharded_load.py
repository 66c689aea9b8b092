"""Rank-local loading (models/training/sharded_load.py): two ranks (gloo, CPU), each reading only its
rows of a realistic checkpoint, hold exactly the weights one process's ``from_pretrained`` reads, and an
update step on them gives the losses of today's path (every rank loading the whole checkpoint, then
FSDP2 sharding it).

Checkpoints: the Qwen2-shaped chat model (tied embeddings, q/k/v biases), the Llama-shaped one (untied
head) and a critic made from the Qwen2 one (its ``score`` head has one row: on two ranks the second
holds none of it).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from kernels.losses import PolicyLossConfig
from models.config import LoraConfig
from models.stages.updates import load_for_update, load_trainable, reads_shards
from models.training.distributed import DistInfo, full_state_dict, is_sharded, unwrap, wrap_for_training
from models.training.lora import CAUSAL_LM, TOKEN_CLS, load_pretrained
from models.training.policy import CriticValues, PolicyLogprobs, with_packing
from models.training.probe import reference_logprobs
from models.training.sharded_load import fill_from_checkpoint, materialise, tensor_files
from models.training.update import actor_loss_fn, critic_loss_fn, make_optimizer, run_update
from tests.processes import free_port
from tests.ranks import spawn
from tests.unit.models.test_sharded_update import LENGTHS, SETTINGS, join_gloo
from tests.unit.models.update_rows import padded_rows

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
TWO = DistInfo(0, 2, 0, torch.device("cpu"))
LORA = LoraConfig(rank=4)


def role(name: str):
    """(auto class, peft task type, wrapper, loss) of the ``actor`` or the ``critic``."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if name == "actor":
        return AutoModelForCausalLM, CAUSAL_LM, PolicyLogprobs, actor_loss_fn(PolicyLossConfig(), 1.0)
    return AutoModelForTokenClassification, TOKEN_CLS, CriticValues, critic_loss_fn(0.2)


@pytest.fixture(scope="module")
def committed(qwen2_chat_dir, llama_bpe_dir, tmp_path_factory):
    """The checkpoints committed as the run commits them (``COMMITTED.json``), by name: the two hub
    checkpoints and a critic made from the Qwen2 one."""
    from models.checkpoint import save_checkpoint
    from models.training.critic_init import critic_from_actor

    root = tmp_path_factory.mktemp("committed")
    critic = critic_from_actor(qwen2_chat_dir, root / "critic-src", seed=3)
    out = {}
    for name, src in (("qwen2", qwen2_chat_dir), ("llama", llama_bpe_dir), ("critic", critic)):
        save_checkpoint(str(src), str(root / name))
        out[name] = str(root / name)
    out["adapter"] = _trained_adapter(out["qwen2"], str(root / "adapter"))
    out["bf16"] = _in_bfloat16(out["qwen2"], root / "bf16-src", str(root / "bf16"))
    return out


def _in_bfloat16(ckpt: str, folder, url: str) -> str:
    """``ckpt`` with its weights stored in bfloat16, as hub checkpoints ship, committed at ``url``."""
    import shutil

    from safetensors.torch import load_file, save_file

    from models.checkpoint import save_checkpoint

    shutil.copytree(ckpt, folder, ignore=shutil.ignore_patterns("COMMITTED.json", "*.safetensors"))
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    save_file({k: v.bfloat16() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    save_checkpoint(str(folder), url)
    return url


def _trained_adapter(base: str, url: str) -> str:
    """A LoRA adapter on ``base`` committed at ``url`` as an update commits one, its ``B`` random (as
    trained: the adapter changes the outputs)."""
    from transformers import AutoModelForCausalLM

    from models.training.lora import add_adapter, save_adapter_checkpoint

    torch.manual_seed(4)
    model = add_adapter(load_pretrained(base, AutoModelForCausalLM, torch.float32), LORA, CAUSAL_LM)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    save_adapter_checkpoint(model, None, url, base)
    return url


def _update(model, info: DistInfo, loss_fn) -> dict:
    data = padded_rows(LENGTHS, vocab=200)
    data = type(data)(*(None if t is None else t[info.rank::info.world_size] for t in data))
    return run_update(model, make_optimizer(model, 1e-3), data, loss_fn, SETTINGS, info)


def _load_and_train(name: str, ckpt: str, info: DistInfo) -> dict:
    """On every rank: the sharded load and today's (whole) load of ``ckpt``, an update step on each."""
    auto, task, wrapper, loss_fn = role(name)
    assert reads_shards(ckpt, LoraConfig(), info, "fsdp2")
    sharded = load_for_update(ckpt, auto, "float32", LoraConfig(), task, wrapper, True, info, "fsdp2")
    inner = unwrap(sharded).lm if name == "actor" else unwrap(sharded).critic
    loaded = full_state_dict(sharded)
    buffers = {k: b.clone() for k, b in inner.named_buffers()}
    tied = name == "actor" and inner.lm_head.weight is inner.get_input_embeddings().weight
    today = wrap_for_training(with_packing(wrapper(load_trainable(ckpt, auto, "float32", LoraConfig(), task)), True),
                              info, "fsdp2")
    stats = [_update(m, info, loss_fn) for m in (sharded, today)]
    return {"loaded": loaded, "buffers": buffers, "tied": tied, "stats": stats,
            "trained": [full_state_dict(m) for m in (sharded, today)], "sharded": is_sharded(sharded),
            "packed": [sharded.packed, today.packed]}


@contextlib.contextmanager
def whole_loads():
    """The classes transformers' ``from_pretrained`` loads (the whole checkpoint) while the block runs."""
    from transformers import PreTrainedModel

    real = PreTrainedModel.__dict__["from_pretrained"]
    names = []

    def counted(cls, *args, **kwargs):
        names.append(cls.__name__)
        return real.__func__(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(counted)
    try:
        yield names
    finally:
        PreTrainedModel.from_pretrained = real


def _lora_load_and_train(name: str, ckpt: str, info: DistInfo, commit_url: str) -> dict:
    """On every rank: the LoRA model of ``ckpt`` (a fresh adapter on full weights, or an adapter folder)
    loaded by shard and whole (then FSDP2-sharded), each seeded alike; their forwards, an update step on
    each, the rows of every frozen base weight each rank holds, and the sharded one committed at
    ``commit_url`` as the update commits it."""
    import torch.distributed as dist

    from models.stages.updates import save_trained

    auto, task, wrapper, loss_fn = role(name)
    assert reads_shards(ckpt, LORA, info, "fsdp2")
    torch.manual_seed(11)
    with whole_loads() as sharded_whole:
        sharded = load_for_update(ckpt, auto, "float32", LORA, task, wrapper, True, info, "fsdp2")
    torch.manual_seed(11)
    with whole_loads() as whole_whole:
        whole = wrap_for_training(with_packing(wrapper(load_trainable(ckpt, auto, "float32", LORA, task)), True),
                                  info, "fsdp2")
    rows = {n: (p.shape[0], p.to_local().shape[0]) for n, p in sharded.named_parameters() if not p.requires_grad}
    every = [None] * info.world_size
    dist.all_gather_object(every, rows)
    data = padded_rows(LENGTHS, vocab=200)
    with torch.no_grad():
        forwards = [m(data) for m in (sharded, whole)]
    loaded = [full_state_dict(m) for m in (sharded, whole)]
    stats = [_update(m, info, loss_fn) for m in (sharded, whole)]
    trained = [full_state_dict(m) for m in (sharded, whole)]
    inner = "lm" if name == "actor" else "critic"
    if info.is_main:
        save_trained(getattr(unwrap(sharded), inner), None, commit_url, ckpt, trained[0], prefix=f"{inner}.")
    dist.barrier()
    return {"whole_loads": [sharded_whole, whole_whole], "rows": every, "loaded": loaded, "stats": stats,
            "forwards": [f[0] if isinstance(f, tuple) else f for f in forwards], "trained": trained,
            "sharded": is_sharded(sharded), "inner": inner}


def _frozen(ckpt: str, info: DistInfo) -> dict:
    """On every rank: π_ref of the bfloat16 ``ckpt`` loaded by shard as the score loads it (``frozen``: held in
    bfloat16) and as a trained model is (float32); their forwards and the bytes and dtypes each rank holds."""
    auto, task, wrapper, _ = role("actor")
    models = [load_for_update(ckpt, auto, "float32", LoraConfig(), task, wrapper, True, info, "fsdp2", frozen=f).eval()
              for f in (True, False)]
    held = [_held(m) for m in models]
    with torch.no_grad():
        forwards = [m(padded_rows(LENGTHS, vocab=200)) for m in models]
    after = [_held(m) for m in models]
    reference_logprobs(models[1], 200)  # the probe's forward of a trained model (the push's): resharded after
    return {"forwards": [f[0] if isinstance(f, tuple) else f for f in forwards], "held": held,
            "after": after, "probed": _held(models[1]),
            "dtypes": [sorted({str(p.dtype) for p in m.parameters()}) for m in models]}


def _held(model) -> int:
    """The bytes of ``model``'s weights this rank holds (gathered or its shards)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())


def _worker(rank: int, world: int, port: int, cases: dict, out_dir: str) -> None:
    import torch.distributed as dist

    info = join_gloo(rank, world, port)
    try:
        for case, (name, ckpt) in cases.items():
            if case == "frozen":
                out = _frozen(ckpt, info)
            elif case in LORA_CASES:
                out = _lora_load_and_train(name, ckpt, info, os.path.join(out_dir, f"{case}-commit"))
            else:
                out = _load_and_train(name, ckpt, info)
            if rank == 0:
                torch.save(out, os.path.join(out_dir, f"{case}.pt"))
    finally:
        dist.destroy_process_group()


CASES = {"qwen2": "actor", "llama": "actor", "critic": "critic"}
LORA_CASES = {"lora_fresh": ("actor", "qwen2"), "lora_adapter": ("actor", "adapter"),
              "lora_critic": ("critic", "critic")}
"""A LoRA actor's first iteration (a fresh adapter on full weights) and a later one (an adapter folder),
and a LoRA critic's first (peft trains a copy of its ``score`` head)."""


@pytest.fixture(scope="module")
def two_ranks(committed, tmp_path_factory):
    """Rank 0's results for every case of :data:`CASES` and :data:`LORA_CASES`, from one pair of
    processes, and the folder of the LoRA cases' commits."""
    out = tmp_path_factory.mktemp("sharded-load")
    cases = {case: (name, committed[case]) for case, name in CASES.items()}
    cases.update({case: (name, committed[ckpt]) for case, (name, ckpt) in LORA_CASES.items()})
    cases["frozen"] = ("actor", committed["bf16"])
    spawn(_worker, (2, free_port(), cases, str(out)))
    return {case: torch.load(out / f"{case}.pt") for case in cases} | {"out": out}


@pytest.mark.slow  # starts two ranks
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_read_their_shards_as_one_process_reads_the_whole(case, two_ranks, committed):
    """Gathered from the two ranks' shards, every weight is bit-identical to ``from_pretrained``'s in one
    process, the buffers (rotary ``inv_freq``) too, a tied head stays tied; an update step (two epochs of
    four micro-batches) on the sharded load gives today's path's losses and weights. Tolerance: rel 1e-6
    (the two compute the same sums in the same order; on this machine they agree exactly)."""
    name, got = CASES[case], two_ranks[case]
    auto, *_ = role(name)
    want = load_pretrained(committed[case], auto, torch.float32)
    assert got["sharded"]
    prefix = "lm." if name == "actor" else "critic."
    loaded = {k[len(prefix):]: v for k, v in got["loaded"].items()}
    assert set(loaded) == set(want.state_dict())
    for key, value in want.state_dict().items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert set(got["buffers"]) == {k for k, _ in want.named_buffers()}
    for key, value in want.named_buffers():
        assert torch.equal(got["buffers"][key], value), key
    assert got["tied"] == bool(name == "actor" and want.config.tie_word_embeddings)
    assert got["packed"][0] == got["packed"][1]
    mine, today = got["stats"]
    assert mine["steps"] == today["steps"] > 0
    for key in ("loss", "grad_norm"):
        assert mine[key] == pytest.approx(today[key], rel=1e-6), key
    moved = 0.0
    for key, value in got["trained"][1].items():
        torch.testing.assert_close(got["trained"][0][key], value, rtol=1e-6, atol=0, msg=key)
        moved = max(moved, float((value - got["loaded"][key]).abs().max()))
    assert moved > 1e-4  # the step changed the weights it compares


@pytest.mark.slow  # starts two ranks
@pytest.mark.parametrize("case", list(LORA_CASES))
def test_two_ranks_read_their_shards_of_a_lora_base_as_the_whole_load(case, two_ranks, committed):
    """A LoRA model loaded by shard holds on each rank only its half of every frozen base weight's rows
    (``ceil(rows / 2)`` on rank 0, the rest on rank 1), the adapter as the whole load makes it; gathered,
    its weights equal the whole load's bit for bit, and so do its log-probs (values for the critic)
    before training. An update step gives the whole load's losses and weights, and the commit is an
    adapter folder that peft loads on its base to the trained weights. Tolerance: rel 1e-6 (the same
    sums in the same order; on this machine they agree exactly)."""
    from models.training.lora import is_adapter

    name, _ = LORA_CASES[case]
    got = two_ranks[case]
    assert got["sharded"]
    assert got["whole_loads"][0] == [] and len(got["whole_loads"][1]) == 1  # no rank read the whole base
    frozen = [k for k in got["rows"][0] if "lora_" not in k]
    assert frozen and all(".base_layer." in k for k in frozen if "self_attn.q_proj" in k)
    for key in frozen:
        rows, mine = got["rows"][0][key]
        assert mine == -(-rows // 2) and got["rows"][1][key] == (rows, rows - mine), key
    assert not any("lora_" in k for k in got["rows"][0])  # the adapter trains
    mine_loaded, whole_loaded = got["loaded"]
    assert set(mine_loaded) == set(whole_loaded) and any("lora_A" in k for k in mine_loaded)
    for key, value in whole_loaded.items():
        assert mine_loaded[key].dtype == value.dtype and torch.equal(mine_loaded[key], value), key
    torch.testing.assert_close(got["forwards"][0], got["forwards"][1], rtol=0, atol=0)
    (mine, today), moved = got["stats"], 0.0
    assert mine["steps"] == today["steps"] > 0
    for key in ("loss", "grad_norm"):
        assert mine[key] == pytest.approx(today[key], rel=1e-6), key
    for key, value in got["trained"][1].items():
        torch.testing.assert_close(got["trained"][0][key], value, rtol=1e-6, atol=0, msg=key)
        moved = max(moved, float((value - mine_loaded[key]).abs().max()))
    assert moved > 1e-4
    commit = str(two_ranks["out"] / f"{case}-commit")
    assert is_adapter(commit)
    auto, *_ = role(name)
    peft_loaded = load_pretrained(commit, auto, torch.float32).state_dict()
    prefix = f"{got['inner']}."
    for key, value in got["trained"][0].items():
        assert torch.equal(peft_loaded[key[len(prefix):]], value), key


@pytest.mark.slow  # starts two ranks
def test_a_frozen_model_is_held_at_its_checkpoints_dtype_and_scores_as_in_float32(two_ranks):
    """π_ref of a bfloat16 checkpoint, held by shard in bfloat16 (gathered and cast to float32 unit by unit), gives
    the log-probs of the float32 load bit for bit, in half its bytes on each rank, and after a forward holds no
    more than before it; so does a trained model after the probe's forward."""
    got = two_ranks["frozen"]
    assert got["dtypes"] == [["torch.bfloat16"], ["torch.float32"]]
    assert got["held"][0] * 2 == got["held"][1]
    assert got["after"][0] == got["held"][0]  # the root resharded after the forward: no embedding held whole
    assert got["after"][1] > got["held"][1]  # (a trained model's root stays gathered for its backward)
    assert got["probed"] == got["held"][1]
    assert got["forwards"][0].dtype == torch.float32 and torch.equal(got["forwards"][0], got["forwards"][1])


def _empty_like_checkpoint(ckpt: str, auto):
    """The model of ``ckpt`` built on the meta device, then given empty storage and its buffers."""
    from transformers import AutoConfig

    with torch.device("meta"):
        model = auto.from_config(AutoConfig.from_pretrained(ckpt), dtype=torch.float32)
    materialise(model, model, torch.device("cpu"))
    return model


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_filling_an_empty_model_reads_what_from_pretrained_reads(stored, qwen2_chat_dir, tmp_path):
    """In one process (no sharding): the weights read row range by row range (cast to float32 from a
    bfloat16 file, as hub checkpoints ship) and the buffers computed by the model's init equal
    ``from_pretrained``'s exactly; the tied head stays the embedding."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    ckpt = str(qwen2_chat_dir)
    if stored == "bfloat16":
        tensors = load_file(os.path.join(ckpt, "model.safetensors"))
        save_file({k: v.bfloat16() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
        shutil.copy(os.path.join(ckpt, "config.json"), tmp_path)
        ckpt = str(tmp_path)
    model = _empty_like_checkpoint(ckpt, AutoModelForCausalLM)
    fill_from_checkpoint(model, ckpt, tensor_files(ckpt), CPU)
    want = load_pretrained(ckpt, AutoModelForCausalLM, torch.float32)
    got = {**model.state_dict(), **dict(model.named_buffers())}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for key, value in [*want.state_dict().items(), *want.named_buffers()]:
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_a_checkpoint_without_a_weight_or_of_another_shape_is_refused(qwen2_chat_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    ckpt = str(qwen2_chat_dir)
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    model = _empty_like_checkpoint(ckpt, AutoModelForCausalLM)
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"has no tensor {name}"):
        fill_from_checkpoint(model, str(tmp_path), tensor_files(str(tmp_path)), CPU)
    save_file({**tensors, name: tensors[name][:-1]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name} has shape \(191, 64\) in the checkpoint, \(192, 64\)"):
        fill_from_checkpoint(model, str(tmp_path), tensor_files(str(tmp_path)), CPU)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    whole = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(whole[:-100])
    with pytest.raises(ValueError, match="ends inside a tensor"):
        fill_from_checkpoint(model, str(tmp_path), tensor_files(str(tmp_path)), CPU)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no .safetensors file"):
        tensor_files(str(tmp_path))


def test_only_full_weights_sharded_over_ranks_are_read_by_shard(qwen2_chat_dir, tmp_path):
    """One process and DDP keep the whole load; FSDP2 over ranks reads by shard, a LoRA model's base too."""
    from models.checkpoint import save_checkpoint

    ckpt = str(tmp_path / "qwen2")
    save_checkpoint(str(qwen2_chat_dir), ckpt)
    assert reads_shards(ckpt, LoraConfig(), TWO, "fsdp2")
    assert not reads_shards(ckpt, LoraConfig(), CPU, "fsdp2")
    assert not reads_shards(ckpt, LoraConfig(), TWO, "ddp")
    assert not reads_shards(ckpt, LoraConfig(), TWO, "auto")  # auto on CPU is DDP
    assert reads_shards(ckpt, LORA, TWO, "fsdp2")  # the LoRA base by shard
    assert not reads_shards(ckpt, LORA, TWO, "ddp")
