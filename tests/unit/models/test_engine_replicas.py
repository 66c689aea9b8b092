"""Data-parallel engine replicas (``rollout.data_parallel_size``): the batch of two replicas is the batch
of one engine (same tokens, log-probs within float noise), a slow replica takes fewer prompts, new weights
reach every replica in place, a failure names its replica; each replica pinned to its own cores.

The reference is one engine in this process on the same checkpoint and request: each sample has its own
seed (:func:`models.engines.base.sample_seed` of its index in the whole request), so which replica takes a
chunk, and when, must not change a sample. The pair's second replica is a straggler throughout (it sleeps
``SLOW_S`` per prompt: ``models/faults.py``), so every batch here is checked under uneven dispatch: the first
replica takes the chunks after it, from other places of the request than one contiguous share. The replicas
are engine-agnostic processes; vLLM's side (a chunk's seeds from its prompts' indices) is checked on the vLLM engine
tests/integration/test_engine_reload.py already starts."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from models.engines import EngineLoadError, EngineReplicas, HFEngine, SamplingSpec, make_engine
from models.engines.base import EngineStats, contiguous_shares
from models.engines.dispatch import Dispatch, request_chunks
from models.engines.replicas import replica_cpus, replica_gpus
from models.environ import environment
from models.environments.episodes import Environment, EpisodeLimits, Step, run_episodes
from models.environments.tools import HermesParser
from models.faults import SLOW_REPLICA_ENV
from tests.unit.models.actor_checkpoints import PROMPTS, actor_dir, with_truncated_weights

PROMPTS5 = PROMPTS + [[1, 30, 31, 32]]  # five: chunks [0, 2), [2, 4) to the slow replica, then [4, 5)
SAMPLED = SamplingSpec(n=2, temperature=1.0, max_new_tokens=6, seed=7)
SLOW_S = 0.1
"""Seconds per prompt the pair's second replica sleeps: a few HF calls of the fast one on the tiny model."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("actors")
    return {"a": actor_dir(root / "a", seed=0), "b": actor_dir(root / "b", seed=1)}


@pytest.fixture(scope="module")
def hf_pair(ckpts):
    with environment({SLOW_REPLICA_ENV: f"1:{SLOW_S}"}):  # read by the replicas' processes as they start
        engine = make_engine("hf", ckpts["a"], data_parallel_size=2)
    assert isinstance(engine, EngineReplicas) and engine.replicas == 2
    yield engine
    engine.close()


def _batch(engine, prompts=PROMPTS5, spec=SAMPLED):
    gens = [g for per_prompt in engine.generate(prompts, spec) for g in per_prompt]
    return [g.tokens for g in gens], torch.tensor([lp for g in gens for lp in g.logprobs]), [g.is_end for g in gens]


ATOL = 5e-5
"""Log-probs of one sample from a replica's chunk against the whole request's in one engine: the same weights and
tokens, a batch of other rows and padding beside them, so other GEMM blocking (1.07e-5 seen on an AVX2-only EPYC,
2026-11-30; float32's step at a log-prob of 2-4 is 2.4e-7)."""


def _assert_same_batch(engine, reference, atol=ATOL, prompts=PROMPTS5):
    tokens, logp, ends = _batch(engine, prompts)
    ref_tokens, ref_logp, ref_ends = _batch(reference, prompts)
    assert (tokens, ends) == (ref_tokens, ref_ends)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=atol)


def test_two_hf_replicas_sample_the_batch_of_one_engine(hf_pair, ckpts):
    one = HFEngine(ckpts["a"])
    _assert_same_batch(hf_pair, one)
    ours, ref = hf_pair.prompt_logprobs(PROMPTS5), one.prompt_logprobs(PROMPTS5)
    assert [len(x) for x in ours] == [len(p) - 1 for p in PROMPTS5]
    torch.testing.assert_close(torch.tensor(sum(ours, [])), torch.tensor(sum(ref, [])), rtol=0, atol=ATOL)
    _assert_same_batch(hf_pair, one, prompts=PROMPTS5[:1])  # one prompt: the second replica idle


def test_a_slow_replica_takes_fewer_prompts_than_its_share(hf_pair, ckpts):
    prompts = [[1, 10 + i, 60 + i % 7] for i in range(32)]  # fixed shares: 16 each
    _assert_same_batch(hf_pair, HFEngine(ckpts["a"]), prompts=prompts)
    done = hf_pair.last_dispatch  # the pair's call (the first of the two)
    # chunks of 8, 8, 4, 4, 2, 2, 2, 2: the slow replica sleeps 0.8 s on its first 8 while the fast one
    # takes the rest, so fixed shares would have made the call wait 1.6 s of sleep on the slow one's 16
    assert sum(done.prompts) == 32 and done.prompts[1] < 16 < done.prompts[0]
    assert done.chunks[0] > done.chunks[1] >= 1


