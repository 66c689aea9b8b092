"""What a colocated engine is asked, in order (``models/hosts/colocated.py``, ``models/engines/in_rank.py``), with a
recording stand-in for vLLM's ``LLM`` where the GPU is the point: after a rollout the engine sleeps at level 2 (a
full-weight push follows: its weights are not copied to host memory to be overwritten), at level 1 after an
evaluation or before a LoRA push; a push wakes the weights, loads them, empties the device's cache, and only then
wakes the KV cache; a rollout asked of an engine whose weights were discarded loads them first. The start-up probe
uses the weights the trainer holds, never the checkpoint. vLLM's prefix-cache reset (``reset_prefix_cache``),
which returns False while requests hold cache blocks, is tried again, and a push whose reset never happens fails
naming it. The agreed restart over two gloo ranks is in ``tests/unit/hosts/test_colocated.py``."""

from __future__ import annotations

import shutil
from types import SimpleNamespace
from typing import List

import pytest
import torch

from models.engines import HFEngine, in_rank
from models.engines.base import EngineLoadError, EngineStats
from models.engines.vllm_engine import VLLMEngine
from models.engines.vllm_steps import reset_prefix_cache
from models.hosts import colocated
from models.hosts.colocated import ColocatedActorHost
from models.training.distributed import DistInfo
from models.training.policy import PolicyLogprobs
from tests.unit.models.actor_checkpoints import actor_dir


class RecordingLLM:
    """vLLM's ``LLM`` as the colocated host uses it, recording each call; ``resets``: what ``reset_prefix_cache``
    returns, one value a call (then True)."""

    def __init__(self, calls: List[str], resets=()):
        self.calls, self.resets = calls, list(resets)
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep level {level}")

    def wake_up(self, tags=None) -> None:
        self.calls.append(f"wake {','.join(tags) if tags else 'all'}")

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset prefix cache")
        return self.resets.pop(0) if self.resets else True

    def collective_rpc(self, fn, args=(), kwargs=None):
        self.calls.append(f"rpc {getattr(fn, '__name__', fn)}")
        return [[]]


def _host(calls: List[str], lora: bool = False) -> ColocatedActorHost:
    """A one-rank colocated actor host around a stand-in engine (no trainer, no checkpoint)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    host = object.__new__(ColocatedActorHost)
    host.cfg = SimpleNamespace(probe_tolerance=1.0, actor=SimpleNamespace(lora=SimpleNamespace(enabled=lora)))
    host.info, host.version, host.trained, host.label = DistInfo(0, 1, 0, torch.device("cpu")), 3, None, "actor"
    host.model, host.vocab, host.broken, host.slept, host.run = PolicyLogprobs(lm), 16, False, {}, None
    host.tp, host.group, host.groups = 1, None, [[0]]
    host.engine = SimpleNamespace(llm=RecordingLLM(calls), _llm_kwargs={"enable_sleep_mode": True},
                                  stats=EngineStats())
    host.load = lambda version, shard: calls.append(f"load {version}") or {}
    return host


@pytest.fixture
def calls(monkeypatch) -> List[str]:
    out: List[str] = []
    monkeypatch.setattr(colocated, "verify_reference", lambda *a: out.append("probe") or SimpleNamespace(gap_max=0.0))
    monkeypatch.setattr(colocated, "run_rollout", lambda *a, **k: out.append("generate") or SimpleNamespace(
        batch=SimpleNamespace(uri="batch"), stats={}))
    monkeypatch.setattr(colocated, "run_evaluate", lambda *a, **k: out.append("evaluate") or 0.5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the device's cache is emptied on a GPU
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: out.append("empty cache"))
    return out


STATE = {"iteration": 3, "actor_url": "actor-3"}


def test_a_rollout_discards_the_weights_and_the_push_wakes_them_before_the_kv_cache(calls):
    host = _host(calls)
    host.rollout(STATE)
    host.send_weights(4, defer=False)
    assert calls == ["generate", "sleep level 2", "wake weights", "load 4", "empty cache", "wake kv_cache", "probe"]


def test_an_evaluation_or_a_lora_push_keeps_the_weights(calls):
    host = _host(calls)
    host.evaluate(STATE)
    host.rollout(STATE)  # woken whole: its weights were kept
    assert calls == ["evaluate", "sleep level 1", "wake weights,kv_cache", "generate", "sleep level 2"]
    calls.clear()
    lora = _host(calls, lora=True)
    lora.rollout(STATE)  # the adapter's push leaves the base as it is
    assert calls == ["generate", "sleep level 1"]


def test_a_rollout_asked_again_before_the_push_loads_the_held_weights_first(calls):
    host = _host(calls)
    host.rollout(STATE)
    calls.clear()
    host.rollout(STATE)
    assert calls == ["wake weights", "load 3", "empty cache", "wake kv_cache", "probe", "generate", "sleep level 2"]


def test_the_start_up_probe_reads_the_trainers_weights_not_the_checkpoint(tmp_path, monkeypatch):
    """The engine serves the checkpoint; the checkpoint is then deleted and the probe runs all the same, from the
    trainer's model in memory (the old probe loaded the whole checkpoint on every rank)."""
    from transformers import AutoModelForCausalLM

    ckpt = actor_dir(tmp_path / "actor", seed=0)
    host = _host([])
    host.model = PolicyLogprobs(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32))
    host.engine = HFEngine(ckpt, dtype="float32")
    shutil.rmtree(ckpt)
    monkeypatch.setattr("models.training.probe.trainer_logprobs", lambda *a, **k: pytest.fail("read a checkpoint"))
    restarts: List[int] = []
    host.probe_at_start(lambda: restarts.append(1), "actor-0")
    assert restarts == [] and host.engine.stats.extra["probe_gap_max"] < 1e-4


