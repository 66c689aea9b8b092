"""The trainer services of a resident run (``run.resident``): every rank of the actor's (the critic's) launch holds
its shard of the model and AdamW's state (a :class:`~models.stages.updates.Trainee`) and runs the stage functions
with them: ``update`` is :func:`~models.stages.updates.update_trainee` (a checkpoint every ``run.save_interval``;
the actor's new weights then go to the engine in memory), the actor's ``score`` :func:`~models.stages.score.run_score`
with π_old, π_ref (and the reward model) held here, the critic's ``values`` its share of the score's forward.
Each op names its iteration, refused by a service holding another; an ``update`` asked again for the iteration it
just did (a retried task whose reply was lost) returns that result instead of stepping twice. The actor's version
moves only once the engine confirmed the new weights: an update whose push failed keeps its trained weights and
result, and the same request again sends them again without stepping (``push`` sends the weights held to a
restarted engine). Every check that can refuse a request runs on every rank before any collective.
"""

from __future__ import annotations

import functools
import secrets
import time
from typing import Any, Callable, Dict, Optional

import torch

from models import faults, memory
from models.checkpoint.local import load_tokenizer
from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.hosts.engine import WrongIteration, check_iteration
from models.hosts.transports import Transport, transport_for
from models.run.types import PolicyState, RunHandle
from models.service.client import ServiceClient, ServiceError
from models.service.ops import Host, op
from models.stages.actor import ACTOR
from models.stages.critic import CRITIC
from models.stages.rewards import reward_source
from models.stages.score import Scorers, run_score, service_values
from models.stages.score_metrics import check_sampling_temperature
from models.stages.score_ranks import load_reference_ranks, load_reward_model_ranks, score_forward_ranks
from models.stages.services import ENGINE, LABELS, critic_service, run_service
from models.stages.updates import load_trainee, saves_at, update_trainee
from models.training.distributed import DistInfo, from_main, unwrap, waiting_group
from models.training.probe import reference_logprobs
from models.training.weight_shadow import Shadow
from models.training.weight_source import WeightSource


def _reason(err: Exception) -> str:
    return str(err) if isinstance(err, ServiceError) else f"{type(err).__name__}: {err}"


class PushFailed(RuntimeError):
    """The update is done but the engine did not confirm its weights: the same request sends them again."""


class TrainerHost(Host):
    """What the actor and critic services share: the trainee, the iteration held, the last update's result."""

    role = ACTOR
    statuses = {WrongIteration: 409, PushFailed: 503}

    def __init__(self, cfg: TrainConfig, run: RunHandle, state: PolicyState, info: DistInfo):
        self.cfg, self.run, self.info, self.version = cfg, run, info, state.iteration
        self.label = LABELS[self.role.name]
        self.trainee = load_trainee(self.role, cfg, state, info, {})
        self.model = self.trainee.model
        self.last: Optional[Dict[str, Any]] = None
        self.trained: Optional[Dict[str, Any]] = None
        """The update done but not confirmed by the engine (its push failed): its iteration and result."""
        tokenizer = load_tokenizer(run.reference_url)
        self.pad, self.vocab = tokenizer.pad_token_id or 0, len(tokenizer)

    def held(self, iteration: int) -> None:
        if self.trained is not None:
            raise WrongIteration(f"{self.label} holds the update of iteration {self.trained['iteration']}, which the "
                                 f"engine did not confirm: only that update's request again (which sends its weights "
                                 f"again) is served")
        check_iteration(self.label, self.version, iteration)

    @op
    def update(self, state: Dict[str, Any], batch: str) -> Dict[str, Any]:
        state = PolicyState(**state)
        if self.last is not None and state.iteration == self.version - 1 and self.last["iteration"] == state.iteration:
            return self.last["result"]  # the same request again: its reply was lost
        if self.trained is None or self.trained["iteration"] != state.iteration:
            self.held(state.iteration)
            faults.fail_on_rank("update", self.info.rank)
            t0 = time.perf_counter()
            out = update_trainee(self.role, self.cfg, self.run, state, RolloutBatch.open(batch), self.info,
                                 self.trainee, saves_at(self.cfg, state.iteration), {})
            self.trained = {"iteration": state.iteration, "checkpoint_url": out.checkpoint_url, "stats": out.stats,
                            "t0": t0}
        done = self.trained
        stats = {**done["stats"], **self.after_update(state)}  # PushFailed: kept for the same request again
        self.trained, self.version = None, state.iteration + 1
        result = {"checkpoint_url": done["checkpoint_url"],
                  "stats": {**stats, f"time/{self.role.name}_update_s": time.perf_counter() - done["t0"]}}
        self.last = {"iteration": state.iteration, "result": result}
        return result

    def after_update(self, state: PolicyState) -> Dict[str, float]:
        """What follows an update before its version moves (the actor: the engine confirms the new weights)."""
        return {}

    def forward(self, fn):
        """``fn()`` with the model in eval mode, no gradients (every rank: FSDP2 forwards are collective), then its
        FSDP2 root resharded (FSDP2 keeps it gathered after a forward for the backward that follows in training:
        here none follows, and the whole embedding would stay on every rank through the update's start)."""
        self.model.eval()
        try:
            with torch.no_grad():
                return fn()
        finally:
            self.model.train()
            if hasattr(self.model, "reshard"):
                self.model.reshard()


