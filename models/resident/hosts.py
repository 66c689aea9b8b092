"""What each resident service holds and does (``run.resident``): the stage functions of
:mod:`models.stages` with the service's own models instead of models loaded from storage, so a stage is
the same code whether a task or a service runs it.

- :class:`EngineHost`: the generation engine (vLLM or HF), started once from the state's actor;
  ``rollout`` and ``evaluate``; ``weights``: new actor weights from the actor trainer, in memory, checked
  with the probe against the trainer's own forward before it serves them.
- :class:`ActorHost`: every rank of the actor's launch holds its (FSDP2) shard, AdamW's state and π_ref;
  ``score`` (π_old and π_ref by the trainer's ranks, the critic's values from the critic service, the
  rewards) and ``update`` (the step, a checkpoint every ``run.save_interval``, the weights to the engine).
- :class:`CriticHost`: the critic's ranks; ``values`` and ``update``.

Each op names the iteration it is for (``state.iteration``); a service that holds another iteration's
policy refuses it, so a task never runs against the wrong weights. An ``update`` asked again for the
iteration it just did (a retried task whose reply was lost) returns that result instead of stepping twice.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch

from models.checkpoint.local import load_tokenizer
from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.resident import protocol
from models.run.types import PolicyState, RunHandle
from models.stages import actor as actor_stage
from models.stages import critic as critic_stage
from models.stages.evaluate import run_evaluate
from models.stages.rollout import run_rollout
from models.stages.score import Scorers, run_score
from models.stages.rewards import reward_source
from models.stages.score_ranks import load_reward_model_ranks, score_forward_ranks
from models.stages.updates import load_trainee, saves_at, update_trainee
from models.training.distributed import DistInfo, full_state_dict, unwrap
from models.training.probe import reference_logprobs


class WrongIteration(RuntimeError):
    """The request is for another iteration than the one the service's policy is at."""


def _check_iteration(name: str, holds: int, state: PolicyState) -> None:
    if holds < 0:
        raise WrongIteration(f"{protocol.SERVICE_LABELS[name]} serves no policy: its last weight update failed "
                             f"(see the actor update's error); rerun the launch to resume from the last checkpoint")
    if state.iteration != holds:
        raise WrongIteration(f"{protocol.SERVICE_LABELS[name]} holds the policy of iteration {holds}, but the request "
                             f"is for iteration {state.iteration}: the run's services and its resume point disagree "
                             f"(rerun the launch to restart them from the last checkpoint)")