def test_multi_turn_episodes_through_the_replicas_are_one_engines(hf_pair, ckpts, monkeypatch):
    """The episode loop calls ``generate`` once per turn on the active episodes (fewer each turn), each episode's
    turns on the replica that took its first (sticky: its context's prefix is cached there)."""
    tok = AutoTokenizer.from_pretrained(ckpts["a"])
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
                         "{% if add_generation_prompt %}a:{% endif %}")
    spec = SamplingSpec(temperature=1.0, max_new_tokens=6, seed=3, stop_token_ids=tuple(range(4, 60)))

    def episodes(engine):
        envs = [TurnsEnv({"prompt": f"go {k}", "turns": 1 + k % 3}) for k in range(6)]
        with ThreadPoolExecutor(1) as pool:
            return run_episodes(engine, tok, envs, spec, EpisodeLimits(max_turns=3, max_episode_tokens=60),
                                HermesParser(), pool)

    calls, generate = [], hf_pair.generate

    def recorded(prompts, spec, sessions=None):
        before = dict(hf_pair.homes)
        out = generate(prompts, spec, sessions=sessions)
        calls.append((list(sessions), before, list(hf_pair.last_dispatch.prompts), dict(hf_pair.homes)))
        return out

    monkeypatch.setattr(hf_pair, "generate", recorded)
    ours, ref = episodes(hf_pair), episodes(HFEngine(ckpts["a"]))
    # turn 1 dealt as any request (the straggler took one chunk, [2, 4)), each later turn where its episode began
    (first, before, dealt, homes), *later = calls
    assert len(later) == 2 and not set(first) & set(before) and dealt == [4, 2]
    assert [homes[s] for s in first] == [0, 0, 1, 1, 0, 0]
    for sessions, before, dealt, after in later:
        assert set(sessions) <= set(before) and [after[s] for s in sessions] == [before[s] for s in sessions]
        assert dealt == [sum(before[s] == r for s in sessions) for r in range(2)], (sessions, before, dealt)
    assert [(e.response_ids, e.turns, e.done) for e in ours] == [(e.response_ids, e.turns, e.done) for e in ref]
    assert max(e.turns for e in ours) == 3 and min(e.turns for e in ours) == 1
    torch.testing.assert_close(torch.tensor(sum((e.logprobs for e in ours), [])),
                               torch.tensor(sum((e.logprobs for e in ref), [])), rtol=0, atol=ATOL)


class TurnsEnv(Environment):
    """Done after the row's ``turns`` turns."""

    def step(self, assistant, tool_results):
        self.turns = getattr(self, "turns", 0) + 1
        return Step(messages=[{"role": "user", "content": "more"}], done=self.turns == self.row["turns"])


def test_new_weights_reach_every_replica_in_place(hf_pair, ckpts):
    before = _batch(hf_pair)[0]
    hf_pair.load_weights(ckpts["b"])
    assert (hf_pair.stats.reloads, hf_pair.stats.restarts) == (1, 0)
    _assert_same_batch(hf_pair, HFEngine(ckpts["b"]))  # prompts 2 and 3 are the second replica's
    assert _batch(hf_pair)[0] != before
    hf_pair.load_tensors(load_file(f"{ckpts['a']}/model.safetensors"))  # from memory, through shared memory
    _assert_same_batch(hf_pair, HFEngine(ckpts["a"]))
    from transformers import AutoModelForCausalLM

    from tests.unit.hosts.test_pushes import push

    out = push(hf_pair, AutoModelForCausalLM.from_pretrained(ckpts["b"]), "float32")  # a resident push, checked
    assert out["buckets"] > 3 and out["time/weights_read_back_s"] > 0  # both replicas read back
    _assert_same_batch(hf_pair, HFEngine(ckpts["b"]))


def test_a_failed_load_names_the_replica_and_leaves_them_serving(hf_pair, ckpts, tmp_path):
    broken = with_truncated_weights(ckpts["b"], tmp_path / "broken")
    with pytest.raises(EngineLoadError, match=r"engine replica 0 of 2: load_weights failed: EngineLoadError: .*broken "
                                              r"is unusable"):
        hf_pair.load_weights(broken)
    hf_pair.restart(ckpts["a"])
    _assert_same_batch(hf_pair, HFEngine(ckpts["a"]))


def test_a_failed_chunk_names_its_replica_and_the_next_call_is_whole(hf_pair, ckpts):
    bad = PROMPTS5[:4] + [[1, 10**6]]  # an id outside the vocabulary, in the last chunk
    with pytest.raises(RuntimeError, match=r"engine replica [01] of 2: generate failed: IndexError"):
        hf_pair.generate(bad, SAMPLED)
    # the chunk still out was waited for: no stale answer to [2, 4) of the bad request in a pipe
    _assert_same_batch(hf_pair, HFEngine(ckpts["a"]), prompts=PROMPTS5[::-1])


def test_a_replica_that_cannot_start_is_named(tmp_path):
    with pytest.raises(EngineLoadError, match=r"engine replica 0 of 2: start failed: .*missing"):
        make_engine("hf", str(tmp_path / "missing"), data_parallel_size=2)


