"""The colocated layout's parts (``run.resident_layout=colocated``): the deal of a call's prompts over the ranks
(hand-worked), the ranks' engines answering as one engine (two gloo ranks, each with its own HF engine, against one
engine given every prompt), a rank's failed share failing the call on rank 0 naming the rank, and the in-process load
from FSDP2 shards (every rank's engine then holds the unsharded model's weights bit for bit; a tensor the engine
did not take fails the load). Engine groups (``rollout.tensor_parallel_size`` > 1): the ranks' layout, a call dealt
over the groups with every rank of a group running its share (two HF engines standing in for the ranks of one
tensor-parallel engine: they sample alike), a group whose ranks answer differently failing the call, and a push's
sampled elements checked per shard and then over each group. vLLM sharded over two ranks is in
``tests/integration/test_colocated_tp.py``. The config's refusals are in ``tests/unit/tasks/test_config.py``."""

from __future__ import annotations

import json
import os

import pytest
import torch

from models.engines import HFEngine, SamplingSpec
from models.engines.rank_engines import Digest, RankError, deal_by_length, digest, engine_groups, group_answers
from models.engines.weight_stream import PushError, bits, check_read_back
from models.hosts.colocated import load_in_process, uncovered
from models.training.distributed import DistInfo
from models.training.weight_source import WeightSource
from tests.processes import free_port
from tests.ranks import spawn
from tests.unit.models.actor_checkpoints import PROMPTS, actor_dir

RANKS = 2
SPEC = SamplingSpec(n=2, temperature=1.0, max_new_tokens=6, seed=7)
CALL = PROMPTS * 2 + [[1, 30, 31, 32, 33, 34, 35, 36, 37]]
"""Nine prompts of 2 to 9 tokens: the deal gives the ranks other prompts than contiguous halves would."""
BAD = [[1, 40, 41, 42], [1, 10_000]]
"""Costs 10 and 8 (tokens + max_new_tokens): the first goes to rank 0, the second (a token outside the vocabulary)
to rank 1."""