class EngineHost:
    """The engine service's state: one engine serving the actor of iteration ``version``, and with
    ``run.off_policy_steps=1`` the next actor's weights kept until a request asks for that actor
    (``pending``): the batch after an update is still sampled from the actor before it."""

    def __init__(self, cfg: TrainConfig, run: RunHandle, state: PolicyState, info: DistInfo):
        from models.resident.channel import WeightReceiver
        from models.stages.engine import engine_for

        self.lora_mode, self.dtype = cfg.rollout.lora_mode, cfg.model.dtype
        self.adapter_folder = ""
        self.channel = WeightReceiver()
        self.pending: Dict[int, Any] = {}
        if state.behaviour_url:  # resumed off-policy: the next batch comes from the actor before the state's
            self.engine = engine_for(cfg, state.behaviour_url)
            self.version = state.iteration - 1
            self.pending[state.iteration] = lambda: setattr(self, "engine", engine_for(cfg, state.actor_url))
        else:
            self.engine = engine_for(cfg, state.actor_url)  # from the checkpoint, probed as a task's engine is
            self.version = state.iteration

    def serve(self, version: int, state: PolicyState) -> None:
        """Serve the actor of iteration ``version``: the one held, or the next one kept pending."""
        if version != self.version and version in self.pending:
            apply = self.pending.pop(version)
            self.version = -1  # until the new weights are in and verified
            apply()
            self.version = version
        _check_iteration(protocol.ENGINE, self.version, state)

    def handle(self, op: str, args: Dict[str, Any], body: Optional[bytes]) -> Any:
        if op == "channel":  # the actor trainer opens the collective weight channel
            return self.channel.open(args)
        if op == "weights":
            if args.get("defer"):  # off-policy: loaded when a request asks for this actor
                self.pending[int(args["version"])] = self.incoming(args, body)
                return {}
            self.version = -1  # until the new weights are in and verified, the engine serves no iteration
            return self.incoming(args, body)()
        cfg, run, state = protocol.read_args(args)
        self.serve(state.iteration, state)
        if op == "rollout":
            out = run_rollout(cfg, run, state, int(args.get("ahead", 0)), engine=self.engine)
            return {"batch": out.batch.uri, "stats": out.stats}
        if op == "evaluate":
            return run_evaluate(cfg, run, state, engine=self.engine)
        raise ValueError(f"the engine service has no op {op!r}")

    def incoming(self, args: Dict[str, Any], body: Optional[bytes]) -> Callable[[], Dict[str, float]]:
        """New weights from the actor trainer, in memory: received now (over the collective channel, or
        ``body``), loaded by the function returned (:meth:`load`)."""
        from models.engines.weights import unpack_weights

        if "adapter_config" in args:  # LoRA: the adapter alone
            return lambda: self.load(args, lambda: self.load_adapter(args["adapter_config"], body))
        if args.get("transport") == "collective":
            state = self.channel.receive(args)
            return lambda: self.load(args, lambda: self.engine.load_tensors(state))
        return lambda: self.load(args, lambda: self.engine.load_tensors(unpack_weights(body)))

    def load(self, args: Dict[str, Any], put: Callable[[], None]) -> Dict[str, float]:
        """``put()`` the new weights into the engine, then the probe against the trainer's forward."""
        from models.training.probe import verify_reference

        t0 = time.perf_counter()
        self.version = -1  # until the new weights are in and verified, the engine serves no iteration
        put()
        probe = args["probe"]
        result = verify_reference(self.engine, probe["sequences"], probe["logprobs"], float(args["tolerance"]),
                                  f"the actor of iteration {args['version']} (in memory)")
        self.version = int(args["version"])
        return {"rollout/probe_gap_max": result.gap_max if result is not None else 0.0,
                "time/weights_load_s": time.perf_counter() - t0}

    def load_adapter(self, config: Dict[str, Any], blob: bytes) -> None:
        """A LoRA adapter (its safetensors file and config) on the engine's base: served as an adapter, or
        merged into the base (``rollout.lora_mode``), from a folder of this process, as a rollout task does."""
        import json
        import os
        import shutil
        import tempfile

        from models.checkpoint.local import local_checkpoint
        from models.training.files import ADAPTER_CONFIG
        from models.training.merge import merged_copy

        folder = tempfile.mkdtemp(prefix="adapter-in-memory-")
        with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
            f.write(blob)
        with open(os.path.join(folder, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f)
        if self.lora_mode == "merged":
            self.engine.load_weights(merged_copy(folder, local_checkpoint, getattr(torch, self.dtype)))
        else:
            self.engine.set_adapter(folder)
        if self.adapter_folder:
            shutil.rmtree(self.adapter_folder, ignore_errors=True)
        self.adapter_folder = folder


class _TrainerHost:
    """What the actor and critic services share: the model and AdamW on every rank (the update stage's
    :class:`~models.stages.updates.Trainee`), the iteration held, the last update's result (a retried request
    gets it again)."""

    role = actor_stage.ACTOR

    def __init__(self, cfg: TrainConfig, run: RunHandle, state: PolicyState, info: DistInfo):
        self.info, self.version = info, state.iteration
        self.trainee = load_trainee(self.role, cfg, state, info, {})
        self.model = self.trainee.model
        self.last: Optional[Dict[str, Any]] = None
        self.tokenizer = load_tokenizer(run.reference_url)

    @property
    def name(self) -> str:
        return self.role.name

    def _pad(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def update(self, args: Dict[str, Any]) -> Dict[str, Any]:
        cfg, run, state = protocol.read_args(args)
        if self.last is not None and state.iteration == self.version - 1 and self.last["iteration"] == state.iteration:
            return self.last["result"]  # the same request again: its reply was lost
        _check_iteration(self.name, self.version, state)
        t0 = time.perf_counter()
        out = update_trainee(self.role, cfg, run, state, RolloutBatch.open(args["batch"]), self.info, self.trainee,
                             saves_at(cfg, state.iteration), {})
        self.version = state.iteration + 1
        extra = self.after_update(cfg, run, state)
        result = {"checkpoint_url": out.checkpoint_url, "stats": {**out.stats, **extra,
                                                                 f"time/{self.name}_update_s": time.perf_counter() - t0}}
        self.last = {"iteration": state.iteration, "result": result}
        return result

    def after_update(self, cfg, run, state) -> Dict[str, float]:
        return {}

    def forward(self, fn):
        """``fn()`` with the model in eval mode, no gradients (every rank: FSDP2 forwards are collective)."""
        self.model.eval()
        try:
            with torch.no_grad():
                return fn()
        finally:
            self.model.train()


class ActorHost(_TrainerHost):
    role = actor_stage.ACTOR

    def __init__(self, cfg: TrainConfig, run: RunHandle, state: PolicyState, info: DistInfo):
        super().__init__(cfg, run, state, info)
        from transformers import AutoModelForCausalLM

        from models.resident.channel import WeightSender
        from models.training.load import load_hf
        from models.training.lora import without_adapter
        from models.training.policy import PolicyLogprobs, with_packing

        self.channel = WeightSender()  # rank 0's end of the weight channel to the engine, formed at the first push
        if cfg.actor.lora.enabled:  # π_ref = the trained model with its adapter off, as score does it
            self.ref = without_adapter(self.model, self.lm)
        else:
            self.ref = with_packing(PolicyLogprobs(load_hf(run.reference_url, AutoModelForCausalLM,
                                                           cfg.model.dtype)).eval(), cfg.model.pack_sequences)
        # reward.source=model: the reward model stays loaded too, sharded on the ranks as the stateless
        # score_ranks holds it (one rank: whole, the one-process score's reward source)
        self.reward_model = load_reward_model_ranks(cfg, run, info) if info.world_size > 1 else None
        self.rewards = reward_source(cfg, run) if cfg.reward.source == "model" and info.world_size == 1 else None

    @property
    def lm(self):
        return getattr(unwrap(self.model), self.role.inner)

    def handle(self, op: str, args: Dict[str, Any], body: Optional[bytes]) -> Any:
        if op == "score":
            return self.score(args)
        if op == "update":
            return self.update(args)
        raise ValueError(f"the actor trainer service has no op {op!r}")

    def score(self, args: Dict[str, Any]) -> Any:
        cfg, run, state = protocol.read_args(args)
        _check_iteration(self.name, self.version, state)
        batch = RolloutBatch.open(args["batch"])
        actor = self.model if cfg.actor.old_logprobs == "recompute" else None
        forward = functools.partial(score_forward_ranks, info=self.info,  # each rank its share of the rows
                                    reward_model=self.reward_model)
        if not self.info.is_main:  # as many forwards as rank 0; rank 0 gathers the results
            self.forward(lambda: forward(cfg, batch, actor, self.ref, None, self._pad()))
            return None
        values = (lambda b: critic_values(run, cfg, state, b)) if cfg.uses_critic else None
        scorers = Scorers(actor, self.ref, None, values, self.rewards)
        out = self.forward(lambda: run_score(cfg, run, state, batch, scorers, forward=forward))
        return {"batch": out.batch.uri, "stats": out.stats}

    def after_update(self, cfg, run, state) -> Dict[str, float]:
        """The new weights to the engine service, in memory (:mod:`models.resident.channel`)."""
        from models.engines.weights import pack_weights
        from models.resident.channel import http_push

        t0 = time.perf_counter()
        full = full_state_dict(self.model)  # collective under FSDP2
        sequences, logprobs = reference_logprobs(unwrap(self.model), len(self.tokenizer))  # every rank: FSDP2
        probe = {"sequences": sequences, "logprobs": logprobs}
        if not self.info.is_main:
            return {}
        weights = {k[len("lm."):]: v for k, v in full.items() if k.startswith("lm.")} if full is not None \
            else None
        args = {"version": state.iteration + 1, "probe": probe, "tolerance": cfg.probe_tolerance,
                "defer": bool(cfg.run.off_policy_steps)}
        engine = protocol.find(run.layout, protocol.ENGINE)
        if cfg.actor.lora.enabled:  # the adapter alone, as its checkpoint holds it (over HTTP: a few MB)
            config, body = adapter_files(self.lm, weights, self.trainee.url)
            out = http_push(engine, {**args, "adapter_config": config}, body)
        else:
            weights = weights if weights is not None else self.lm.state_dict()
            out = http_push(engine, args, pack_weights(weights)) if cfg.run.resident_weight_transport == "http" \
                else self.channel.push(engine, args, weights)
        return {**out, "time/weights_to_engine_s": time.perf_counter() - t0}


class CriticHost(_TrainerHost):
    role = critic_stage.CRITIC

    def handle(self, op: str, args: Dict[str, Any], body: Optional[bytes]) -> Any:
        if op == "values":
            return self.values(args)
        if op == "update":
            return self.update(args)
        raise ValueError(f"the critic trainer service has no op {op!r}")

    def values(self, args: Dict[str, Any]) -> Optional[list]:
        cfg, run, state = protocol.read_args(args)
        _check_iteration(self.name, self.version, state)
        batch = RolloutBatch.open(args["batch"])
        pad = self._pad()
        flat = self.forward(lambda: score_forward_ranks(cfg, batch, None, None, self.model, pad, self.info))
        return flat["values"].tolist() if self.info.is_main else None  # each rank its share, rank 0 gathers



def adapter_files(lm, state_dict, from_url: str):
    """``(adapter_config, adapter_model.safetensors bytes)`` of peft model ``lm`` as its checkpoint would
    hold them (``save_pretrained``; ``state_dict``: the gathered weights under FSDP2), its base the one of
    ``from_url``. Written in a folder of this process and read back: never the run's storage."""
    import json
    import os
    import tempfile

    from models.training.files import ADAPTER_CONFIG
    from models.training.load import base_checkpoint_url
    from models.training.lora import canonical_url

    with tempfile.TemporaryDirectory(prefix="adapter-out-") as tmp:
        lm.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False,
                           **({"state_dict": state_dict} if state_dict is not None else {}))
        with open(os.path.join(tmp, ADAPTER_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
        with open(os.path.join(tmp, "adapter_model.safetensors"), "rb") as f:
            blob = f.read()
    config["base_model_name_or_path"] = canonical_url(base_checkpoint_url(from_url))
    return config, blob


def critic_values(run: RunHandle, cfg: TrainConfig, state: PolicyState, batch: RolloutBatch) -> np.ndarray:
    """The critic service's values of ``batch``, flat in response order."""
    values = protocol.call_service(run.layout, protocol.CRITIC, "values",
                                   protocol.request_args(cfg, run, state, batch.uri))
    return np.asarray(values, np.float32)


HOSTS = {protocol.ENGINE: EngineHost, protocol.ACTOR: ActorHost, protocol.CRITIC: CriticHost}
