"""The engine service of a resident run (``run.resident``): the generation engine (vLLM or HF), started once from
the state's actor; its ops run the rollout and evaluate stages with it, and take the actor's new weights in memory
(:mod:`models.hosts.transports`), probed against the trainer's forward before it serves them. Each op names its
iteration: an engine holding another iteration's policy refuses it. With ``run.off_policy_steps=1`` the next
actor's weights wait (``pending``) until a request asks for that actor: the batch after an update is still
sampled from the actor before it. A restarted engine (killed, then started again by the run or its node's retry)
starts from the run's starting state; its callers then have the actor trainer push the weights it holds, or the
engine ``load`` the state's committed actor (:func:`models.stages.services.restore_engine`).

With ``run.max_staleness`` k ≥ 2 the engine samples without waiting (:class:`~models.hosts.producer.Producer`,
started by the first ``rollout``, at its iteration): ``rollout`` takes the iteration's batch from its buffer, new
weights are loaded (and verified) as soon as the unit under way is sampled, and every op that uses the engine
takes its turn between two units.

On the CPU, in lockstep (on-policy, no producer) and where a full-weight push follows (an engine that takes no
deltas, no LoRA adapter), the engine frees its KV cache and its weights once the rollout is sampled
(:func:`models.engines.in_rank.sleep`), as a colocated engine does: the trainer scores and updates meanwhile, and the
push gives them back. An op asked of it before the push (an evaluation a cluster ran first) loads the state's
committed actor in place first.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Optional

from models.checkpoint import is_committed
from models.config import TrainConfig
from models.checkpoint.local import load_tokenizer, local_checkpoint
from models.engines import in_rank
from models.hosts.async_batch import take_rollout
from models.hosts.producer import EngineTurns, Producer
from models.hosts.transports import transport_for
from models.run.types import PolicyState, RunHandle
from models.service.ops import Host, op
from models.stages.engine import engine_for
from models.stages.evaluate import run_evaluate
from models.run.data import read_run_prompts
from models.stages.rollout import draw_for, prompt_counts, run_rollout, unit_episodes
from models.stages.services import LABELS
from models.training.distributed import DistInfo
from models.training.probe import verify_reference


class WrongIteration(RuntimeError):
    """The request is for another iteration than the one the service's policy is at."""


def check_iteration(label: str, holds: int, iteration: int) -> None:
    if holds < 0:
        raise WrongIteration(f"{label} serves no policy: its last weight update failed (see the actor update's "
                             f"error); rerun the launch to resume from the last checkpoint")
    if iteration != holds:
        raise WrongIteration(f"{label} holds the policy of iteration {holds}, but the request is for iteration "
                             f"{iteration}: the run's services and its resume point disagree (rerun the launch to "
                             f"restart them from the last checkpoint)")