class ActorHost(TrainerHost):
    """Also π_ref (the reference, or with LoRA the trained model with its adapter off) and, with
    ``reward.source=model``, the reward model: sharded on the ranks as the stateless ``score_ranks`` holds it
    (one rank: whole, the one-process score's reward source)."""

    role = ACTOR

    def __init__(self, cfg: TrainConfig, run: RunHandle, state: PolicyState, info: DistInfo):
        super().__init__(cfg, run, state, info)
        keep = cfg.run.resident_reference == "keep" or cfg.actor.lora.enabled  # (LoRA's π_ref: the actor itself)
        self.ref = load_reference_ranks(cfg, run, info, self.model) if keep else None  # sharded as the score's
        self.reward_model = load_reward_model_ranks(cfg, run, info) if info.world_size > 1 else None
        one_rm = cfg.reward.source == "model" and info.world_size == 1
        self.rewards = reward_source(cfg, run, info.device) if one_rm else None
        self.transport = transport_for(cfg, run.reference_url)  # rank 0's end, kept between pushes
        self.waiting = waiting_group(cfg.run.resident_push_wait_s + cfg.run.resident_answer_timeout_s)
        delta = cfg.run.weight_push == "delta" and not cfg.actor.lora.enabled and cfg.run.resident_layout != "colocated"
        self.shadow = Shadow() if delta else None  # each rank's part of the engine's copy of the last push

    @property
    def lm(self):
        return getattr(unwrap(self.model), self.role.inner)

    @op
    def score(self, state: Dict[str, Any], batch: str) -> Optional[Dict[str, Any]]:
        state, cfg, batch = PolicyState(**state), self.cfg, RolloutBatch.open(batch)
        self.held(state.iteration)  # the checks on every rank, before the forwards' collectives
        check_sampling_temperature(batch, cfg.rollout.temperature)
        faults.fail_on_rank("score", self.info.rank)
        actor = self.model if cfg.actor.old_logprobs == "recompute" else None
        forward = functools.partial(score_forward_ranks, info=self.info,  # each rank its share of the rows
                                    reward_model=self.reward_model)
        ref = self.ref if self.ref is not None else load_reference_ranks(cfg, self.run, self.info, self.model)
        try:
            if not self.info.is_main:  # as many forwards as rank 0; rank 0 gathers the results
                self.forward(lambda: forward(cfg, batch, actor, ref, None, self.pad))
                return None

            def values(scored: RolloutBatch):  # after the forwards: the critic service is called by rank 0 alone
                return service_values(critic_service(cfg, self.run), state)(scored)

            out = self.forward(lambda: run_score(cfg, self.run, state, batch,
                                                 Scorers(actor, ref, None, values if cfg.uses_critic else None,
                                                         self.rewards), forward=forward))
            return {"batch": out.batch.uri, "stats": out.stats}
        finally:
            if self.ref is None:  # run.resident_reference=reload: the update does not hold it
                del ref
                memory.release()

    @op
    def push(self, iteration: int) -> Dict[str, float]:
        """The weights held (those of ``iteration``) to the engine service again: a restarted engine's."""
        self.held(iteration)
        return self.send_weights(iteration, defer=False)

    def after_update(self, state: PolicyState) -> Dict[str, float]:
        return self.send_weights(state.iteration + 1, defer=self.cfg.run.pipelined)

    def send_weights(self, version: int, defer: bool) -> Dict[str, float]:
        """The weights held, as the actor of iteration ``version``, to the engine service in memory, with the probe
        the engine checks them against (a delta where the engine holds this trainer's last push); :class:`PushFailed`
        when the engine did not confirm them."""
        t0 = time.perf_counter()
        sequences, logprobs = reference_logprobs(unwrap(self.model), self.vocab)  # every rank: FSDP2
        args = {"version": version, "probe": {"sequences": sequences, "logprobs": logprobs},
                "tolerance": self.cfg.probe_tolerance, "defer": defer}
        engine = (lambda: run_service(self.cfg, self.run, ENGINE)) if self.info.is_main else None
        out = push_weights(self.transport, WeightSource(unwrap(self.model), self.info), engine, args, self.lm,
                           self.waiting, self.cfg.run.resident_push_wait_s, self.push_plan, self.shadow)
        return {**out, "time/weights_to_engine_s": time.perf_counter() - t0} if self.info.is_main else {}

    def push_plan(self, engine, version: int) -> Optional[Dict[str, Any]]:
        """Rank 0, ``run.weight_push=delta``: this push's id, its samples' seed, the push it is a delta against ("": a
        full push, when the engine holds no push this trainer confirmed: a new or restarted engine, one reloaded
        from a checkpoint, or one that cannot patch in place), and whether the ranks keep what they push (``keep``:
        not for an engine that cannot patch, vLLM on CPU, whose every push is full)."""
        if self.shadow is None:
            return None
        try:
            reply = engine.call("held_push")
        except ServiceError:  # an engine without the op, or gone: the push itself says what is wrong
            reply = {}
        held, patchable = str(reply.get("id", "")), bool(reply.get("patchable"))
        base = self.shadow.base if patchable and self.shadow.base and held == self.shadow.base else ""
        if not base and patchable:
            print(f"[push] the weights of iteration {version} go to the engine as a full push (the engine holds "
                  f"{'push ' + held if held else 'no push'} of this trainer's, which last confirmed "
                  f"{self.shadow.base or 'none'})", flush=True)
        return {"id": secrets.token_hex(8), "seed": secrets.randbelow(1 << 30), "base": base, "keep": patchable}

    def close(self) -> None:
        self.transport.close()


