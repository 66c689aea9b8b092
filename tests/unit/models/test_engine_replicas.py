"""Data-parallel engine replicas (``rollout.data_parallel_size``): the batch of two replicas is the batch
of one engine (same tokens, log-probs within float noise), new weights reach every replica in place, a
failure names its replica; each replica pinned to its own cores.

The reference is one engine in this process on the same checkpoint and request: each sample has its own
seed (:func:`models.engines.base.sample_seed` of its index in the whole request), so how prompts are dealt
must not change a sample. The replicas are engine-agnostic processes; vLLM's side of the deal (a share's seeds
from its first index) is checked on the vLLM engine tests/integration/test_engine_reload.py already starts."""

import pytest
import torch
from safetensors.torch import load_file

from models.engines import EngineLoadError, EngineReplicas, HFEngine, SamplingSpec, make_engine
from models.engines.base import contiguous_shares
from models.engines.replicas import replica_cpus, replica_gpus
from tests.unit.models.actor_checkpoints import PROMPTS, actor_dir, with_truncated_weights

PROMPTS5 = PROMPTS + [[1, 30, 31, 32]]  # five: shares of 3 and 2, so the second replica's seeds start at 3
SAMPLED = SamplingSpec(n=2, temperature=1.0, max_new_tokens=6, seed=7)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("actors")
    return {"a": actor_dir(root / "a", seed=0), "b": actor_dir(root / "b", seed=1)}


@pytest.fixture(scope="module")
def hf_pair(ckpts):
    engine = make_engine("hf", ckpts["a"], data_parallel_size=2)
    assert isinstance(engine, EngineReplicas) and engine.replicas == 2
    yield engine
    engine.close()


def _batch(engine, prompts=PROMPTS5, spec=SAMPLED):
    gens = [g for per_prompt in engine.generate(prompts, spec) for g in per_prompt]
    return [g.tokens for g in gens], torch.tensor([lp for g in gens for lp in g.logprobs]), [g.is_end for g in gens]


def _assert_same_batch(engine, reference, atol=1e-5, prompts=PROMPTS5):
    tokens, logp, ends = _batch(engine, prompts)
    ref_tokens, ref_logp, ref_ends = _batch(reference, prompts)
    assert (tokens, ends) == (ref_tokens, ref_ends)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=atol)


def test_two_hf_replicas_sample_the_batch_of_one_engine(hf_pair, ckpts):
    one = HFEngine(ckpts["a"])
    _assert_same_batch(hf_pair, one)
    ours, ref = hf_pair.prompt_logprobs(PROMPTS5), one.prompt_logprobs(PROMPTS5)
    assert [len(x) for x in ours] == [len(p) - 1 for p in PROMPTS5]
    torch.testing.assert_close(torch.tensor(sum(ours, [])), torch.tensor(sum(ref, [])), rtol=0, atol=1e-5)
    _assert_same_batch(hf_pair, one, prompts=PROMPTS5[:1])  # one prompt: the second replica idle


def test_new_weights_reach_every_replica_in_place(hf_pair, ckpts):
    before = _batch(hf_pair)[0]
    hf_pair.load_weights(ckpts["b"])
    assert (hf_pair.stats.reloads, hf_pair.stats.restarts) == (1, 0)
    _assert_same_batch(hf_pair, HFEngine(ckpts["b"]))  # prompts 3 and 4 are the second replica's
    assert _batch(hf_pair)[0] != before
    hf_pair.load_tensors(load_file(f"{ckpts['a']}/model.safetensors"))  # from memory, through shared memory
    _assert_same_batch(hf_pair, HFEngine(ckpts["a"]))


def test_a_failed_load_names_the_replica_and_leaves_them_serving(hf_pair, ckpts, tmp_path):
    broken = with_truncated_weights(ckpts["b"], tmp_path / "broken")
    with pytest.raises(EngineLoadError, match=r"engine replica 0 of 2: load_weights failed: EngineLoadError: .*broken "
                                              r"is unusable"):
        hf_pair.load_weights(broken)
    hf_pair.restart(ckpts["a"])
    _assert_same_batch(hf_pair, HFEngine(ckpts["a"]))


def test_a_replica_that_cannot_start_is_named(tmp_path):
    with pytest.raises(EngineLoadError, match=r"engine replica 0 of 2: start failed: .*missing"):
        make_engine("hf", str(tmp_path / "missing"), data_parallel_size=2)


def test_shares_cores_and_gpus_are_split_per_replica():
    assert contiguous_shares(5, 2) == [(0, 3), (3, 5)]
    assert contiguous_shares(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert replica_cpus([3, 0, 1, 2], "auto", 2, 1) == [([0, 1], "0,1"), ([2, 3], "2,3")]
    assert replica_cpus(range(4), "auto", 2, 2) == [([0, 1], "0|1"), ([2, 3], "2|3")]
    assert replica_cpus(range(8), "0-1|4|5,7|6", 2, 2) == [([0, 1, 4], "0-1|4"), ([5, 7, 6], "5,7|6")]
    with pytest.raises(EngineLoadError, match=r"data_parallel_size=2 x tensor_parallel_size=2 needs a CPU core per "
                                              r"worker; this process may use 3"):
        replica_cpus(range(3), "auto", 2, 2)
    with pytest.raises(EngineLoadError, match=r"VLLM_CPU_OMP_THREADS_BIND='0-3' lists 1 CPU groups; .* needs 2"):
        replica_cpus(range(4), "0-3", 2, 1)
    assert replica_gpus(["4", "5", "6", "7"], 2, 2) == ["4,5", "6,7"]
    with pytest.raises(EngineLoadError, match=r"needs 8 GPUs; this process sees 4"):
        replica_gpus(["0", "1", "2", "3"], 2, 4)
