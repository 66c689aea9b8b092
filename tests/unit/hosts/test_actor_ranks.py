"""A resident actor trainer service on two gloo ranks (``actor.sharding=fsdp2``, the sharding ``auto`` takes on
GPUs), its ranks spawned here and serving through the real server, fan-out and agreement (models/hosts/resident.py,
models/service/ranks.py):

- placement: π_ref is read rank-locally as the stateless score's (``load_scorers_ranks``): each rank holds its
  shard of every parameter, and its peak host memory over π_ref's load stays within 1/ranks of a whole copy + 10%;
  the log-probs it computes equal a whole copy's; the scoring forward checks every parameter is on
  ``info.device``;
- a request every rank refuses alike (a batch sampled at another temperature) fails on every rank and the service
  serves the next one;
- a fault on rank 1 before the forward's first collective (``RLHF_FAULT_FAIL_RANK``) fails the request within
  60 s, naming the rank, and both ranks' processes end instead of waiting in the collective.

π_ref is a random Llama (4 × 384, vocabulary 4000: 10.3M parameters, 41 MB in float32), large enough for its load to
show above a process's noise (under 1 MB here), the actor a one-layer one of the same vocabulary. The memory is the
rise of the resident set's high-water mark over π_ref's load (``VmHWM``, reset just before), after the actor's (which
paid the process's first FSDP2 set-up) and the tokenizer's (which verified π_ref's checkpoint: a mapped read of the
file, per process, as for any checkpoint), with ``model.pack_sequences=false``: the packing check is a forward, whose
FSDP2 gathers (one unit at a time, on the GPU there) any forward makes; a first forward also sizes the process's
kernels' buffers, which would count here on CPU.
"""

from __future__ import annotations

import importlib
import json
import os
import time

import numpy as np
import pytest
import torch

from models.config.io import load_config
from models.data.batch import RolloutBatch
from models.data.batch_schema import BatchMetadata
from models.run.types import PolicyState, RunHandle
from models.service import book
from models.service.client import ServiceError
from models.service.token import SECRET_ENV
from models.stages.services import ACTOR, call_stage
from tests.processes import free_port
from tests.ranks import spawn

pytestmark = pytest.mark.slow  # two ranks, each importing torch and transformers

RANKS, VOCAB, SECRET = 2, 4000, "the-run-secret"
FAULT = "1:score"
"""Rank 1 fails its next score once the test armed the fault (``{RLHF_FAULT_DIR}/fail-score``)."""


