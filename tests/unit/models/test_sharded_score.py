"""The score stage's forwards on two ranks (gloo, CPU) under FSDP2 (``models/stages/score_ranks.py``), each
rank scoring its share of the rows, against the one-process :func:`models.stages.score.score_forward`.

Models: the tiny Llama policy of the sharded update tests, and the checkpoints of the rank-local loading
tests read by shard as the score task reads them (the tied Qwen2 chat model as π_old, the Llama-shaped one as
π_ref, the critic made from the Qwen2 one). Tolerance: 1e-5 absolute (float32 on CPU; each micro-batch is
the one one process forms, so only the thread count of the matmuls differs).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from models.config import LoraConfig
from models.config.io import load_config
from models.data.batch import RolloutBatch
from models.data.batch_schema import BatchMetadata
from models.stages.score import micro_batch_size, score_forward
from models.stages.score_ranks import deal, score_forward_ranks
from models.stages.updates import load_for_update
from models.training.distributed import is_sharded, wrap_for_training
from models.training.lora import CAUSAL_LM, TOKEN_CLS, load_pretrained
from models.training.policy import CriticValues, PolicyLogprobs, with_packing
from tests.processes import free_port
from tests.ranks import spawn
from tests.unit.models.test_sharded_load import committed  # noqa: F401  (the fixture)
from tests.unit.models.test_sharded_update import join_gloo, policy

CFG = load_config("", ["actor.micro_batch_size=2"])  # 4 rows a scoring forward
ROWS = 11
"""3 micro-batches of 4, 4 and 3 rows: rank 1 gets two, rank 0 one and a dummy forward."""


def batch() -> RolloutBatch:
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 16, rng.integers(1, 6)).tolist() for _ in range(ROWS)]
    responses = [rng.integers(1, 16, rng.integers(0, 7)).tolist() for _ in range(ROWS)]
    responses[3] = []  # an empty response among them
    meta = BatchMetadata(iteration=0, policy_version=0, algorithm="ppo", created_at="2026-11-26T00:00:00+00:00")
    return RolloutBatch.from_rollout(meta, prompt_id=list(range(ROWS)), prompt_tokens=prompts,
                                     response_tokens=responses, sampler_logprobs=[[-1.0] * len(r) for r in responses],
                                     is_end=[True] * ROWS, prompt=[""] * ROWS, response=[""] * ROWS)


def test_micro_batches_are_dealt_by_length_each_once_and_balanced():
    order = np.arange(23)[::-1]  # 6 micro-batches of 4 (the last 3) over 3 ranks
    dealt = deal(order, 4, 3)
    assert [len(d) for d in dealt] == [2, 2, 2]
    assert sorted(np.concatenate([c for d in dealt for c in d]).tolist()) == list(range(23))
    assert [c.tolist() for c in dealt[0]] == [[22, 21, 20, 19], [2, 1, 0]]  # rounds alternate direction
    assert [c.tolist() for c in dealt[2]] == [[14, 13, 12, 11], [10, 9, 8, 7]]
    assert [len(d) for d in deal(order, 4, 4)] == [1, 1, 2, 2]  # the second round from the last rank
    assert [len(d) for d in deal(order[:3], 4, 2)] == [1, 0]


def test_ddp_runs_each_ranks_model_on_its_own_gpu():
    """``actor.sharding=ddp`` on GPUs (the score's models and the updates): DDP is given the rank's local
    GPU, as it asks for a module on one GPU; a CPU module gets none, as before."""
    from models.training.distributed import DistInfo, ddp_device_ids

    assert ddp_device_ids(DistInfo(5, 8, 1, torch.device("cuda:1"))) == [1]
    assert ddp_device_ids(DistInfo(1, 2, 1, torch.device("cpu"))) is None


def test_score_on_ranks_asks_one_gpu_per_rank_and_the_70b_preset_sets_it():
    from models.config import ConfigError

    with pytest.raises(ConfigError, match=r"actor.score_on_ranks .* resources.score_gpu=1 must be 0 \(CPU\) or 2"):
        load_config("tiny_ppo", ["actor.score_on_ranks=true", "resources.score_gpu=1"])
    assert load_config("tiny_ppo", ["actor.score_on_ranks=true", "resources.score_gpu=2"]).actor.score_on_ranks
    assert not load_config("tiny_ppo").actor.score_on_ranks  # one process by default
    big = load_config("configs/llama70b_ppo_gpu.yaml")
    assert big.actor.score_on_ranks and big.resources.score_gpu == big.actor.nproc_per_node == 8


def models(case: str, paths: dict, info):
    """(actor, ref, critic) of ``case``: FSDP2-sharded over ``info``'s ranks, or whole (``info`` None)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if case == "tiny":
        made = [policy(2), policy(1)]
        return (*[m if info is None else wrap_for_training(m, info, "fsdp2") for m in made], None)
    spec = [("qwen2", AutoModelForCausalLM, CAUSAL_LM, PolicyLogprobs),
            ("llama", AutoModelForCausalLM, CAUSAL_LM, PolicyLogprobs),
            ("critic", AutoModelForTokenClassification, TOKEN_CLS, CriticValues)]
    if info is None:
        return tuple(with_packing(wrapper(load_pretrained(paths[name], auto, torch.float32)).eval(), True)
                     for name, auto, _, wrapper in spec)
    return tuple(load_for_update(paths[name], auto, "float32", LoraConfig(), task, wrapper, True, info, "fsdp2")
                 .eval() for name, auto, task, wrapper in spec)


def _worker(rank: int, world: int, port: int, paths: dict, out_dir: str) -> None:
    import torch.distributed as dist

    info = join_gloo(rank, world, port)
    try:
        for case in ("tiny", "qwen2"):
            actor, ref, critic = models(case, paths, info)
            got = score_forward_ranks(CFG, batch(), actor, ref, critic, 0, info)
            assert (got is None) == (rank != 0) and is_sharded(actor) and is_sharded(ref)
            if rank == 0:
                torch.save(got, os.path.join(out_dir, f"{case}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(committed, tmp_path_factory):  # noqa: F811  (the imported fixture)
    out = tmp_path_factory.mktemp("sharded-score")
    spawn(_worker, (2, free_port(), committed, str(out)))
    return {case: torch.load(out / f"{case}.pt", weights_only=False) for case in ("tiny", "qwen2")}


@pytest.mark.slow  # starts two ranks
@pytest.mark.parametrize("case", ["tiny", "qwen2"])
def test_two_ranks_score_what_one_process_scores(case, two_ranks, committed):  # noqa: F811
    """π_old (and its entropy), π_ref and the critic's values of every response token, gathered on rank 0 in
    the batch's response order, equal the one-process forward's."""
    assert micro_batch_size(CFG) == 4
    b = batch()
    want = score_forward(CFG, b, *models(case, committed, None), 0)
    got = two_ranks[case]
    keys = {"old_logprobs", "entropy", "ref_logprobs"} | ({"values"} if case == "qwen2" else set())
    assert set(got) == set(want) == keys
    for key in keys:
        assert got[key].shape == want[key].shape == (int(b.response_lengths().sum()),)
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-5, err_msg=key)
        assert np.ptp(want[key]) > 1e-3  # distinct per token: a misplaced row would show
