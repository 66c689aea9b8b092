"""The colocated layout with a tensor-parallel engine group (``run.resident_layout=colocated``,
``rollout.tensor_parallel_size=2``): two gloo ranks hold one vLLM engine sharded two ways (vLLM's
``external_launcher`` inside the ranks' own process group, float32 on the CPU).

- The group samples what one unsharded engine samples: the same call dealt over the same two ranks each holding a
  tensor_parallel_size=1 engine (started in the same processes once the group's engine is closed) gives the same
  tokens, the log-probs within float32 noise of the sharded matmuls' sums.
- The in-process load from FSDP2 shards: each rank reads back only what its shard holds, bit for bit, holding fewer
  of the sampled elements of a sharded weight than were sampled, the two ranks together all of them; the probe then
  finds the engine within float32 noise of the trainer's forward.
- Failures are agreed by both ranks without a hang: a wrong element read back on rank 1 alone, and an element that no
  rank of the group holds (rank 1 as if it had not loaded its half of a weight).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from models.engines import SamplingSpec
from tests.processes import free_port
from tests.ranks import spawn
from tests.unit.models.actor_checkpoints import PROMPTS, actor_dir
from tests.unit.models.test_sharded_update import join_gloo

pytestmark = pytest.mark.integration

RANKS, TP = 2, 2
SPEC = SamplingSpec(n=2, temperature=1.0, max_new_tokens=6, seed=7)
CALL = PROMPTS * 2 + [[1, 30, 31, 32, 33, 34, 35, 36, 37]]
SHARDED = "model.layers.0.self_attn.q_proj.weight"
"""Split by rows over the group (vLLM's ``QKVParallelLinear``): each rank holds about half its sampled elements."""


def _stage(engine, rank: int, group, tp: int, calls) -> list:
    """``calls`` (prompts) dealt over the ranks' engines as a colocated stage does; rank 0's generations."""
    from models.engines.rank_engines import RankEngines, follow

    if rank:
        follow(engine, rank, RANKS, group, tp)
        return []
    engines = RankEngines(engine, RANKS, group, tp)
    try:
        return [[[g.tokens, g.logprobs] for g in per_prompt] for per_prompt in engines.generate(calls, SPEC)]
    finally:
        engines.end()


def _load(engine, trained, rank: int, group, version: int, read_back=None) -> dict:
    """The host's load and agreement (:func:`models.hosts.colocated.agreed`): what every rank learns."""
    from models.hosts.colocated import agreed, attempt, load_in_process
    from models.training.distributed import DistInfo
    from models.training.weight_source import WeightSource

    source = WeightSource(trained, DistInfo(rank, RANKS, rank, torch.device("cpu")))
    shard, out = {}, {}
    if read_back is not None:
        engine.read_back = read_back
    failed = attempt(lambda: out.update(load_in_process(engine, source, torch.float32, version, "cpu",
                                                        bucket_bytes=1 << 14, shard=shard)), rank)
    engine.__dict__.pop("read_back", None)
    agreed_on = agreed(failed, shard, group, RANKS, [[0, 1]])
    return {"failed": failed, "agreed": agreed_on, "shard": shard, "stats": out}


def _rank(rank: int, port: int, ckpts: dict, out_dir: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from vllm.distributed import parallel_state

    from models.engines.vllm_engine import VLLMEngine
    from models.hosts.colocated import check_group
    from models.training.distributed import wrap_for_training
    from models.training.policy import PolicyLogprobs
    from models.training.probe import reference_logprobs, verify_reference

    info = join_gloo(rank, RANKS, port)  # the trainer's process group first: vLLM's groups are made in it
    group = dist.new_group(backend="gloo")
    engine = VLLMEngine(ckpts["a"], max_model_len=64, tensor_parallel_size=TP, colocated=True)
    out = {"tp_ranks": parallel_state.get_tp_group().ranks, "workers": engine._workers()}
    check_group(engine, [0, 1])  # the host's check at its start: vLLM's group is the engine group
    try:
        check_group(engine, [rank])
    except RuntimeError as err:
        out["other_group"] = str(err)
    out["tp2"] = _stage(engine, rank, group, TP, CALL)
    lm = AutoModelForCausalLM.from_pretrained(ckpts["b"], dtype=torch.float32)
    vocab = lm.config.vocab_size
    trained = wrap_for_training(PolicyLogprobs(lm), info, "fsdp2")
    out["load"] = _load(engine, trained, rank, group, 1)
    sequences, logprobs = reference_logprobs(trained, vocab)  # the FSDP2 trainer's forward, as the host's probe
    out["probe_gap"] = verify_reference(engine, sequences, logprobs, 1e-4, "the trained actor").gap_max
    real = engine.read_back

    def flipped(positions, dtypes):  # rank 1 reads a replicated weight's element back other than it was sent
        held = real(positions, dtypes)
        held["model.norm.weight"][0] = [b ^ 1 for b in held["model.norm.weight"][0]]
        return held

    def dropped(positions, dtypes):  # rank 1 as if its half of a sharded weight were not loaded
        held = real(positions, dtypes)
        held[SHARDED] = [[] for _ in held[SHARDED]]
        return held

    out["flipped"] = _load(engine, trained, rank, group, 2, flipped if rank else None)
    out["dropped"] = _load(engine, trained, rank, group, 3, dropped if rank else None)
    engine.close()  # the group's engine gone, the trainer's process group kept: one engine per rank now
    engine = VLLMEngine(ckpts["a"], max_model_len=64, tensor_parallel_size=1, colocated=True)
    out["tp1"] = _stage(engine, rank, group, 1, CALL)
    engine.close()
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("tp_actors")
    ckpts = {"a": actor_dir(root / "a", seed=0), "b": actor_dir(root / "b", seed=1)}
    out = tmp_path_factory.mktemp("tp_ranks")
    spawn(_rank, (free_port(), ckpts, str(out)), nprocs=RANKS)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(RANKS)]


def test_the_ranks_form_one_engine_group_sharded_two_ways(ranks):
    assert [r["tp_ranks"] for r in ranks] == [[0, 1], [0, 1]]  # vLLM's tensor-parallel group: both ranks
    assert [r["workers"] for r in ranks] == [1, 1]  # each rank's executor holds its own worker only
    assert ranks[1]["other_group"] == "vLLM sharded this rank's engine over actor ranks [0, 1], not its engine group [1]"


def test_the_group_samples_what_an_unsharded_engine_samples(ranks):
    tp2, tp1 = ranks[0]["tp2"], ranks[0]["tp1"]
    assert len(tp2) == len(CALL) and all(len(per_prompt) == SPEC.n for per_prompt in tp2)
    assert [[g[0] for g in p] for p in tp2] == [[g[0] for g in p] for p in tp1]
    gaps = [abs(a - b) for p2, p1 in zip(tp2, tp1) for g2, g1 in zip(p2, p1) for a, b in zip(g2[1], g1[1])]
    assert max(gaps) < 1e-4  # float32: the sharded matmuls sum in another order


def test_each_rank_reads_back_its_shard_and_the_group_holds_every_element(ranks):
    for rank in ranks:
        load = rank["load"]
        assert load["failed"] == "" and load["agreed"] == "", load
        sent, holds = load["shard"]["sent"], load["shard"]["holds"]
        assert set(holds["model.norm.weight"]) == set(sent["model.norm.weight"])  # replicated: every element
        assert 0 < len(holds[SHARDED]) < len(sent[SHARDED])  # its rows only
        assert load["stats"]["resident/weights_loaded_bytes"] > 0
    union = set(ranks[0]["load"]["shard"]["holds"][SHARDED]) | set(ranks[1]["load"]["shard"]["holds"][SHARDED])
    assert union == set(ranks[0]["load"]["shard"]["sent"][SHARDED])
    assert all(r["probe_gap"] < 1e-4 for r in ranks)  # the trained weights served, float32 on both sides


def test_a_failure_on_one_rank_of_the_group_is_agreed_by_both(ranks):
    assert ranks[0]["flipped"]["failed"] == ""
    assert "rank 1: PushError" in ranks[1]["flipped"]["failed"] and "model.norm.weight" in ranks[1]["flipped"]["failed"]
    assert ranks[0]["flipped"]["agreed"] == ranks[1]["flipped"]["agreed"] == ranks[1]["flipped"]["failed"]
    assert [r["dropped"]["failed"] for r in ranks] == ["", ""]  # each rank's own check passes: what it holds is right
    for r in ranks:
        assert f"no rank of engine group 0 (actor ranks 0-1) holds {SHARDED!r} element" in r["dropped"]["agreed"]
