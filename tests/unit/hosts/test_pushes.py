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
from models.training.weight_shadow import Shadow
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


def delta_push(engine, model, dtype: str, shadow, push: int, base: str, kept: bool = False) -> dict:
    """``model``'s weights as a delta against ``shadow`` (``base``: the push the engine holds; "": a full push that
    fills the shadow), through both ends in this process; ``kept``: received while the engine is busy (kept, then
    put into it, as an asynchronous run's engine takes it)."""
    source = WeightSource(model, INFO, prefix="")
    pusher = Push(getattr(torch, dtype), 1 << 14)
    header = pusher.header(source, "cpu", {"id": f"p{push}", "base": base, "seed": push})
    buckets = sealed(header, source, "cpu", push, pusher.dtype, shadow=shadow)
    out = received(header, enumerate(buckets), None if kept else engine)(engine)
    return {**out, **pusher.stats(header, getattr(buckets, "sent", None))}


@pytest.mark.slow  # three AdamW steps and six pushes into two engines (about 4 s)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_delta_pushes_serve_the_same_weights_and_samples_as_full_pushes(ckpts, dtype):
    """Three updates (AdamW at lr 1e-6 on the policy's own log-likelihood of random tokens, a GRPO step's shape
    without the rollout), each pushed whole into one engine and as a delta into another: both hold the trainer's
    weights cast to their dtype bit for bit and sample the same responses after every update (the second delta kept
    while the engine is busy, then put into it); at bfloat16 the
    deltas carry a small fraction of the bytes (most float32 steps of 1e-6 round to the same bfloat16)."""
    trained = AutoModelForCausalLM.from_pretrained(ckpts["b"], dtype=torch.float32)
    full, delta = HFEngine(ckpts["b"], dtype=dtype), HFEngine(ckpts["b"], dtype=dtype)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-6)
    shadow, spec = Shadow(), SamplingSpec(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    gen = torch.Generator().manual_seed(0)
    delta_push(delta, trained, dtype, shadow, 0, "")  # a new engine: a full push first
    sent = []
    for step in range(1, 4):
        tokens = torch.randint(0, trained.config.vocab_size, (4, 12), generator=gen)
        trained(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
        whole = push(full, trained, dtype)
        out = delta_push(delta, trained, dtype, shadow, step, f"p{step - 1}", kept=step == 2)
        assert (out["resident/receiver_host_bytes"] > 0) == (step == 2)  # (the kept buckets' bytes counted)
        sent.append(out["resident/weights_bytes"] / whole["resident/weights_bytes"])
        a, b = full.model.state_dict(), delta.model.state_dict()
        cast = {k: v.to(getattr(torch, dtype)) for k, v in trained.state_dict().items()}
        assert all(torch.equal(bits(a[k]), bits(b[k])) and torch.equal(bits(b[k]), bits(cast[k])) for k in a)
        assert 0 < out["resident/push_density"] <= 1
        assert full.generate(PROMPTS, spec) == delta.generate(PROMPTS, spec)
    if dtype == "bfloat16":
        assert max(sent) < 0.5, sent


def test_an_in_process_push_draws_the_transported_samples_without_buckets(ckpts, monkeypatch):
    """:class:`Unsealed` (the colocated load) gives each bucket's tensors as gathered, with the very samples the
    sealed buckets of the same push carry, and computes no checksum (nothing crosses a channel); :func:`loaded` puts
    them into the engine, which then holds the trained weights at its dtype bit for bit."""
    from models.engines import weight_stream
    from models.engines.weight_stream import read_samples
    from models.hosts.pushes import Unsealed, loaded

    trained = AutoModelForCausalLM.from_pretrained(ckpts["b"], dtype=torch.float32)
    source = WeightSource(trained, INFO, prefix="")
    pusher = Push(torch.bfloat16, 1 << 14)
    header = pusher.header(source, "cpu")
    want = {}
    for index, bucket in enumerate(sealed(header, source, "cpu", 7, torch.bfloat16)):
        data = int(header["buckets"][index][0])
        want.update(read_samples(header, index, bucket[data:-8]))
    monkeypatch.setattr(weight_stream, "checksum", lambda *a, **k: pytest.fail("an in-process push checksummed"))
    chunks = list(Unsealed(header, source, "cpu", 7, torch.bfloat16))
    assert len(chunks) == len(header["buckets"]) > 3
    assert {k: v for _, samples in chunks for k, v in samples.items()} == want
    assert all(t.dtype == torch.bfloat16 for tensors, _ in chunks for t in tensors.values())
    engine = HFEngine(ckpts["a"], dtype="bfloat16")
    out = loaded(header, Unsealed(header, source, "cpu", 7, torch.bfloat16), engine)
    assert set(out) == {"time/weights_receive_s", "time/weights_read_back_s"}
    held, trained_state = engine.model.state_dict(), trained.state_dict()
    assert all(torch.equal(bits(held[k]), bits(trained_state[k].to(torch.bfloat16))) for k in trained_state)
