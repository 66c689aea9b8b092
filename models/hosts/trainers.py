"""The trainer services of a resident run (``run.resident``): every rank of the actor's (the critic's) launch holds
its shard of the model and AdamW's state (a :class:`~models.stages.updates.Trainee`) and runs the stage functions
with them: ``update`` is :func:`~models.stages.updates.update_trainee` (a checkpoint every ``run.save_interval``;
the actor's new weights then go to the engine in memory), the actor's ``score`` :func:`~models.stages.score.run_score`
with π_old, π_ref (and the reward model) held here, the critic's ``values`` its share of the score's forward.
Each op names its iteration, refused by a service holding another; an ``update`` asked again for the iteration it
just did (a retried task whose reply was lost) returns that result instead of stepping twice.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Dict, Optional

import torch

from models.checkpoint.local import load_tokenizer
from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.hosts.engine import WrongIteration, check_iteration
from models.hosts.transports import transport_for
from models.run.types import PolicyState, RunHandle
from models.service.ops import Host, op
from models.stages.actor import ACTOR
from models.stages.critic import CRITIC
from models.stages.rewards import reward_source
from models.stages.score import Scorers, reference_scorer, run_score, service_values
from models.stages.score_ranks import load_reward_model_ranks, score_forward_ranks
from models.stages.services import ENGINE, LABELS, critic_service, run_service
from models.stages.updates import load_trainee, saves_at, update_trainee
from models.training.distributed import DistInfo, unwrap
from models.training.probe import reference_logprobs
from models.training.weight_source import WeightSource


class TrainerHost(Host):
    """What the actor and critic services share: the trainee, the iteration held, the last update's result."""

    role = ACTOR
    statuses = {WrongIteration: 409}

    def __init__(self, cfg: TrainConfig, run: RunHandle, state: PolicyState, info: DistInfo):
        self.cfg, self.run, self.info, self.version = cfg, run, info, state.iteration
        self.label = LABELS[self.role.name]
        self.trainee = load_trainee(self.role, cfg, state, info, {})
        self.model = self.trainee.model
        self.last: Optional[Dict[str, Any]] = None
        tokenizer = load_tokenizer(run.reference_url)
        self.pad, self.vocab = tokenizer.pad_token_id or 0, len(tokenizer)

    def held(self, iteration: int) -> None:
        check_iteration(self.label, self.version, iteration)

    @op
    def update(self, state: Dict[str, Any], batch: str) -> Dict[str, Any]:
        state = PolicyState(**state)
        if self.last is not None and state.iteration == self.version - 1 and self.last["iteration"] == state.iteration:
            return self.last["result"]  # the same request again: its reply was lost
        self.held(state.iteration)
        t0 = time.perf_counter()
        out = update_trainee(self.role, self.cfg, self.run, state, RolloutBatch.open(batch), self.info, self.trainee,
                             saves_at(self.cfg, state.iteration), {})
        self.version = state.iteration + 1
        stats = {**out.stats, **self.after_update(state)}
        result = {"checkpoint_url": out.checkpoint_url,
                  "stats": {**stats, f"time/{self.role.name}_update_s": time.perf_counter() - t0}}
        self.last = {"iteration": state.iteration, "result": result}
        return result

    def after_update(self, state: PolicyState) -> Dict[str, float]:
        return {}

    def forward(self, fn):
        """``fn()`` with the model in eval mode, no gradients (every rank: FSDP2 forwards are collective)."""
        self.model.eval()
        try:
            with torch.no_grad():
                return fn()
        finally:
            self.model.train()


class ActorHost(TrainerHost):
    """Also π_ref (the reference, or with LoRA the trained model with its adapter off) and, with
    ``reward.source=model``, the reward model: sharded on the ranks as the stateless ``score_ranks`` holds it
    (one rank: whole, the one-process score's reward source)."""

    role = ACTOR

    def __init__(self, cfg: TrainConfig, run: RunHandle, state: PolicyState, info: DistInfo):
        super().__init__(cfg, run, state, info)
        self.ref = reference_scorer(cfg, run, self.model, self.lm)
        self.reward_model = load_reward_model_ranks(cfg, run, info) if info.world_size > 1 else None
        self.rewards = reward_source(cfg, run) if cfg.reward.source == "model" and info.world_size == 1 else None
        self.transport = transport_for(cfg, run.reference_url)  # rank 0's end, kept between pushes

    @property
    def lm(self):
        return getattr(unwrap(self.model), self.role.inner)

    @op
    def score(self, state: Dict[str, Any], batch: str) -> Optional[Dict[str, Any]]:
        state, cfg, batch = PolicyState(**state), self.cfg, RolloutBatch.open(batch)
        self.held(state.iteration)
        actor = self.model if cfg.actor.old_logprobs == "recompute" else None
        forward = functools.partial(score_forward_ranks, info=self.info,  # each rank its share of the rows
                                    reward_model=self.reward_model)
        if not self.info.is_main:  # as many forwards as rank 0; rank 0 gathers the results
            self.forward(lambda: forward(cfg, batch, actor, self.ref, None, self.pad))
            return None
        values = service_values(critic_service(cfg, self.run), state) if cfg.uses_critic else None
        out = self.forward(lambda: run_score(cfg, self.run, state, batch, Scorers(actor, self.ref, None, values,
                                                                                  self.rewards), forward=forward))
        return {"batch": out.batch.uri, "stats": out.stats}

    def after_update(self, state: PolicyState) -> Dict[str, float]:
        """The new weights to the engine service, in memory, with the probe the engine checks them against."""
        t0 = time.perf_counter()
        sequences, logprobs = reference_logprobs(unwrap(self.model), self.vocab)  # every rank: FSDP2
        source = WeightSource(unwrap(self.model), self.info)  # gathered tensor by tensor as the push sends them
        if not self.info.is_main:
            self.transport.follow(source)  # every rank takes part in the gathers
            return {}
        args = {"version": state.iteration + 1, "probe": {"sequences": sequences, "logprobs": logprobs},
                "tolerance": self.cfg.probe_tolerance, "defer": bool(self.cfg.run.off_policy_steps)}
        out = self.transport.send(run_service(self.cfg, self.run, ENGINE), args, self.lm, source)
        return {**out, "time/weights_to_engine_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.transport.close()


class CriticHost(TrainerHost):
    role = CRITIC

    @op
    def values(self, batch: str, iteration: int) -> Optional[list]:
        """The critic's values of ``batch``, flat in response order (each rank its share, rank 0 gathers)."""
        self.held(iteration)
        flat = self.forward(lambda: score_forward_ranks(self.cfg, RolloutBatch.open(batch), None, None, self.model,
                                                        self.pad, self.info))
        return flat["values"].tolist() if self.info.is_main else None
