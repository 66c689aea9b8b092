"""The engine service's background sampler of an asynchronous run (models/hosts/producer.py), with a real HF engine
whose weights change between two actors as a trainer's pushes would change them: every batch taken holds its draw's
prompts in order, each unit exactly what an engine holding the version it is tagged with samples for those prompts
(so the per-token versions name the policy that really drew the tokens), no token staler than k, and the engine
runs ahead of the trainer by k versions and no further."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from models.config.io import load_config
from models.data.batch import RolloutBatch
from models.data.prompts import PromptDataset
from models.demos.tokenizer import build_char_tokenizer
from models.engines import HFEngine, SamplingSpec
from kernels.losses import truncated_is_weights
from models.engines.rollout import sample
from models.hosts.async_batch import merged, take_rollout
from models.hosts.producer import UNIT_PROMPTS, EngineTurns, Producer
from models.stages.async_metrics import idle_stats, staleness_stats
from models.run.types import RunHandle
from models.stages.rollout import Draw
from tests.unit.hosts.pushes import push_later, take_ahead, take_once
from tests.unit.models.actor_checkpoints import actor_dir

K, PER_DRAW = 2, 6  # 6 prompts: units of 4 and 2


@pytest.fixture(scope="module")
def actors(tmp_path_factory):
    root = tmp_path_factory.mktemp("actors")
    return [actor_dir(root / "a", seed=0, intermediate_size=64), actor_dir(root / "b", seed=1, intermediate_size=64)]


def draw(j: int) -> Draw:
    prompts = [f"draw {j} prompt {p}" for p in range(PER_DRAW)]
    data = PromptDataset(prompts, np.arange(PER_DRAW, dtype=np.int64))
    ids = np.arange(j * PER_DRAW, (j + 1) * PER_DRAW, dtype=np.int64)
    return Draw(j, data, ids, SamplingSpec(n=2, temperature=1.0, max_new_tokens=5, seed=100 + j))


@pytest.mark.parametrize("k", [K, 4])
def test_batches_are_drawn_by_the_versions_they_name_and_at_most_k_behind(actors, k, tmp_path):
    """Each batch taken as an iteration's rollout takes it (``take_rollout``: written to the run as Arrow, read back
    here), at k = 2 and k = 4 (the issue's two settings), over k + 3 iterations: warm-up, then lag k."""
    tok = build_char_tokenizer()
    iterations = k + 3
    cfg = load_config("configs/tiny_grpo.yaml", ["run.resident=true", f"run.max_staleness={k}", "actor.tis_cap=2"])
    run = RunHandle(str(tmp_path), "async", "", "", "", "")
    engine, turns, served = HFEngine(actors[0]), EngineTurns(), {"version": 0}
    producer = Producer(k, 0, iterations, lambda: (engine, served["version"]), draw, tok, turns)
    taken, _ = take_ahead(producer, lambda i: take_rollout(cfg, run, producer, i, engine), turns, served, iterations,
                          k, lambda version: engine.load_weights(actors[version % 2]))

    lags = []
    for i, (units, window) in enumerate(taken):
        assert [(u.start, u.end) for u in units] == [(0, UNIT_PROMPTS), (UNIT_PROMPTS, PER_DRAW)]
        table = RolloutBatch.read(run.layout.batch_url(i, "rollouts")).table
        assert table.column("prompt_id").to_pylist() == np.repeat(draw(i).prompt_ids, 2).tolist()  # each once
        versions = table.column("token_versions").to_pylist()
        assert versions == merged(units)[1]
        for unit in units:  # what the actor of the version named samples for those prompts, seeded by position
            reference = sample(HFEngine(actors[unit.version % 2]), tok, draw(i).data.prompts[unit.start:unit.end],
                               draw(i).prompt_ids[unit.start:unit.end], draw(i).spec, first_index=unit.start)
            assert unit.columns.response_tokens == reference.response_tokens
            assert np.allclose(np.concatenate(unit.columns.sampler_logprobs),
                               np.concatenate(reference.sampler_logprobs), atol=1e-6)
        lags.append(max(i - v for vs in versions for v in vs))
        assert window["dropped"] == 0 and 0 <= window["trainer_wait_s"] <= window["window_s"]
    # draws 0..k sampled by version 0 at once; then draw j by version j - k as soon as it is pushed
    assert lags == [min(i, k) for i in range(iterations)]


def test_a_push_waits_for_the_unit_under_way_and_goes_before_the_next():
    turns, order = EngineTurns(), []
    in_unit = threading.Event()

    def producer():
        with turns.unit():
            in_unit.set()
            time.sleep(0.3)
            order.append("unit 1")
        with turns.unit():
            order.append("unit 2")

    thread = threading.Thread(target=producer)
    thread.start()
    in_unit.wait(5)
    with turns.op():
        order.append("push")
    thread.join(5)
    assert order == ["unit 1", "push", "unit 2"]


def test_staleness_metrics_by_hand():
    # iteration 5, k = 2: tokens at versions 5, 4, 4, 3 and a sample that took new weights half-way (3 then 4)
    versions = [[5], [4, 4], [3, 4]]
    out = staleness_stats(5, versions, 2)
    assert out["async/staleness_p50"] == 1.0 and out["async/staleness_p100"] == 2.0  # lags 0, 1, 1, 2, 1
    assert (out["async/lag_0_share"], out["async/lag_1_share"], out["async/lag_2_share"]) == (0.2, 0.6, 0.2)
    assert out["async/partial_fraction"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="3 updates old.*run.max_staleness=2 allows 0..2"):
        staleness_stats(6, versions, 2)
    assert idle_stats(10.0, 0.5, 2.0, 4, 3) == {"async/engine_idle_fraction": 0.05,
                                                "async/trainer_idle_fraction": 0.2, "async/dropped_samples": 4.0,
                                                "async/reweighted_samples": 3.0}
    out = staleness_stats(6, versions, 2, reweighted=True)  # kept stale samples: lags 1, 2, 2, 3, 2
    assert out["async/staleness_p100"] == 3.0 and out["async/lag_over_k_share"] == 0.2


def _long(j: int) -> Draw:
    """A draw whose responses all run ``max_new_tokens`` steps: room for weights to change mid-generation."""
    d = draw(j)
    return d._replace(spec=SamplingSpec(n=2, temperature=1.0, max_new_tokens=24, min_new_tokens=24, seed=7))


def test_new_weights_between_two_tokens_tag_the_tokens_after_them(actors):
    """The engine's step hook loads actor b after the third token: the first three tokens of every sample are what
    actor a samples with the same seeds, the rest are tagged version 1 (and are not a's)."""
    tok = build_char_tokenizer()
    prompts = [tok(p)["input_ids"] for p in _long(0).data.prompts[:2]]
    spec, engine, steps = _long(0).spec, HFEngine(actors[0]), []

    def between_steps() -> int:
        steps.append(len(steps))
        if len(steps) == 3:
            engine.load_weights(actors[1])
        return 1 if len(steps) >= 3 else 0

    gens, versions = engine.generate_versions(prompts, spec, first_index=0, version=0, between_steps=between_steps)
    reference = HFEngine(actors[0]).generate(prompts, spec)
    flat, ref = [g for p in gens for g in p], [g for p in reference for g in p]
    assert versions == [[0] * 3 + [1] * 21] * 4
    assert all(g.tokens[:3] == r.tokens[:3] for g, r in zip(flat, ref))
    assert any(g.tokens[3:] != r.tokens[3:] for g, r in zip(flat, ref))


def test_partial_rollouts_in_the_producer(actors):
    """A push queued while a unit samples is served at the next token; the unit goes on under the new version."""
    tok = build_char_tokenizer()
    engine, turns, served = HFEngine(actors[0]), EngineTurns(), {"version": 0}

    def unit_under_way():
        while not turns._busy:  # the producer's first unit is under way
            time.sleep(0.001)

    thread = push_later(unit_under_way, turns, engine, actors[1], served, 1)
    producer = Producer(K, 0, 1, lambda: (engine, served["version"]), _long, tok, turns, partial=True)
    units = take_once(producer, thread)
    assert served["version"] == 1
    versions = merged(units)[1]
    assert all(v == sorted(v) and set(v) <= {0, 1} for v in versions)
    mixed = [v for v in versions if len(set(v)) == 2]
    assert mixed and staleness_stats(1, versions, K)["async/partial_fraction"] > 0
    first = units[0]  # its old tokens are actor a's, seeded by position
    reference = sample(HFEngine(actors[0]), tok, _long(0).data.prompts[:UNIT_PROMPTS], _long(0).prompt_ids[:UNIT_PROMPTS],
                       _long(0).spec)
    for toks, ref, v in zip(first.columns.response_tokens, reference.response_tokens, first.token_versions()):
        old = v.count(0)
        assert toks[:old] == ref[:old]


def test_versions_follow_each_sample_to_its_own_stop_on_a_hub_checkpoint(qwen2_chat_dir):
    """On what users bring (byte-level BPE, a chat template, two eos ids in generation_config.json): with partial
    rollouts' step hook moving the version after the second token (the same weights), every sample keeps the tokens
    the plain ``generate`` draws with the same seeds, and holds exactly one version per token it kept, whichever
    eos id (or the length limit) ended it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
               for text in ("reverse abc", "hello there, how are you?", "2+2=")]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    spec = SamplingSpec(n=3, temperature=1.0, max_new_tokens=12, seed=7)
    engine, steps = HFEngine(qwen2_chat_dir), []

    def between_steps() -> int:
        steps.append(len(steps))
        return 5 if len(steps) >= 2 else 4

    gens, versions = engine.generate_versions(prompts, spec, first_index=0, version=4, between_steps=between_steps)
    reference = HFEngine(qwen2_chat_dir).generate(prompts, spec)
    flat, ref = [g for p in gens for g in p], [g for p in reference for g in p]
    assert [g.tokens for g in flat] == [r.tokens for r in ref]
    assert [len(v) for v in versions] == [len(g.tokens) for g in flat]
    assert all(v == ([4] * 2 + [5] * (len(v) - 2))[:len(v)] for v in versions)


@pytest.mark.parametrize("stale", ["drop", "reweight"])
def test_a_unit_made_stale_by_a_version_moving_back_is_dropped_or_reweighted(actors, stale):
    """Draw 4 starts at version 2 (actor a); mid-unit a restarted trainer pushes version 1 (actor b), 3 behind
    draw 4 with k = 2, then version 2 again. Dropped: the unit's 8 samples are counted and drawn again, every
    trained token is version 2. Reweighted: the unit is trained as drawn, counted, its version-1 tokens weighted by
    min(π_old/π_sampler, C) against their own sampler log-probs (π_old here actor a: they are a's rare tokens)."""
    tok = build_char_tokenizer()
    engine, turns, served = HFEngine(actors[0]), EngineTurns(), {"version": 2}

    def push(actor: int, version: int) -> None:
        with turns.op():
            engine.load_weights(actors[actor])
            served["version"] = version
        producer.poke()

    def pushes():
        while not turns._busy:  # the first unit of draw 4 is under way
            time.sleep(0.001)
        push(1, 1)
        deadline = time.monotonic() + 60
        while producer.next == (4, 0) and time.monotonic() < deadline:  # it finished, partly at version 1
            time.sleep(0.01)
        push(0, 2)

    producer = Producer(K, 4, 5, lambda: (engine, served["version"]), _long, tok, turns, partial=True, stale=stale)
    thread = threading.Thread(target=pushes)
    thread.start()
    try:
        units, window = producer.take(4, timeout_s=120)
    finally:
        producer.close()
        thread.join(10)
    cols, versions = merged(units)
    assert cols.prompt_id.tolist() == np.repeat(_long(4).prompt_ids, 2).tolist()  # every prompt once, in order
    stale_samples = [v for v in versions if 4 - min(v) > K]
    if stale == "drop":
        assert (window["dropped"], window["reweighted"]) == (2 * UNIT_PROMPTS, 0)
        assert not stale_samples and {x for v in versions for x in v} == {2}
        return
    assert (window["dropped"], window["reweighted"]) == (0, 2 * UNIT_PROMPTS)
    assert len(stale_samples) == 2 * UNIT_PROMPTS and all(v[0] == 2 and v[-1] == 1 for v in stale_samples)
    assert staleness_stats(4, versions, K, reweighted=True)["async/staleness_p100"] == 3.0
    cap, first = 0.5, units[0]
    sampler = np.concatenate(first.columns.sampler_logprobs)
    old = np.concatenate(HFEngine(actors[0]).prompt_logprobs(
        [p + r for p, r in zip(first.columns.prompt_tokens, first.columns.response_tokens)]))
    old = np.concatenate([o[len(p) - 1:] for o, p in zip(np.split(old, np.cumsum(
        [len(p) + len(r) - 1 for p, r in zip(first.columns.prompt_tokens, first.columns.response_tokens)])[:-1]),
        first.columns.prompt_tokens)])
    weights = truncated_is_weights(torch.tensor(old), torch.tensor(sampler), cap).numpy()
    assert np.allclose(weights, np.minimum(np.exp(old - sampler), cap)) and weights.max() <= cap
    by_b = np.concatenate(first.token_versions()) == 1
    assert weights[by_b].mean() < 0.01  # b's tokens, rare under a: weighted down
    assert (weights[~by_b] == cap).any()  # a's own tokens: ratio about 1 (eos masked for the sampler), held at C