def test_a_failed_prefix_cache_reset_is_tried_again():
    calls: List[str] = []
    reset_prefix_cache(RecordingLLM(calls, resets=[False, False, True]), waits=(0.0, 0.0, 0.0, 0.0))
    assert calls == ["reset prefix cache"] * 3
    with pytest.raises(RuntimeError, match="prefix cache reset failed 2 times"):
        reset_prefix_cache(RecordingLLM(calls, resets=[False] * 9), waits=(0.0, 0.0))


def test_a_push_whose_prefix_cache_reset_never_happens_fails_naming_it(monkeypatch):
    """vLLM's reset returns False while a request holds cache blocks: the push fails (the engine closed) rather than
    serve prefixes of the old weights."""
    monkeypatch.setattr("models.engines.vllm_steps.RESET_WAITS_S", (0.0, 0.0, 0.0))
    for resets, fails in (([False, True], False), ([False] * 9, True)):
        calls: List[str] = []
        engine = object.__new__(VLLMEngine)
        engine.llm, engine._steps, engine._shared, engine._pushing = RecordingLLM(calls, resets), None, {}, True
        engine._llm_kwargs, engine._push_t0, engine.stats = {}, 0.0, EngineStats()
        if fails:
            with pytest.raises(EngineLoadError, match="prefix cache reset failed"):
                engine.end_push()
            assert engine.llm is None  # closed: restarted from a checkpoint before it serves again
        else:
            engine.end_push()
        assert calls[:1] == ["rpc finish"] and calls.count("reset prefix cache") == (3 if fails else 2)


def test_in_rank_wakes_only_the_tags_asleep():
    calls: List[str] = []
    engine = SimpleNamespace(llm=RecordingLLM(calls), _llm_kwargs={"enable_sleep_mode": True})
    in_rank.wake(engine)  # awake: nothing to wake
    in_rank.sleep(engine, discard_weights=True)
    assert in_rank.weights_discarded(engine)
    in_rank.wake(engine, ("weights",))
    in_rank.wake(engine, ("weights",))
    in_rank.weights_loaded(engine)
    in_rank.wake(engine)
    assert calls == ["sleep level 2", "wake weights", "wake kv_cache"] and not in_rank.weights_discarded(engine)