def checkpoint(root, name: str, hidden: int, layers: int, seed: int = 0) -> tuple:
    """A random Llama committed under ``root`` with the demo's tokenizer: its URL and parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.checkpoint import save_checkpoint
    from models.demos.tokenizer import build_char_tokenizer

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                         num_key_value_heads=hidden // 64, tie_word_embeddings=False,
                                         max_position_embeddings=64))
    src = root / f"{name}-src"
    model.save_pretrained(src, safe_serialization=True)
    build_char_tokenizer().save_pretrained(src)
    save_checkpoint(str(src), str(root / name))
    return str(root / name), sum(p.numel() for p in model.parameters())


def rollout_batch(url: str, temperature: float) -> str:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 60, rng.integers(2, 6)).tolist() for _ in range(12)]
    responses = [rng.integers(5, 60, rng.integers(1, 7)).tolist() for _ in range(12)]
    meta = BatchMetadata(iteration=0, policy_version=0, algorithm="grpo",
                         extras={"sampling": json.dumps({"temperature": temperature})})
    RolloutBatch.from_rollout(meta, prompt_id=[i // 4 for i in range(12)], prompt_tokens=prompts,
                              response_tokens=responses, sampler_logprobs=[[-1.0] * len(r) for r in responses],
                              is_end=[True] * 12, prompt=["abc="] * 12, response=["cba"] * 12).write(url)
    return url


def _status_kib(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _rank(rank: int, port: int, setup: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS),
                      LOCAL_RANK=str(rank), RLHF_FAULT_FAIL_RANK=FAULT, RLHF_FAULT_DIR=out_dir,
                      **{SECRET_ENV: SECRET})
    torch.set_num_threads(1)
    for module in ("peft", "safetensors.torch", "torch.distributed.fsdp", "transformers.models.llama.modeling_llama"):
        importlib.import_module(module)  # what the load imports on its way, in before the measurement

    from models.hosts import resident, trainers

    load = trainers.load_reference_ranks

    def measured(*args):
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from here
        ref = load(*args)
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in ref.parameters())
        with open(os.path.join(out_dir, f"ref-{rank}.json"), "w") as f:
            json.dump({"rise": (_status_kib("VmHWM") - before) * 1024, "held": held}, f)
        return ref

    trainers.load_reference_ranks = measured
    resident.serve_service(ACTOR, setup["cfg"], setup["run"], setup["state"])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("actor-ranks")
    ref, ref_params = checkpoint(root / "r1", "reference", 384, 4)  # inside the run's folder, as a run's are
    actor, _ = checkpoint(root / "r1", "actor", 64, 1, seed=1)
    cfg = load_config("tiny_grpo", [f"run.storage_root={root}", "run.resident=true", "actor.nproc_per_node=2",
                                    "actor.sharding=fsdp2", "actor.micro_batch_size=2", "model.pack_sequences=false",
                                    "run.resident_answer_timeout_s=60", "run.resident_rank_grace_s=2"])
    run = RunHandle(str(root), "r1", "", ref, "", "", launch="local")
    setup = {"cfg": cfg, "run": run, "state": PolicyState(0, actor)}
    mp_env = pytest.MonkeyPatch()
    mp_env.setenv(SECRET_ENV, SECRET)
    ranks = spawn(_rank, (free_port(), setup, str(root)), nprocs=RANKS, join=False)
    deadline = time.monotonic() + 300
    while book.read(run.layout.url, ACTOR) is None:
        assert all(p.is_alive() for p in ranks.processes) and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.5)
    yield dict(setup, root=root, ranks=ranks, ref_params=ref_params)
    for p in ranks.processes:
        if p.is_alive():
            p.kill()
    mp_env.undo()


def test_pi_ref_is_held_by_shard_on_each_rank_and_scores_as_a_whole_copy(service):
    from transformers import AutoModelForCausalLM

    from models.checkpoint.local import local_checkpoint
    from tests.reference import token_logprobs

    cfg, run, state = service["cfg"], service["run"], service["state"]
    batch = rollout_batch(run.layout.batch_url(0, "rollouts"), cfg.rollout.temperature)
    out = call_stage(cfg, run, ACTOR, "score", state, batch)
    ranks = [json.loads((service["root"] / f"ref-{r}.json").read_text()) for r in range(RANKS)]
    total = service["ref_params"]
    assert [r["held"] for r in ranks] == [-(-total // RANKS)] * RANKS  # each rank its rows of every parameter
    bound = (1 / RANKS + 0.1) * total * 4  # a whole copy: float32 master weights
    assert max(r["rise"] for r in ranks) <= bound, f"peak host memory over π_ref's load per rank: {ranks}, bound " \
                                                   f"{bound:.0f} B"
    whole = AutoModelForCausalLM.from_pretrained(local_checkpoint(run.reference_url)).eval()
    scored = RolloutBatch.read(out["batch"])
    for mine, want in zip(scored.column("ref_logprobs").to_pylist(), token_logprobs(whole, scored)):
        np.testing.assert_allclose(mine, want, rtol=0, atol=1e-4)


def test_a_request_every_rank_refuses_leaves_the_service_serving(service):
    cfg, run, state = service["cfg"], service["run"], service["state"]
    hot = rollout_batch(run.layout.batch_url(1, "rollouts"), 0.5)
    with pytest.raises(ServiceError, match=r"score returned 500: ValueError: batch .* was sampled at temperature 0.5"):
        call_stage(cfg, run, ACTOR, "score", state, hot)
    batch = rollout_batch(run.layout.batch_url(0, "rollouts"), cfg.rollout.temperature)
    assert call_stage(cfg, run, ACTOR, "score", state, batch)["batch"] == run.layout.batch_url(0, "score")


def test_a_fault_on_one_rank_before_a_collective_fails_the_request_on_every_rank_within_a_minute(service):
    """Last: it stops the service."""
    cfg, run, state = service["cfg"], service["run"], service["state"]
    batch = rollout_batch(run.layout.batch_url(0, "rollouts"), cfg.rollout.temperature)
    (service["root"] / "fail-score").touch()  # armed: rank 1 fails this score before its forward
    t0 = time.monotonic()
    with pytest.raises(ServiceError, match=r"score returned 500: ServiceStopped: rank 1 failed \(RuntimeError: "
                                           r"injected fault .*\) while rank\(s\) 0 stayed inside the op 2 s later"):
        call_stage(cfg, run, ACTOR, "score", state, batch)
    assert time.monotonic() - t0 < 60
    for p in service["ranks"].processes:
        p.join(max(60 - (time.monotonic() - t0), 1))
    assert [p.exitcode for p in service["ranks"].processes] == [1, 1], "a rank still waits in the collective"
    assert time.monotonic() - t0 < 60