def test_requests_are_cut_into_chunks_large_first():
    assert request_chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert request_chunks(32, 2) == [(0, 8), (8, 16), (16, 20), (20, 24), (24, 26), (26, 28), (28, 30), (30, 32)]
    assert [b - a for a, b in request_chunks(512, 4)] == [64] * 4 + [32] * 4 + [16] * 8  # never under 512/4/8
    assert request_chunks(1, 3) == [(0, 1)] and request_chunks(0, 2) == []
    for count in range(40):
        for replicas in (2, 3, 8):
            chunks = request_chunks(count, replicas)  # every prompt once, in order, no empty chunk
            assert [i for a, b in chunks for i in range(a, b)] == list(range(count)) and all(b > a for a, b in chunks)
    # fixed shares of 4 at the speed each replica showed (0.5 s and 1 s per prompt): the slow share's 4 s
    assert Dispatch([6, 2], [3, 1], [3.0, 2.0]).fixed_shares_s() == 4.0
    assert Dispatch([1, 0], [1, 0], [1.0, 0.0]).fixed_shares_s() == 0.0


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


def test_a_slowed_engine_sleeps_per_prompt_and_samples_the_same(ckpts, monkeypatch):
    """``RLHF_FAULT_SLOW_ENGINE`` (the async benchmarks' slower engine): every sampling call sleeps its seconds per
    prompt once the engine has generated, and the samples are the ones an unslowed call draws."""
    from models import faults
    from models.engines.rollout import sample

    slept, this, sleep = [], threading.current_thread(), faults.time.sleep
    # time.sleep is the process's: other threads' sleeps (a left-over worker's poll) go on as they were
    monkeypatch.setattr(faults.time, "sleep", lambda s: slept.append(s) if threading.current_thread() is this
                        else sleep(s))
    tokenizer, engine = AutoTokenizer.from_pretrained(ckpts["a"]), HFEngine(ckpts["a"])
    prompts = ["abc", "de", "fgh"]
    plain = sample(engine, tokenizer, prompts, [0, 1, 2], SAMPLED)
    assert slept == []
    with environment({faults.SLOW_ENGINE_ENV: "0.25"}):
        slowed = sample(engine, tokenizer, prompts, [0, 1, 2], SAMPLED)
    assert slept == [0.75]
    assert slowed.response_tokens == plain.response_tokens and slowed.sampler_logprobs == plain.sampler_logprobs


class _OnGPU(torch.Tensor):
    """A stand-in for a CUDA tensor (no GPU here): says it is on ``cuda:0``; ``to`` gives a plain host copy."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    def to(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


def _by_hand(count: int = 2):
    """``EngineReplicas`` of ``count`` replicas with no process behind them: it, and the other ends of its pipes (a
    test answers there as a replica's process would)."""
    import multiprocessing

    replicas = object.__new__(EngineReplicas)
    replicas.replicas, replicas.stats, replicas._counts, replicas._conns = count, EngineStats(), [(0, 0)] * count, []
    replicas.homes, replicas._prompts = {}, {}
    theirs = []
    for _ in range(count):
        ours, other = multiprocessing.Pipe()
        replicas._conns.append(ours)
        theirs.append(other)
    return replicas, theirs


def test_pushed_tensors_cross_the_pipe_to_the_replicas_on_the_host():
    """An NCCL push's chunks are CUDA views of a bucket; pickled over the Pipe torch would hand them over by CUDA IPC,
    which a replica whose ``CUDA_VISIBLE_DEVICES`` hides that GPU cannot open. What crosses is on the host (read
    from the Pipe's other end, as a replica's process reads it), with the chunk's values."""
    import threading

    replicas, ends = _by_hand()
    crossed = []
    for theirs in ends:
        def serve(conn=theirs):
            op, args, _ = conn.recv()
            crossed.append((op, args[0]))
            conn.send((None, None, (0, 0)))

        threading.Thread(target=serve, daemon=True).start()
    bucket = torch.arange(6, dtype=torch.float32)
    replicas.push_chunk({"w": bucket[:4].as_subclass(_OnGPU), "b": bucket[4:]})
    assert [op for op, _ in crossed] == ["push_chunk"] * 2
    for _, tensors in crossed:
        assert {name: t.device.type for name, t in tensors.items()} == {"w": "cpu", "b": "cpu"}
        assert tensors["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and tensors["b"].tolist() == [4.0, 5.0]


def test_the_replicas_prompt_tokens_add_up_a_restarted_engine_counting_from_zero():
    """What each replica's engine counted of prompt tokens (and of those its prefix cache served) adds up in the
    replicas' stats (``rollout/prefix_cache_hit_rate``), by the increase since its last answer; an engine that
    restarted (its counts lower than before) counts from 0."""
    replicas, theirs = _by_hand()
    for counts in ([(0, 0, 100, 20), (0, 0, 50, 0)], [(0, 0, 130, 40), (1, 1, 30, 10)]):  # replica 1 restarted
        for conn, c in zip(theirs, counts):
            conn.send((None, None, c))
        replicas._answers([0, 1])
    assert (replicas.stats.prompt_tokens, replicas.stats.cached_prompt_tokens) == (100 + 50 + 30 + 30, 20 + 20 + 10)
    assert replicas._counts == [(0, 0), (1, 1)]
