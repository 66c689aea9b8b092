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

from models.data.prompts import PromptDataset
from models.demos.tokenizer import build_char_tokenizer
from models.engines import HFEngine, SamplingSpec
from models.engines.rollout import sample
from models.hosts.producer import UNIT_PROMPTS, EngineTurns, Producer, merged
from models.stages.async_metrics import idle_stats, staleness_stats
from models.stages.rollout import Draw
from tests.unit.models.actor_checkpoints import actor_dir

K, ITERATIONS, PER_DRAW = 2, 5, 6  # 6 prompts: units of 4 and 2


@pytest.fixture(scope="module")
def actors(tmp_path_factory):
    root = tmp_path_factory.mktemp("actors")
    return [actor_dir(root / "a", seed=0, intermediate_size=64), actor_dir(root / "b", seed=1, intermediate_size=64)]


def draw(j: int) -> Draw:
    prompts = [f"draw {j} prompt {p}" for p in range(PER_DRAW)]
    data = PromptDataset(prompts, np.arange(PER_DRAW, dtype=np.int64))
    ids = np.arange(j * PER_DRAW, (j + 1) * PER_DRAW, dtype=np.int64)
    return Draw(j, data, ids, SamplingSpec(n=2, temperature=1.0, max_new_tokens=5, seed=100 + j))


def test_batches_are_drawn_by_the_versions_they_name_and_at_most_k_behind(actors):
    tok = build_char_tokenizer()
    engine, turns, served = HFEngine(actors[0]), EngineTurns(), {"version": 0}
    producer = Producer(K, 0, ITERATIONS, lambda: (engine, served["version"]), draw, tok, turns)
    try:
        taken = []
        for i in range(ITERATIONS):
            units, window = producer.take(i, timeout_s=120)
            taken.append((units, window))
            # the engine runs ahead until draw version + k is sampled, then waits for the next version
            ahead = min(served["version"] + K + 1, ITERATIONS)
            deadline = time.monotonic() + 60
            while producer.next[0] < ahead and time.monotonic() < deadline:
                time.sleep(0.05)
            assert producer.next == (ahead, 0) and not producer.todo
            with turns.op():  # the trainer's push of version i + 1
                engine.load_weights(actors[(i + 1) % 2])
                served["version"] = i + 1
            producer.poke()
    finally:
        producer.close()
    assert not producer.thread.is_alive()

    lags = []
    for i, (units, window) in enumerate(taken):
        assert [(u.start, u.end) for u in units] == [(0, UNIT_PROMPTS), (UNIT_PROMPTS, PER_DRAW)]
        cols, versions = merged(units)
        assert cols.prompt_id.tolist() == np.repeat(draw(i).prompt_ids, 2).tolist()  # every prompt once, in order
        for unit in units:  # what the actor of the version named samples for those prompts, seeded by position
            reference = sample(HFEngine(actors[unit.version % 2]), tok, draw(i).data.prompts[unit.start:unit.end],
                               draw(i).prompt_ids[unit.start:unit.end], draw(i).spec, first_index=unit.start)
            assert unit.columns.response_tokens == reference.response_tokens
            assert np.allclose(np.concatenate(unit.columns.sampler_logprobs),
                               np.concatenate(reference.sampler_logprobs), atol=1e-6)
        lags.append(int(staleness_stats(i, versions, K)["async/staleness_p100"]))
        assert window["dropped"] == 0 and 0 <= window["trainer_wait_s"] <= window["window_s"]
    # draws 0-2 sampled by version 0 at once; then draw j by version j - 2 as soon as it is pushed
    assert lags == [0, 1, 2, 2, 2]


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
    assert idle_stats(10.0, 0.5, 2.0, 4) == {"async/engine_idle_fraction": 0.05,
                                             "async/trainer_idle_fraction": 0.2, "async/dropped_samples": 4.0}