class EngineHost(Host):
    label = LABELS["engine"]
    statuses = {WrongIteration: 409}

    def __init__(self, cfg: TrainConfig, run: RunHandle, state: PolicyState, info: DistInfo):
        self.cfg, self.run = cfg, run
        self.transport = transport_for(cfg, run.reference_url)
        self.pending: Dict[int, Callable[[], Any]] = {}
        self.accepted = ""
        """The id of the last push taken whole (loaded and verified, or kept to load in order): what a delta may
        build on (``run.weight_push=delta``)."""
        self.turns, self.producer, self.taken = EngineTurns(), None, None  # run.max_staleness >= 2
        if state.behaviour_url:  # resumed off-policy: the next batch comes from the actor before the state's
            self.engine = engine_for(cfg, state.behaviour_url)
            self.version = state.iteration - 1
            self.pending[state.iteration] = lambda: setattr(self, "engine", engine_for(cfg, state.actor_url))
        else:
            self.engine = engine_for(cfg, state.actor_url)  # from the checkpoint, probed as a task's engine is
            self.version = state.iteration

    def serve(self, state: Dict[str, Any]) -> PolicyState:
        """The request's state, once the engine serves its actor: the one held, or the next one kept pending."""
        state = PolicyState(**state)
        if in_rank.weights_discarded(self.engine) and state.iteration == self.version:  # asked before the push
            in_rank.wake(self.engine)
            self.engine.load_weights(local_checkpoint(state.actor_url))
            in_rank.weights_loaded(self.engine)
        if state.iteration != self.version and state.iteration in self.pending:
            apply = self.pending.pop(state.iteration)
            self.version = -1  # until the new weights are in and verified
            apply()
            self.version = state.iteration
        check_iteration(self.label, self.version, state.iteration)
        return state

    def turn(self):
        """The engine to this op alone (asynchronous: between two of the producer's units)."""
        return self.turns.op() if self.cfg.run.asynchronous else contextlib.nullcontext()

    @op
    def rollout(self, state: Dict[str, Any], ahead: int = 0) -> Dict[str, Any]:
        if self.cfg.run.asynchronous:
            return self.take(state)
        out = run_rollout(self.cfg, self.run, self.serve(state), ahead, engine=self.engine)
        stats = dict(out.stats)
        if self.discards(ahead):
            stats["resident/sleep_s"] = in_rank.sleep(self.engine, discard_weights=True)
        return {"batch": out.batch.uri, "stats": stats}

    def discards(self, ahead: int) -> bool:
        """Whether the engine frees its KV cache and weights after this rollout (see the module docstring): on the
        CPU, in lockstep, when the next thing it is given is a full-weight push."""
        import torch

        run = self.cfg.run
        return (not ahead and not run.asynchronous and not run.pipelined and not self.cfg.actor.lora.enabled
                and not torch.cuda.is_available() and not getattr(self.engine, "patchable", False))

    def take(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The iteration's batch from the producer's buffer (the same request again: the same batch)."""
        with self.turns.op():
            state = self.serve(state)
        if self.taken is not None and self.taken[0] == state.iteration:
            return self.taken[1]
        if self.producer is None:
            data = read_run_prompts(self.run.train_prompts_url)
            draws: Dict[int, Any] = {}

            def draw(j: int):
                return draws[j] if j in draws else draws.setdefault(j, draw_for(self.cfg, self.run, j, data))

            tokenizer, episodes = load_tokenizer(self.run.reference_url), None
            if self.cfg.rollout.environment:  # multi-turn: a unit's prompts as episodes, seeded as the whole draw's
                episodes = unit_episodes(self.cfg, tokenizer)

            self.producer = Producer(self.cfg.run.staleness, state.iteration, self.cfg.run.num_iterations,
                                     lambda: (self.engine, self.version), draw, tokenizer, self.turns,
                                     self.cfg.run.partial_rollouts, self.cfg.run.stale_samples, episodes,
                                     prompt_counts(self.engine))
        out = take_rollout(self.cfg, self.run, self.producer, state.iteration, self.engine)
        self.taken = (state.iteration, {"batch": out.batch.uri, "stats": out.stats})
        return self.taken[1]

    @op
    def evaluate(self, state: Dict[str, Any]) -> float:
        with self.turn():
            return run_evaluate(self.cfg, self.run, self.serve(state), engine=self.engine)

    @op
    def load(self, state: Dict[str, Any]) -> Dict[str, float]:
        """The state's actor from its committed checkpoint (a restarted engine, whose trainer holds a later actor)."""
        state = PolicyState(**state)
        if not is_committed(state.actor_url):
            raise WrongIteration(f"{self.label} cannot serve the actor of iteration {state.iteration}: the actor "
                                 f"trainer holds another, and {state.actor_url} is not a committed checkpoint (rerun "
                                 f"the launch to resume from the last checkpoint)")
        t0 = time.perf_counter()
        with self.turn():
            self.version = -1
            self.accepted = ""
            self.pending.pop(state.iteration, None)
            self.engine = engine_for(self.cfg, state.actor_url)  # probed as a task's engine is
            self.version = state.iteration
        self.poke()
        return {"time/weights_load_s": time.perf_counter() - t0}

    def poke(self) -> None:
        if self.producer is not None:
            self.producer.poke()

    @op
    def connect(self, host: str, gpu: str = "", timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """The engine's end of the transport's channel (the collective's), for the actor trainer to join."""
        joins = getattr(self.engine, "worker_processes", 0)  # a tensor-parallel engine's workers join it: between
        with self.turn() if joins else contextlib.nullcontext():  # two of the producer's units
            return self.transport.connect(host=host, gpu=gpu, timeout_s=timeout_s, engine=self.engine)

    @op
    def held_push(self) -> Dict[str, Any]:
        """``id``: the push a delta may build on: the last one taken, if the engine can patch and still holds it (or
        keeps it to load); "" (a full push first) after a restart, a reload from a checkpoint or a failed push.
        ``patchable``: whether this engine takes deltas at all."""
        engine = self.engine
        patchable = bool(getattr(engine, "patchable", False))
        holds = self.accepted and (self.pending or getattr(engine, "pushed", "") == self.accepted)
        return {"id": self.accepted if holds and patchable else "", "patchable": patchable}

    @op
    def weights(self, version: int, probe: Dict[str, Any], tolerance: float, defer: bool = False,
                meta: Optional[Dict[str, Any]] = None, body: Optional[bytes] = None) -> Dict[str, float]:
        """The actor of iteration ``version`` from the trainer: taken now, loaded now or (``defer``, off-policy)
        when a request asks for that actor."""
        keep = defer or self.cfg.run.asynchronous  # kept until served, or until the producer's unit is sampled
        wake_s = 0.0
        if not keep:
            self.version = -1  # until the new weights are in and verified, the engine serves no iteration
        if not keep and in_rank.weights_discarded(self.engine):  # slept since the rollout (:meth:`discards`):
            wake_s = in_rank.wake(self.engine)  # storage for the weights the push writes
        self.accepted = ""  # until this push is taken whole
        put = self.transport.receive(meta or {}, body, None if keep else self.engine)  # streamed in, or kept
        pushed = str((meta or {}).get("header", {}).get("id", ""))

        def load() -> Dict[str, float]:
            t0 = time.perf_counter()
            self.version = -1  # until the new weights are in and verified, the engine serves no iteration
            pushed = put(self.engine)  # in, and read back: the engine holds what was sent, bit for bit
            result = verify_reference(self.engine, probe["sequences"], probe["logprobs"], float(tolerance),
                                      f"the actor of iteration {version} (in memory)")
            self.version = int(version)
            in_rank.weights_loaded(self.engine)
            return {**pushed, "rollout/probe_gap_max": result.gap_max if result is not None else 0.0,
                    "time/weights_load_s": time.perf_counter() - t0, "resident/wake_s": wake_s}

        if defer:
            self.pending[int(version)] = load
            self.accepted = pushed
            return {}
        with self.turn():
            out = load()
        self.accepted = pushed
        self.poke()
        return out

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        self.transport.close()
        self.engine.close()
