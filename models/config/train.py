"""``TrainConfig``: every section of one run, and the checks that span sections.

Each section is a frozen dataclass in its own module (``run.py``, ``model.py``, ``data.py``, ``rollout.py``,
``reward.py``, ``kl.py`` with ``advantage``, ``actor.py`` with ``lora`` and ``guard``, ``critic.py``,
``resources.py``) that checks its own fields; what depends on several sections is checked here, and what
depends on the algorithm (the KL a run uses) is computed here, never written back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from models import algorithms
from models.algorithms import AlgorithmSpec
from models.algorithms.checks import ignored_options
from models.config.actor import ActorConfig
from models.config.checks import check
from models.config.critic import CriticConfig
from models.config.data import DataConfig
from models.config.engine_limits import VLLM_MAX_LORA_RANK
from models.config.kl import DEFAULT_KL_ESTIMATOR, AdvantageConfig, KLConfig
from models.config.model import ModelConfig
from models.config.resources import ResourcesConfig
from models.config.reward import RewardConfig
from models.config.rollout import RolloutConfig
from models.config.run import RunConfig
from models.training.probe import effective_tolerance


@dataclass(frozen=True, eq=False)
class TrainConfig:
    """Everything one training run needs."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)

    def __post_init__(self) -> None:
        check(self.data.source != "reasoning_gym" or self.reward.source != "function" or bool(self.reward.specs),
              "data.source=reasoning_gym names no reward function to score its prompts: set "
              "reward.function=models.data.reasoning_gym:reasoning_gym_reward (the task's own verifier)")
        spec = self.spec
        n = self.rollout.n_samples_per_prompt
        if spec.needs_groups:
            check(n >= 2, f"run.algorithm={spec.name} needs a group baseline: "
                          f"rollout.n_samples_per_prompt must be >= 2 (got {n})")
        ignored = ignored_options(self)
        check(not ignored, ignored[0] if ignored else "")
        self._check_kl()
        self._check_rlvr()
        self._check_episodes()
        self._check_off_policy()
        self._check_engine()
        self._check_batches()
        self._check_resident()

    def _check_resident(self) -> None:
        """What the resident services (``run.resident``) serve in this version: the services the run starts
        itself (a local run's on one node: ``models.stages.prepare``)."""
        if not self.run.resident:
            return
        for name, value, why in (
                ("rollout.remote_url", self.rollout.remote_url, "the run starts its own engine service"),
                ("critic.remote_url", self.critic.remote_url, "the run starts its own critic service")):
            check(not value, f"run.resident=true does not support {name} (got {value!r}): {why}. Use the "
                             f"stateless mode (run.resident=false) for it")
        if self.run.resident_layout == "colocated":
            r, ranks = self.rollout, self.actor.nnodes * self.actor.nproc_per_node
            check(ranks % r.tensor_parallel_size == 0,  # engine groups of tp consecutive ranks
                  f"run.resident_layout=colocated makes engines of rollout.tensor_parallel_size="
                  f"{r.tensor_parallel_size} ranks each out of the actor's {ranks} (actor.nnodes x "
                  f"actor.nproc_per_node): it must divide them")
            check(r.data_parallel_size == 1,
                  f"run.resident_layout=colocated: the actor's ranks are the engine replicas; "
                  f"rollout.data_parallel_size={r.data_parallel_size} must be 1")
            check(r.episode_pace != "episode",
                  "rollout.episode_pace=episode with run.resident_layout=colocated: the actor's ranks sample their "
                  "shares of each turn together (lockstep); use rollout.episode_pace=auto or lockstep")

    def _check_engine(self) -> None:
        """The rollout engine against the actor's adapters and where π_old comes from."""
        a = self.actor
        if a.lora.enabled and self.rollout.lora_mode == "adapter" and self.rollout.engine == "vllm":
            check(a.lora.rank <= VLLM_MAX_LORA_RANK,
                  f"actor.lora.rank={a.lora.rank}: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANK}; "
                  f"use rollout.lora_mode=merged")
        if a.old_logprobs == "sampler":
            r = self.rollout
            engine_dtype = r.vllm_dtype if r.engine == "vllm" else self.model.dtype
            check(not r.remote_url and engine_dtype == self.model.dtype == "float32",
                  f"actor.old_logprobs=sampler takes π_old from the rollout engine, so the engine must compute "
                  f"like the trainer: model.dtype and the engine's dtype float32 and no rollout.remote_url "
                  f"(got model.dtype={self.model.dtype}, engine {r.engine} in {engine_dtype}"
                  f"{', remote ' + r.remote_url if r.remote_url else ''}); bf16 samplers differ from an fp32 "
                  f"trainer by up to 0.4 nats/token: use actor.old_logprobs=recompute")

        if a.old_logprobs == "update":
            batch = self.rollout.samples_per_iteration
            check(a.ppo_epochs == 1 and a.minibatch_size >= batch,
                  f"actor.old_logprobs=update takes π_old from the update's own forward, which is π_old only before "
                  f"the batch's first optimizer step: it needs one step a batch, actor.ppo_epochs=1 and "
                  f"actor.minibatch_size >= the batch's {batch} rows (got ppo_epochs={a.ppo_epochs}, "
                  f"minibatch_size={a.minibatch_size}); use actor.old_logprobs=recompute")
            check(self.kl_placement != "reward",
                  "actor.old_logprobs=update with kl.placement=reward: the reward's KL needs π_old before the update; "
                  "use kl.placement=loss or actor.old_logprobs=recompute")

        r, gpus = self.rollout, self.resources.rollout_gpu
        tp, dp = r.tensor_parallel_size, r.data_parallel_size
        check(gpus == 0 or tp * dp <= gpus,
              f"rollout.tensor_parallel_size={tp} x rollout.data_parallel_size={dp} splits the engine over {tp * dp} "
              f"GPUs, but the rollout task has resources.rollout_gpu={gpus}: set resources.rollout_gpu={tp * dp}")

    def _check_batches(self) -> None:
        """GPUs per actor and critic node, and the batch split into minibatches and micro-batches on every rank."""
        batch = self.rollout.samples_per_iteration
        a = self.actor
        check(self.resources.actor_gpu in (0, a.nproc_per_node),
              f"resources.actor_gpu={self.resources.actor_gpu} must be 0 (CPU) or actor.nproc_per_node="
              f"{a.nproc_per_node} (one GPU per process)")
        check(not a.score_on_ranks or self.resources.score_gpu in (0, a.nproc_per_node),
              f"actor.score_on_ranks runs score on actor.nproc_per_node={a.nproc_per_node} processes a node: "
              f"resources.score_gpu={self.resources.score_gpu} must be 0 (CPU) or {a.nproc_per_node}")
        check(a.minibatch_size % (a.micro_batch_size * a.world_size) == 0,
              f"actor.minibatch_size={a.minibatch_size} must be divisible by actor.micro_batch_size "
              f"× ranks = {a.micro_batch_size} × {a.world_size}")
        check(batch % a.minibatch_size == 0,
              f"the batch (rollout.prompts_per_iteration × rollout.n_samples_per_prompt = {batch}) "
              f"must be divisible by actor.minibatch_size={a.minibatch_size}")
        if self.uses_critic:
            c = self.critic
            check(self.resources.critic_gpu in (0, c.nproc_per_node),
                  f"resources.critic_gpu={self.resources.critic_gpu} must be 0 (CPU) or critic.nproc_per_node="
                  f"{c.nproc_per_node} (one GPU per process)")
            ranks = f" × ranks = {c.micro_batch_size} × {c.world_size}" if c.world_size > 1 else \
                f"={c.micro_batch_size}"
            check(c.minibatch_size % (c.micro_batch_size * c.world_size) == 0,
                  f"critic.minibatch_size={c.minibatch_size} must be divisible by critic.micro_batch_size{ranks}")
            check(batch % c.minibatch_size == 0,
                  f"the batch ({batch} samples) must be divisible by critic.minibatch_size={c.minibatch_size}")

    def _check_kl(self) -> None:
        """The KL the run uses, as :attr:`kl_placement` and :attr:`kl_estimator` compute it."""
        check(not (self.kl_placement == "loss" and self.kl_estimator == "k1"),
              "kl.estimator=k1 with kl.placement=loss: the gradient of k1 = log π − log π_ref is ∇log π, whose "
              "expectation under π is 0, so it would not pull towards the reference; use k3 (or k2) in the loss, "
              "or kl.placement=reward")

    def _check_rlvr(self) -> None:
        """The RLVR options against the rest of the config (docs/rlvr/)."""
        a, budget = self.advantage, self.rollout.max_new_tokens
        check(a.overlong_buffer <= budget,
              f"advantage.overlong_buffer={a.overlong_buffer} must be <= rollout.max_new_tokens={budget} "
              f"(the buffer is the last tokens of the budget)")
        check(not (self.actor.tis_cap and self.actor.old_logprobs == "sampler"),
              "actor.tis_cap with actor.old_logprobs=sampler: π_old is then the sampler's own log-probs, so the "
              "truncated IS weight min(π_old/π_sampler, C) is always 1; use actor.old_logprobs=recompute")

    def _check_episodes(self) -> None:
        """Multi-turn episodes (``rollout.environment``) against the rest of the config (docs/multi_turn.md)."""
        if not self.rollout.environment:
            return
        check(not self.data.uses_chat_template,
              "rollout.environment writes the messages the chat template renders: turn data.apply_chat_template "
              "and data.messages_column off (the environment gets each row's columns and its plain 'prompt')")
        check(not (self.uses_critic and self.critic.remote_url),
              "rollout.environment with critic.remote_url: the critic server's train op uses no loss_mask, so it "
              "would regress values on tool and template tokens; use the critic inside the workflow")

    def _check_off_policy(self) -> None:
        """What a stale sampler needs, k = ``run.max_staleness`` ≥ 1 (docs/off_policy.md)."""
        k = self.run.staleness
        check(not self.run.partial_rollouts or k >= 2,
              f"run.partial_rollouts with run.max_staleness={k}: partial rollouts need asynchronous training "
              f"(run.max_staleness >= 2), where new weights may arrive while the engine generates")
        check(self.run.stale_samples == "drop" or k >= 2 and self.actor.tis_cap > 0,
              f"run.stale_samples={self.run.stale_samples} with run.max_staleness={k} and actor.tis_cap="
              f"{self.actor.tis_cap}: samples staler than k are trained with the truncated importance weight "
              f"min(π_old/π_sampler, C) against their per-token behaviour log-probs, so it needs asynchronous "
              f"training (run.max_staleness >= 2) and actor.tis_cap > 0 (e.g. 2)")
        if not k:
            return
        name = "run.off_policy_steps=1" if self.run.off_policy_steps else f"run.max_staleness={k}"
        check(self.actor.old_logprobs == "recompute",
              f"{name} with actor.old_logprobs={self.actor.old_logprobs}: the batch comes from an actor older than "
              f"the one the update starts from, so π_old (the proximal policy the ratio is clipped around) is the "
              f"trainer's own forward in score; use actor.old_logprobs=recompute")
        check(self.actor.tis_cap > 0,
              f"{name} needs actor.tis_cap > 0 (e.g. 2): the truncated weight "
              f"min(π_old/π_sampler, C) is what corrects the loss for the stale sampler")
        check(not self.rollout.remote_url,
              f"{name} with rollout.remote_url={self.rollout.remote_url}: the rollout of iteration "
              f"k+1 and the evaluation of iteration k run at once from different actors, and a rollout server "
              f"holds one policy at a time; use the in-pod engine (no rollout.remote_url)")
        if k >= 2:  # the engine service's producer (models/hosts/producer.py)
            check(not (self.rollout.environment and self.run.partial_rollouts),
                  f"{name} with rollout.environment and run.partial_rollouts: an episode is sampled whole by one "
                  f"policy version (a push waits for the episodes under way); turn run.partial_rollouts off")
            check(not self.actor.lora.rank, f"{name} with actor.lora.rank: asynchronous training pushes full "
                  f"weights only; use run.max_staleness 0 or 1 with LoRA")
            check(self.rollout.data_parallel_size == 1, f"{name} with rollout.data_parallel_size="
                  f"{self.rollout.data_parallel_size}: the engine service's producer samples with one engine")

    @property
    def spec(self) -> AlgorithmSpec:
        """The declaration of ``run.algorithm`` (``models/algorithms/``)."""
        return algorithms.get(self.run.algorithm)

    @property
    def kl_placement(self) -> str:
        """Where the KL to the reference goes (``reward`` or ``loss``): ``kl.placement``, or the algorithm's
        own when it is empty (``models/algorithms/``)."""
        return self.kl.placement or self.spec.kl_placement

    @property
    def kl_estimator(self) -> str:
        """The per-token KL estimator: ``kl.estimator``, or when it is empty the one of :attr:`kl_placement`
        (k1 in the reward, k3 in the loss: :data:`models.config.kl.DEFAULT_KL_ESTIMATOR`)."""
        return self.kl.estimator or DEFAULT_KL_ESTIMATOR[self.kl_placement]

    @property
    def effective_kl(self) -> KLConfig:
        """``kl`` with :attr:`kl_placement` and :attr:`kl_estimator` filled in: what the run uses, and what a
        stored config records (:func:`models.config.io.to_dict`)."""
        return dataclasses.replace(self.kl, placement=self.kl_placement, estimator=self.kl_estimator)

    def __eq__(self, other: object) -> bool:
        """Equal when every section is, ``kl`` compared as the run uses it: an empty ``kl.placement`` or
        ``kl.estimator`` equals the value it stands for (so a stored config, which records that value,
        reads back equal to the one it was written from)."""
        if not isinstance(other, TrainConfig):
            return NotImplemented
        return self._compared() == other._compared()

    __hash__ = None  # type: ignore[assignment]  # as before: its lists make it unhashable

    def _compared(self) -> tuple:
        return tuple(self.effective_kl if f.name == "kl" else getattr(self, f.name)
                     for f in dataclasses.fields(self))

    @property
    def uses_critic(self) -> bool:
        return self.spec.uses_critic

    @property
    def engine_context(self) -> int:
        """The longest sequence the run can produce, the engine's ``max_model_len`` (capped at the checkpoint's
        ``max_position_embeddings``, whose room every prompt is checked against at set-up): a prompt of
        ``data.max_prompt_tokens`` and what follows it, ``rollout.max_new_tokens`` or, with ``rollout.environment``,
        ``rollout.max_episode_tokens`` (every sampled, tool and user token after the first prompt)."""
        r = self.rollout
        return self.data.max_prompt_tokens + (r.max_episode_tokens if r.environment else r.max_new_tokens)

    @property
    def engine_dtype(self) -> str:
        """The dtype the generation engine holds its weights in: ``rollout.vllm_dtype`` for vLLM, ``model.dtype`` for
        the HF engine (what a resident run's trainer casts its weights to before it sends them)."""
        return self.rollout.vllm_dtype if self.rollout.engine == "vllm" else self.model.dtype

    @property
    def probe_tolerance(self) -> float:
        """``rollout.probe_tolerance``, raised to ``models.training.probe.LOW_PRECISION_PROBE_TOLERANCE`` unless the engine
        and the trainer (``model.dtype``) both compute in float32; 0 stays 0 (off)."""
        return effective_tolerance(self.rollout.probe_tolerance, self.engine_dtype, self.model.dtype)
