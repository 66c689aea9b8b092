"""A full-weight push's two ends (models/hosts/pushes.py) in one process, into a real HF engine: the trainer's
float32 weights cast to the engine's dtype as they are sealed into buckets give the engine exactly the weights it
loads from the trainer's checkpoint at that dtype (what the stateless mode serves), so the two modes sample the
same responses; at float32 the engine holds the trainer's weights bit for bit, as before the cast was added."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.engines import HFEngine, SamplingSpec
from models.engines.weight_stream import bits
from models.hosts.pushes import Push, received, sealed
from models.training.distributed import DistInfo
from models.training.weight_source import WeightSource
from tests.unit.models.actor_checkpoints import PROMPTS, actor_dir

INFO = DistInfo(0, 1, 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("actors")
    return {"a": actor_dir(root / "a", seed=0), "b": actor_dir(root / "b", seed=1)}


def push(engine, model, dtype: str, bucket_bytes: int = 1 << 14, defer: bool = False) -> dict:
    """``model``'s weights through both ends of a push at ``dtype`` (several buckets), into ``engine`` as they
    arrive, or (``defer``: off-policy) kept until they are put into it."""
    source = WeightSource(model, INFO, prefix="")
    pusher = Push(getattr(torch, dtype), bucket_bytes)
    header = pusher.header(source, "cpu")
    put = received(header, enumerate(sealed(header, source, "cpu", 1, pusher.dtype)), None if defer else engine)
    return {**put(engine), **pusher.stats(header), "buckets": len(header["buckets"])}


@pytest.mark.parametrize("dtype,defer", [("bfloat16", False), ("float32", False), ("bfloat16", True)])
def test_a_push_serves_what_the_stateless_engine_loads_from_the_checkpoint(ckpts, dtype, defer):
    """Streamed, the engine holds a bucket or two at once; kept for later (off-policy), the whole push."""
    trained = AutoModelForCausalLM.from_pretrained(ckpts["b"], dtype=torch.float32)  # the trainer's master weights
    resident = HFEngine(ckpts["a"], dtype=dtype)
    out = push(resident, trained, dtype, defer=defer)
    assert (out["resident/receiver_peak_bytes"] > out["resident/weights_bytes"]) == defer
    stateless = HFEngine(ckpts["b"], dtype=dtype)  # the stateless mode: the committed checkpoint, cast on load
    held, loaded = resident.model.state_dict(), stateless.model.state_dict()
    assert out["buckets"] > 3 and set(held) == set(loaded)
    assert all(torch.equal(bits(held[k]), bits(loaded[k])) for k in held)
    if dtype == "float32":  # as before the push cast: the trainer's own bits
        assert all(torch.equal(bits(held[k]), bits(v)) for k, v in trained.state_dict().items())
    width = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    assert out["resident/weights_bytes"] == width * sum(p.numel() for p in trained.parameters())
    spec = SamplingSpec(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    assert resident.generate(PROMPTS, spec) == stateless.generate(PROMPTS, spec)


def test_the_push_travels_at_the_engines_dtype():
    from models.config.io import load_config
    from models.hosts.transports import transport_for

    vllm = load_config("tiny_ppo", ["rollout.engine=vllm", "rollout.vllm_dtype=bfloat16"])
    hf = load_config("tiny_ppo", ["rollout.engine=hf", "rollout.vllm_dtype=bfloat16"])
    assert (vllm.engine_dtype, hf.engine_dtype) == ("bfloat16", "float32")
    for transport in ("collective", "http"):
        assert transport_for(dataclasses.replace(vllm, run=dataclasses.replace(vllm.run, resident_weight_transport=
                                                                                transport))).push.dtype == torch.bfloat16
    assert transport_for(hf).push.dtype == torch.float32
