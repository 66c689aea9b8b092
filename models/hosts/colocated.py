"""The actor trainer service of a colocated resident run (``run.resident_layout=colocated``): every rank also holds
a generation engine (vLLM in the rank's own process through its ``external_launcher`` executor, or the HF engine),
so the run has no engine service, no weight transport and no engine node on a cluster.

- ``rollout`` / ``evaluate``: rank 0 runs the stage as the engine service would, its engine calls dealt over every
  rank's engine (:mod:`models.engines.rank_engines`: prompts by length, a GRPO group on one rank, each sample
  seeded by its index in the call); the batch is written once, by rank 0.
- After each update every rank loads the new weights into its own engine in process: each tensor all-gathered from
  the FSDP2 shards and cast to the engine's dtype (:meth:`~models.training.weight_source.WeightSource.gathered`
  ``everywhere``), given to the engine as gathered, a bucket's tensors at a time, with the samples a transported
  push draws (:class:`~models.hosts.pushes.Unsealed`: no bucket buffer or checksum, since no byte crosses a
  channel), then the engine's weights read back at the samples bit for bit, then the probe against the trainer's
  forward. LoRA: the
  adapter's file, made on every rank and served as the separate layout's engine serves it. No byte crosses a
  process: ``resident/weights_bytes`` is 0 (``resident/weights_loaded_bytes``: what each engine took).
- The engine sleeps after each rollout and evaluation (:mod:`models.engines.in_rank`): after a rollout, which a
  full-weight push follows, its weights are discarded (vLLM's level 2: nothing copied to host memory only to be
  overwritten); after an evaluation, or before a LoRA push (the base stays), they are kept (level 1). Before a push
  only the weights wake; the KV cache wakes once they are loaded and the device's cache emptied (veRL's order):
  ``resident/sleep_s``, ``resident/wake_s``. A stage asked of an engine whose weights were discarded and not
  replaced (a rollout asked again) first loads the weights held.
- The probe at start compares each rank's engine with the trainer's forward of the weights the ranks hold (no
  checkpoint read into host memory: at 70B that was the whole model on every rank); a miss on any rank restarts
  every rank's engine (:func:`~models.training.probe.verify_together`): a tensor-parallel engine's restart runs
  collectives over the whole world, so no rank may restart alone.

With ``rollout.tensor_parallel_size`` = tp > 1 each engine group of tp consecutive ranks holds one vLLM engine
sharded tp ways (:mod:`models.engines.rank_engines`); every rank still gathers each tensor whole and gives it to its
engine, whose loader keeps the rank's shard, and reads back only what it holds: each element it holds is compared bit
for bit, and every sampled element must be held by some rank of its group (:func:`uncovered`, checked on every rank
once the ranks have told each other what they hold).

A load that fails on any rank fails the update on every rank (:class:`~models.hosts.trainers.PushFailed`, the
trained weights kept): the ranks agree on it before the probe (a tensor-parallel engine's ranks must all run it, or
none) and after it. The same request loads the weights again, into engines started afresh on every rank from the
run's reference checkpoint (vLLM's groups are made by every rank of the world together; every tensor is loaded
again, so nothing of the reference remains).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from models.checkpoint.local import local_checkpoint
from models.engines import in_rank
from models.engines.rank_engines import RankEngines, engine_groups, follow
from models.hosts.pushes import Push, Unsealed, loaded
from models.hosts.trainers import ActorHost, PushFailed
from models.hosts.transports import adapter_file
from models.run.types import PolicyState
from models.service.ops import op
from models.stages.engine import started_engine
from models.stages.evaluate import run_evaluate
from models.stages.rollout import run_rollout
from models.training.distributed import unwrap
from models.training.probe import reference_logprobs, verify_reference, verify_together
from models.training.weight_source import WeightSource


class ColocatedActorHost(ActorHost):
    """:class:`ActorHost` whose ranks each hold an engine too (see the module docstring)."""

    def __init__(self, cfg, run, state: PolicyState, info):
        super().__init__(cfg, run, state, info)  # the trainer's process group first: vLLM's ranks join it
        world = info.world_size
        self.group = dist.new_group(backend="gloo") if world > 1 else None  # the engine calls, as Python objects
        self.tp = cfg.rollout.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1
        self.groups = engine_groups(world, self.tp)  # refused at config time unless tp divides the ranks
        self.engine, restart, _, _ = started_engine(cfg, state.actor_url)  # every rank: from the checkpoint
        check_group(self.engine, self.groups[info.rank // self.tp])
        self.broken = False  # a failed load closed the engine: started again before the next load
        self.slept: Dict[str, float] = {}
        self.probe_at_start(restart, state.actor_url)

    def probe_at_start(self, restart: Callable[[], None], what: str) -> None:
        """Every rank's engine against the trainer's forward of the weights the ranks hold (see the module
        docstring); a miss on any rank restarts them all. Every rank calls it."""
        if self.cfg.probe_tolerance <= 0:
            return
        sequences, logprobs = reference_logprobs(unwrap(self.model), self.vocab)  # every rank: FSDP2
        result = verify_together(self.engine, sequences, logprobs, self.cfg.probe_tolerance, restart,
                                 lambda missed: bool(self.agree("missed" if missed else "")),
                                 f"{what} (in process, rank {self.info.rank})")
        self.engine.stats.extra["probe_gap_max"] = result.gap_max

    def stage(self, state: Dict[str, Any], run_stage, push_follows: bool = False) -> Optional[Any]:
        """``run_stage(state, engine)`` on rank 0 with the ranks' engines, the other ranks serving their shares;
        then the engines sleep, discarding their weights when ``push_follows`` (a full-weight push comes before
        the next stage). Rank 0's result."""
        state = PolicyState(**state)
        self.held(state.iteration)  # on every rank, before any collective
        if in_rank.weights_discarded(self.engine):  # no push came since: the weights held go in again
            self.send_weights(self.version, defer=False)
        in_rank.wake(self.engine)  # awake already after a load: the update's stats have its wake_s
        try:
            if not self.info.is_main:
                follow(self.engine, self.info.rank, self.info.world_size, self.group, self.tp)
                return None
            engines = RankEngines(self.engine, self.info.world_size, self.group, self.tp)
            try:
                return run_stage(state, engines)
            finally:
                engines.end()
        finally:
            self.slept = {"resident/sleep_s": in_rank.sleep(self.engine, discard_weights=push_follows)}

    @op
    def rollout(self, state: Dict[str, Any], ahead: int = 0) -> Optional[Dict[str, Any]]:
        if ahead:
            raise ValueError("run.resident_layout=colocated samples on-policy only (run.off_policy_steps=0)")
        out = self.stage(state, lambda s, engines: run_rollout(self.cfg, self.run, s, 0, engine=engines),
                         push_follows=not self.cfg.actor.lora.enabled)  # a LoRA push leaves the base as it is
        return None if out is None else {"batch": out.batch.uri, "stats": {
            **out.stats, **self.slept, "resident/engine_groups": float(len(self.groups))}}

    @op
    def evaluate(self, state: Dict[str, Any]) -> Optional[float]:
        return self.stage(state, lambda s, engines: run_evaluate(self.cfg, self.run, s, engine=engines))

    def send_weights(self, version: int, defer: bool) -> Dict[str, float]:
        """The weights held, as the actor of iteration ``version``, into every rank's engine in process, checked
        (see the module docstring); :class:`PushFailed` on every rank when any rank's load failed."""
        t0 = time.perf_counter()
        sequences, logprobs = reference_logprobs(unwrap(self.model), self.vocab)  # every rank: FSDP2
        wake_s = in_rank.wake(self.engine, ("weights",))  # the KV cache once the weights are in
        out: Dict[str, float] = {}
        shard: Optional[Dict[str, Any]] = {} if self.tp > 1 else None

        def load() -> None:
            if self.broken:
                self.engine.restart(local_checkpoint(self.run.reference_url))
                self.broken = False
            out.update(self.load(version, shard))

        def probe() -> None:
            nonlocal wake_s
            in_rank.weights_loaded(self.engine)
            empty_device_cache()  # the gathered tensors' blocks, before the KV cache takes its share
            wake_s += in_rank.wake(self.engine, ("kv_cache",))
            result = verify_reference(self.engine, sequences, logprobs, self.cfg.probe_tolerance,
                                      f"the actor of iteration {version} (in process, rank {self.info.rank})")
            out["rollout/probe_gap_max"] = result.gap_max

        failed = self.agree(attempt(load, self.info.rank), shard)
        if not failed:
            failed = self.agree(attempt(probe, self.info.rank))
        if failed:
            self.broken = True  # on every rank: the engines start again together
            raise PushFailed(f"loading the new weights into the colocated engines failed: {failed} (the trainer keeps "
                             f"the weights: the same request loads them again)")
        stats = {**out, "resident/weights_bytes": 0.0, "resident/wake_s": wake_s,
                 "time/weights_to_engine_s": time.perf_counter() - t0}
        return stats if self.info.is_main else {}

    def agree(self, failed: str, shard: Optional[Mapping[str, Any]] = None) -> str:
        return agreed(failed, shard, self.group, self.info.world_size, self.groups)

    def load(self, version: int, shard: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
        """This rank's engine given the weights held: every tensor (or the LoRA adapter) whole on every rank;
        ``shard``: its engine holds a tensor-parallel shard (see :func:`load_in_process`)."""
        source = WeightSource(unwrap(self.model), self.info)
        if self.cfg.actor.lora.enabled:
            config, body = adapter_file(self.lm, source.full(everywhere=True))
            return {**self.transport.receive({"adapter_config": config}, body)(self.engine),
                    "resident/weights_loaded_bytes": float(len(body))}
        return load_in_process(self.engine, source, getattr(torch, self.cfg.engine_dtype), version, self.info.device,
                               shard=shard)

    def close(self) -> None:
        super().close()
        self.engine.close()


def empty_device_cache() -> None:
    """Give the CUDA caching allocator's free blocks back to the device (nothing on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_in_process(engine, source: WeightSource, dtype: torch.dtype, version: int, device,
                    bucket_bytes: Optional[int] = None, shard: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
    """Every tensor of ``source`` whole on this rank (an all-gather of each FSDP2 shard in turn) at ``dtype``, loaded
    into ``engine`` a bucket's tensors at a time as gathered (:class:`~models.hosts.pushes.Unsealed`: no buffer, no
    checksum; the samples drawn with a generator seeded ``version``, as a transported push's), then the samples
    read back bit for bit (:func:`~models.hosts.pushes.loaded`). Every rank of ``source`` calls it (the gathers are
    collectives); its figures, with ``resident/weights_loaded_bytes`` the tensors' bytes at ``dtype``. ``shard`` (a
    dict): ``engine`` holds one tensor-parallel shard; only what it holds is read back, and ``shard`` gets what was
    sampled and what it holds (:func:`uncovered` checks a group's union)."""
    push = Push(dtype, bucket_bytes)
    header = push.header(source, device)
    out = loaded(header, Unsealed(header, source, device, version, dtype), engine, shard=shard)
    sizes = push.stats(header)
    return {**out, "resident/weights_loaded_bytes": sizes["resident/weights_bytes"],
            "resident/weights_params": sizes["resident/weights_params"]}


def check_group(engine, ranks: List[int]) -> None:
    """A vLLM engine in the ranks (``external_launcher``) must be sharded over exactly its engine group's ``ranks``
    (vLLM lays its tensor-parallel groups out itself): a :class:`RuntimeError` naming both otherwise."""
    if getattr(engine, "_llm_kwargs", {}).get("distributed_executor_backend") != "external_launcher":
        return
    from vllm.distributed import parallel_state

    held = list(parallel_state.get_tp_group().ranks)
    if held != ranks:
        raise RuntimeError(f"vLLM sharded this rank's engine over actor ranks {held}, not its engine group {ranks}")


def attempt(step: Callable[[], None], rank: int) -> str:
    """Run ``step``; what failed, as the other ranks are told it (empty: nothing)."""
    try:
        step()
        return ""
    except Exception as err:  # noqa: BLE001 -- every rank learns it, and keeps the trained weights
        return f"rank {rank}: {type(err).__name__}: {err}"


def agreed(failed: str, shard: Optional[Mapping[str, Any]], group, world: int, groups: List[List[int]]) -> str:
    """Every rank's failure (``failed``: its text, empty for none) told to every rank over ``group``: the first one;
    then, with ``shard`` (this rank's sampled and held elements, :func:`~models.hosts.pushes.loaded`), the first
    sampled element no rank of an engine group holds (:func:`uncovered`). Every rank calls it and gets the same
    answer (empty: every rank succeeded)."""
    mine = (failed, dict(shard or {}))
    answers = [mine]
    if group is not None:
        answers = [None] * world
        dist.all_gather_object(answers, mine, group=group)
    first = next((f for f, _ in answers if f), "")
    if first or shard is None:
        return first
    return uncovered([a[1] for a in answers], groups) or ""


def uncovered(shards: Sequence[Mapping[str, Any]], groups: List[List[int]]) -> Optional[str]:
    """The first sampled element of a push that no rank of an engine group holds (``shards[r]``: rank ``r``'s
    ``sent`` and ``holds``, :func:`~models.hosts.pushes.loaded`, each ``{tensor: [flat positions]}``), naming the
    group and the tensor; None when every group holds every element between its ranks."""
    for g, ranks in enumerate(groups):
        for name, where in shards[ranks[0]].get("sent", {}).items():
            union = set().union(*(shards[r].get("holds", {}).get(name, ()) for r in ranks))
            missing = [p for p in where if p not in union]
            if missing:
                return (f"no rank of engine group {g} (actor ranks {ranks[0]}-{ranks[-1]}) holds {name!r} element "
                        f"{missing[0]}: the group's engine did not load it")
    return None