def push_weights(transport: Transport, source: WeightSource, engine: Optional[Callable[[], ServiceClient]],
                 args: Dict[str, Any], lm, waiting, wait_s: float,
                 plan_for: Optional[Callable[[ServiceClient, int], Optional[Dict[str, Any]]]] = None,
                 shadow: Optional[Shadow] = None) -> Dict[str, float]:
    """A push from every rank of a trainer: ``engine`` (rank 0: the engine service's client; the others: None). No
    rank enters a collective of the push (the gathers) before rank 0 knows the engine took it (at most ``wait_s``):
    meanwhile the others wait on rank 0 in ``waiting`` (:func:`~models.training.distributed.waiting_group`, a
    timeout of its own), and again while rank 0 waits for the engine's reply. With ``run.weight_push=delta``,
    ``plan_for`` (rank 0) says whether the push is a delta against ``shadow`` (each rank's part of the engine's copy),
    which every rank learns with the engine's readiness. :class:`PushFailed` on every rank when the engine did not
    confirm the weights; a delta then builds on no push until a full one is confirmed."""
    out, failed, client, plan = {}, "", None, None
    if engine is not None:
        try:
            client = engine()
            plan = plan_for(client, int(args["version"])) if plan_for is not None else None
            transport.ready(client, args, source, wait_s, plan)
        except Exception as err:  # noqa: BLE001 -- every rank learns it below; no gather began
            failed = _reason(err)
    plan, failed = from_main((plan, failed), waiting)  # every rank pushes alike: a delta, a full push, or none
    kept = shadow if plan is None or plan.get("keep", True) else None
    if shadow is not None and kept is None:  # the engine takes no delta: a copy kept would be memory for nothing
        shadow.tensors.clear()
        shadow.base = ""
    if not failed:
        if engine is None:
            transport.follow(source, plan, kept)  # every rank takes part in the gathers
        else:
            t1 = time.perf_counter()
            try:
                out = transport.send(client, args, lm, source, plan, kept)
                out["resident/push_s"] = time.perf_counter() - t1
            except Exception as err:  # noqa: BLE001 -- every rank learns it below, and keeps the weights
                failed = _reason(err)
        failed = from_main(failed, waiting)  # every rank keeps or drops the update alike
    if kept is not None:  # a delta builds only on a push the engine confirmed
        kept.base = "" if failed or plan is None else plan["id"]
    if failed:
        raise PushFailed(f"{failed} (the trainer keeps the weights: the same request sends them again)")
    return out


class CriticHost(TrainerHost):
    role = CRITIC

    @op
    def values(self, batch: str, iteration: int) -> Optional[list]:
        """The critic's values of ``batch``, flat in response order (each rank its share, rank 0 gathers)."""
        self.held(iteration)
        faults.fail_on_rank("values", self.info.rank)
        flat = self.forward(lambda: score_forward_ranks(self.cfg, RolloutBatch.open(batch), None, None, self.model,
                                                        self.pad, self.info))
        return flat["values"].tolist() if self.info.is_main else None