def test_the_deal_takes_the_longest_first_to_the_least_loaded_rank():
    # costs 5,1,4,2,3 over two ranks: 5 -> r0; 4 -> r1; 3 -> r1 (4 < 5); 2 -> r0 (5 < 7); 1 -> r0 (7 = 7: lowest rank)
    assert deal_by_length([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]
    assert deal_by_length([3, 3, 3, 3], 3) == [[0, 3], [1], [2]]
    assert deal_by_length([], 2) == [[], []]
    with pytest.raises(ValueError, match="need >= 1 rank"):
        deal_by_length([1], 0)


def _rank(rank: int, port: int, ckpts: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from models.engines.rank_engines import RankEngines, follow

    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")
    engine = HFEngine(ckpts["a"], dtype="float32")
    other = HFEngine(ckpts["b"], dtype="float32") if rank else engine  # rank 1 sampling otherwise than its lead
    out = {}
    for key, prompts, tp, mine in (("generations", CALL, 1, engine), ("error", BAD, 1, engine),
                                   ("group", CALL, 2, engine), ("split", CALL, 2, other)):
        if rank:
            follow(mine, rank, RANKS, group, tp)
            continue
        engines = RankEngines(mine, RANKS, group, tp)
        try:
            gens = engines.generate(prompts, SPEC)
            out[key] = [[[g.tokens, g.logprobs] for g in per_prompt] for per_prompt in gens]
        except RuntimeError as err:
            out[key] = str(err)
        finally:
            engines.end()
    trained = AutoModelForCausalLM.from_pretrained(ckpts["b"], dtype=torch.float32)
    for layer in trained.model.layers:
        fully_shard(layer)
    fully_shard(trained)
    info = DistInfo(rank, RANKS, rank, torch.device("cpu"))
    source = WeightSource(trained, info, prefix="")
    sharded = source.sharded()
    out["load"] = load_in_process(engine, source, torch.float32, 1, "cpu", bucket_bytes=1 << 14)
    whole = AutoModelForCausalLM.from_pretrained(ckpts["b"], dtype=torch.float32).state_dict()
    held = engine.model.state_dict()
    out.update(sharded=sharded, same_bits=all(torch.equal(bits(held[k]), bits(whole[k])) for k in whole))
    out.update(_gathers_at_bfloat16(source, whole))
    out["probe"] = _agreed_probe(rank, ckpts, group)
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _gathers_at_bfloat16(source: WeightSource, whole: dict) -> dict:
    """Every tensor gathered whole at bfloat16 (the colocated load's gather), each DTensor gathered recorded: its
    dtype and the bytes of this rank's shard it sends."""
    from torch.distributed.tensor import DTensor

    moved, real = [], DTensor.full_tensor

    def recording(self, *args, **kwargs):
        moved.append([str(self.dtype).removeprefix("torch."), self.to_local().numel() * self.to_local().element_size(),
                      self.to_local().numel()])
        return real(self, *args, **kwargs)

    DTensor.full_tensor = recording
    try:
        got = dict(source.gathered(torch.device("cpu"), torch.bfloat16, everywhere=True))
    finally:
        DTensor.full_tensor = real
    exact = all(torch.equal(bits(got[k]), bits(whole[k].to(torch.bfloat16))) for k in got)
    return {"gathers": moved, "gathered_exact": exact}


def _agreed_probe(rank: int, ckpts: dict, group) -> dict:
    """The start-up probe of :class:`ColocatedActorHost` on this rank: the trainer holds actor ``b`` (FSDP2-sharded
    as the actor trains), rank 0's engine serves ``b`` and rank 1's ``a`` (a miss on rank 1 only); a restart serves
    ``b``."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from models.hosts.colocated import ColocatedActorHost
    from models.training.distributed import wrap_for_training
    from models.training.policy import PolicyLogprobs

    host = object.__new__(ColocatedActorHost)
    host.info, host.group, host.groups = DistInfo(rank, RANKS, rank, torch.device("cpu")), group, [[0], [1]]
    lm = AutoModelForCausalLM.from_pretrained(ckpts["b"], dtype=torch.float32)
    host.cfg, host.vocab = SimpleNamespace(probe_tolerance=1e-4), 40
    host.model = wrap_for_training(PolicyLogprobs(lm), host.info, "fsdp2")
    host.engine = HFEngine(ckpts["a" if rank else "b"], dtype="float32")
    restarts = []

    def restart() -> None:
        restarts.append(rank)
        host.engine.restart(ckpts["b"])

    host.probe_at_start(restart, "actor b")
    return {"restarts": len(restarts), "gap": host.engine.stats.extra["probe_gap_max"]}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("actors")
    return {"a": actor_dir(root / "a", seed=0), "b": actor_dir(root / "b", seed=1)}


@pytest.fixture(scope="module")
def ranks(ckpts, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    spawn(_rank, (free_port(), ckpts, str(out)), nprocs=RANKS)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(RANKS)]


@pytest.mark.slow
def test_the_ranks_engines_sample_what_one_engine_samples(ckpts, ranks):
    one = HFEngine(ckpts["a"], dtype="float32").generate(CALL, SPEC)
    got = ranks[0]["generations"]
    assert [[g[0] for g in per_prompt] for per_prompt in got] == [[g.tokens for g in p] for p in one]
    gaps = [abs(a - b) for per_prompt, ref in zip(got, one) for g, r in zip(per_prompt, ref)
            for a, b in zip(g[1], r.logprobs)]
    assert max(gaps) < 1e-5  # the same samples; log-probs within float32 noise of another batch's padding


@pytest.mark.slow
def test_one_engine_group_of_both_ranks_samples_what_one_engine_samples(ranks):
    group, two = ranks[0]["group"], ranks[0]["generations"]  # dealt over 1 group and over 2: the same seeds
    assert [[g[0] for g in p] for p in group] == [[g[0] for g in p] for p in two]
    gaps = [abs(a - b) for p, q in zip(group, two) for g, h in zip(p, q) for a, b in zip(g[1], h[1])]
    assert max(gaps) < 1e-5  # another batch's padding


@pytest.mark.slow
def test_a_group_whose_ranks_sample_differently_fails_the_call(ranks):
    assert ranks[0]["split"].startswith("the ranks of engine group 0 (actor ranks 0-1) answered a generate call "
                                        "differently: rank 1 against its lead 0")


def test_engine_groups_are_consecutive_ranks_and_tp_must_divide_the_world():
    assert engine_groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert engine_groups(4, 1) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=3 must divide the actor's 4 ranks"):
        engine_groups(4, 3)


def test_group_answers_take_each_leads_answers_once_its_ranks_agree():
    a, b = [[1, 2]], [[3]]
    assert group_answers([a, Digest(digest(a)), b, Digest(digest(b))], 2, "generate") == [a, b]
    assert group_answers([a, b], 1, "generate") == [a, b]
    with pytest.raises(RuntimeError, match="engine group 1 \\(actor ranks 2-3\\) answered a generate call "
                                           "differently: rank 3 against its lead 2"):
        group_answers([a, Digest(digest(a)), b, Digest(digest(a))], 2, "generate")
    with pytest.raises(RuntimeError, match="the engine of actor rank 1 failed its share of a generate call: boom"):
        group_answers([a, RankError("boom")], 2, "generate")


def test_a_shard_is_checked_on_what_it_holds_and_a_group_on_their_union():
    header = {"tensors": [["w", "float32", [4], 0, 0, 2]]}
    sent = {"w": [(0, 7), (3, 9)]}  # (flat position, bits sent)
    assert check_read_back(header, sent, {"w": [[7], []]}, "t", shard=True) == {"w": [0]}  # element 3: not here
    with pytest.raises(PushError, match="element 3 is in none of its weights"):
        check_read_back(header, sent, {"w": [[7], []]}, "t")  # one engine: every element must be held
    with pytest.raises(PushError, match="element 3 holds bits 0x8 where the trainer sent 0x9"):
        check_read_back(header, sent, {"w": [[], [8]]}, "t", shard=True)  # what it holds must be what was sent
    first, second = {"sent": {"w": [0, 3]}, "holds": {"w": [0]}}, {"sent": {"w": [0, 3]}, "holds": {"w": [3]}}
    assert uncovered([first, second], [[0, 1]]) is None
    assert uncovered([first, first, first, second], [[0, 1], [2, 3]]) == (
        "no rank of engine group 0 (actor ranks 0-1) holds 'w' element 3: the group's engine did not load it")


@pytest.mark.slow
def test_a_ranks_failed_share_fails_the_call_naming_the_rank(ranks):
    assert "the engine of actor rank 1 failed its share of a generate call" in ranks[0]["error"]


@pytest.mark.slow
def test_every_rank_loads_the_unsharded_weights_from_fsdp2_shards_bit_for_bit(ckpts, ranks):
    params = sum(p.numel() for p in HFEngine(ckpts["b"]).model.parameters())
    for rank in ranks:
        assert rank["sharded"] and rank["same_bits"]
        assert rank["load"]["resident/weights_loaded_bytes"] == 4 * params


@pytest.mark.slow
def test_the_colocated_gather_moves_each_shard_cast_to_the_engines_dtype(ckpts, ranks):
    """Each DTensor is gathered at bfloat16, 2 bytes an element of the rank's shard (never float32 whole first), and
    what arrives is the float32 weights cast to bfloat16 bit for bit."""
    params = sum(p.numel() for p in HFEngine(ckpts["b"]).model.parameters())
    for rank in ranks:
        assert rank["gathers"] and {dtype for dtype, _, _ in rank["gathers"]} == {"bfloat16"}
        assert all(nbytes == 2 * numel for _, nbytes, numel in rank["gathers"])
        assert sum(numel for _, _, numel in rank["gathers"]) < params  # its shard only
        assert rank["gathered_exact"]
    assert sum(numel for r in ranks for _, _, numel in r["gathers"]) == params


@pytest.mark.slow
def test_one_ranks_probe_miss_restarts_every_ranks_engine(ranks):
    """Rank 0's engine serves the trainer's weights, rank 1's does not: both restart (a restart runs collectives
    over every rank under vLLM's external_launcher), and both then pass."""
    assert [r["probe"]["restarts"] for r in ranks] == [1, 1]
    assert all(r["probe"]["gap"] < 1e-4 for r in ranks)


def test_a_tensor_the_engine_did_not_take_fails_the_load(ckpts, monkeypatch):
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(ckpts["b"], dtype=torch.float32)
    engine = HFEngine(ckpts["a"], dtype="float32")
    source = WeightSource(trained, DistInfo(0, 1, 0, torch.device("cpu")), prefix="")
    read_back = engine.read_back
    monkeypatch.setattr(engine, "read_back", lambda positions, dtypes: {  # as if one weight kept its old bits
        k: [[v[0] ^ 1] for v in values] if k == "model.norm.weight" else values
        for k, values in read_back(positions, dtypes).items()})
    with pytest.raises(PushError, match="model.norm.weight"):
        load_in_process(engine, source, torch.float32, 1, "cpu")


def test_a_tied_hub_checkpoint_loads_in_process_at_the_engine_dtype(qwen2_chat_dir, tmp_path):
    """The in-process load on what users bring (tied embeddings, byte-level BPE, a chat template, two eos ids):
    the engine ends up holding the trained weights cast to bfloat16 bit for bit, ``lm_head`` still the embedding
    (one tensor sent for both), and the bytes counted at 2 a parameter."""
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(qwen2_chat_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 1e-2)
    engine = HFEngine(qwen2_chat_dir, dtype="bfloat16")
    source = WeightSource(trained, DistInfo(0, 1, 0, torch.device("cpu")), prefix="")
    out = load_in_process(engine, source, torch.bfloat16, 1, "cpu", bucket_bytes=1 << 16)
    held, want = engine.model.state_dict(), trained.state_dict()
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    assert all(torch.equal(bits(held[k]), bits(want[k].to(torch.bfloat16))) for k in want)
    params = sum(p.numel() for p in trained.parameters())  # the tied weight once
    assert out["resident/weights_loaded_bytes"] == 2 * params
