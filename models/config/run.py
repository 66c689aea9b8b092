"""The ``run`` section: where a run lives, how long it is, how often it evaluates and saves."""

from __future__ import annotations

import re
from dataclasses import dataclass

from models import algorithms
from models.config.checks import check, check_choice


REGISTERED_NAME_FORBIDDEN = "/:%"
"""Characters MLflow refuses in a registered model name (``mlflow.utils.validation._validate_model_name``:
``/`` and ``:``; its file store also ``%``)."""


def _check_registered_model_name(name: str) -> None:
    """MLflow's rules for a registered model name, checked before training rather than by the
    registration at the run's end: not blank, none of :data:`REGISTERED_NAME_FORBIDDEN`, and not a
    name a path would resolve elsewhere (``.``, ``..x``)."""
    if not name:
        return
    bad = sorted(set(name) & set(REGISTERED_NAME_FORBIDDEN))
    why = ("it is blank" if not name.strip() else f"it may not contain {' or '.join(map(repr, bad))}" if bad
           else "a path would resolve it to another name" if name == "." or name.startswith("..") else "")
    fix = re.sub(f"[{re.escape(REGISTERED_NAME_FORBIDDEN)}]+", "-", name).strip(" -.") or "my-policy"
    check(not why, f"run.registered_model_name={name!r} is not a name the MLflow Model Registry accepts ({why}): "
                   f"e.g. {fix!r}, or empty to log the final policy without registering it")


MAX_ITERATIONS_PER_EXECUTION = 1000
"""About 440 KB of an execution's record (propeller's ``FlyteWorkflow`` object), a third of etcd's default limit."""
MAX_CHUNKS_PER_EXECUTION = 250
"""About 1 MB of an execution's ``futures.pb`` (4 KB per chunk node of the 8B preset, measured by
``tests/unit/tasks/test_long_runs.py``), half of propeller's default download limit."""


@dataclass(frozen=True)
class RunConfig:
    """The run: where it lives, how long it is, how often it evaluates and saves. The user's settings
    (the ``run:`` section of a preset); what a run *is* on storage is :class:`models.run.layout.RunLayout`."""

    name: str = ""
    """Run name (the prefix under ``storage_root``). Empty: ``{algorithm}-{date}-{time}``."""
    storage_root: str = "runs"
    """fsspec URL that holds runs (local folder by default, ``s3://bucket/prefix`` on a cluster)."""
    num_iterations: int = 10
    """Training iterations."""
    eval_interval: int = 5
    """Evaluate on held-out prompts every this many iterations (and after the last); 0: never."""
    eval_before_training: bool = False
    """Also evaluate the starting policy, before the first update (logged at step -1), so the run's own
    curve shows what training added (veRL's ``val_before_train``, TRL's ``eval_on_start``). Needs
    ``eval_interval`` > 0."""
    save_interval: int = 5
    """Keep the checkpoints of every this-many-th iteration (the last is always kept)."""
    keep_checkpoints: int = -1
    """How many of the checkpoints kept at ``save_interval`` survive: the newest this many, besides what a
    resume needs (the checkpoints ``state.json`` names: the resume point's, and with ``off_policy_steps=1`` the
    behaviour actor's, one iteration older) and every final policy's (the last iteration's when it committed:
    the policy a finished run registers). An older one is deleted with its optimizer state and its MLflow
    copy (``checkpoints/iter-*``) by the commit that drops it. -1: all (none deleted); 0: only those
    (docs/concepts/run_layout.md#retention)."""
    keep_batches: int = -1
    """Batch files (``iter-*/{rollouts,score,advantages}.arrow`` and their ``.blake3``) kept: those of the last
    this many committed iterations; 0: none (no task reads a committed iteration's batch, and a resume samples
    the iteration after its resume point again). A resident run deletes them when its resume point moves
    (every ``save_interval``), never past it. -1: all (none deleted)."""
    iterations_per_chunk: int = 8
    """Iterations per sub-workflow (a chunk), so each stays within Flyte's node limits. Each iteration adds
    about 19 KB to the chunk's ``futures.pb`` (every node binds the whole config; 555 KB for 20 PPO iterations
    with evaluations, ``tests/cluster/test_literal_sizes.py``), which propeller reads within
    ``storage.limits.maxDownloadMBs`` (2 MB by default): keep it well below 100."""
    iterations_per_execution: int = 200
    """Iterations per Flyte execution on a cluster: a run is a chain of executions, each running up to this
    many iterations (as chunks one after another) and then launching the next from the state it reached, so
    no execution's record grows with the run. Propeller keeps every finished node's status in the
    execution's one object (about 440 bytes per iteration of 8 nodes) and aborts a run past etcd's request
    limit (1.5 MiB by default, about 3,000 iterations); 200 keeps each under 100 KB and each execution's
    10 system retries fresh (docs/cluster.md#long-runs). A local run is one execution whatever this is."""
    off_policy_steps: int = 0
    """The older name of ``max_staleness`` 0 and 1, kept for presets and stored runs: ``off_policy_steps=1`` is
    ``max_staleness=1`` (the same graph, the same results). Set one of the two."""
    max_staleness: int = 0
    """k, how many updates behind the actor it trains a sampled token may be (docs/off_policy.md). 0: each batch
    is sampled from the actor it updates (on-policy). 1: one-step off-policy pipelining, iteration i+1's batch
    sampled from the actor of iteration i−1 while iteration i's update runs, on different pods. k ≥ 2
    (``run.resident`` only): asynchronous training, the engine service generates without waiting for the
    updates into a buffer, each token tagged with the policy version that drew it (``token_versions``), and an
    iteration's rollout takes its batch from there once every token is at most k versions old (older ones are
    dropped and counted). The loss is decoupled PPO either way: π_old is the actor the update starts from,
    ``actor.tis_cap`` weights each token by π_old/π_sampler."""
    partial_rollouts: bool = False
    """With ``max_staleness`` ≥ 2: new weights reach the engine between two tokens of the generations under
    way, which go on under the new policy, each token tagged with the version whose weights computed its
    logits (HF engine: the KV cache of their earlier tokens kept; vLLM: recomputed by the new weights). Off:
    generations finish under the weights they started with, and new weights wait for them (at most one unit
    of 4 prompts)."""
    stale_samples: str = "drop"
    """With ``max_staleness`` k ≥ 2, a unit of samples found staler than k when its batch is taken (the
    engine's version moved back: a restarted or reloaded engine): ``drop`` (counted as
    ``async/dropped_samples``, its prompts sampled again) or ``reweight`` (trained, counted as
    ``async/reweighted_samples``, with the truncated importance weight min(π_old/π_sampler, ``actor.tis_cap``)
    against its per-token behaviour log-probs, as every token of an asynchronous run)."""
    resident: bool = False
    """Keep the actor trainer, the generation engine and (PPO) the critic trainer loaded for the whole run
    as services the iteration's tasks call, instead of loading every model from storage in every task
    (docs/cluster.md#running-the-resident-mode). New weights go from the trainer to the engine in memory; checkpoints
    are written every ``save_interval`` only, and a crash resumes from the last one, redoing the
    iterations after it. Local runs start the services as child processes of ``pyflyte run``."""
    resident_weight_transport: str = "collective"
    """How a resident run's new actor weights reach the engine service after each update: ``collective``
    (a process group of two between the actor trainer's rank 0 and the engine, NCCL when both are on
    different GPUs, else gloo; the tensors by broadcast in a few flat buffers per dtype) or ``http`` (one
    binary body of the engine service's ``weights`` op). LoRA sends the adapter alone, over HTTP either way
    (docs/cluster.md#running-the-resident-mode)."""
    weight_push: str = "delta"
    """What a resident run's push sends when the engine is a process of its own (``run.resident_layout=separate``;
    colocated engines load in process): ``delta``, per tensor only the elements whose value at the engine's dtype
    changed since the push the engine holds (their positions, or a bitmap, with their values or the steps of their
    bits; or the whole tensor where that is smaller; the trainer keeps the engine's copy on its host, each rank its
    part), checked as a full push is; a
    restarted or new engine gets a full push first, and one that cannot patch in place (vLLM on the CPU, engine
    replicas) full pushes only. ``full``: every push the whole policy (docs/cluster.md#running-the-resident-mode)."""
    resident_layout: str = "separate"
    """Where a resident run generates (docs/cluster.md#choosing-the-layout): ``separate``, an engine service on its
    own GPUs, the new weights sent to it after each update (``run.resident_weight_transport``); or ``colocated``,
    every rank of the actor trainer service also holds an engine, the rollout data-parallel over all of them and
    the new weights loaded in each rank's process (no engine service, no bytes between processes). Colocated
    generation cannot overlap training, so it needs ``run.max_staleness=0``. Read only with ``run.resident=true``
    (the 8B and 70B presets set ``colocated``, the layout their projection and the CPU benchmark favour; engine
    groups of ``rollout.tensor_parallel_size`` ranks)."""
    resident_reference: str = "keep"
    """What the resident actor trainer does with π_ref between the iterations' scores (a KL penalty's reference;
    with LoRA it is the actor with its adapter off and holds nothing): ``keep`` it loaded for the whole run (sharded
    as the actor), or ``reload`` it from the reference checkpoint for each score and free it after, so the update
    does not hold it (at Qwen3-0.6B's shape, held by shard at its checkpoint's bfloat16: 0.6 GB a rank of 2 less,
    for a read of each rank's shard per iteration; the same results). Read only with ``run.resident=true``."""
    resident_idle_timeout_s: float = 1800.0
    """A resident service with no request for this long stops by itself (a backstop: the run stops its
    services when it finishes or fails)."""
    resident_start_timeout_s: float = 1800.0
    """On a cluster, how long an iteration's task waits for a service of its launch to come up (the services
    start as nodes beside the first tasks and load their models first); then it fails naming the service."""
    resident_answer_timeout_s: float = 120.0
    """How long a resident service may show no sign of life (no answer, and no heartbeat: a service sends one
    every sixth of this while an op runs, however long the op takes) before the task or service calling it
    fails, naming it (docs/cluster.md#reliability-of-the-services)."""
    resident_push_wait_s: float = 3600.0
    """How long the actor trainer waits for the engine service to take a push of new weights (it may first finish an
    off-policy rollout or an asynchronous unit) before the update fails naming the engine. Its ranks wait outside
    the process group's collectives (rank 0 for the engine, the others on rank 0 in a gloo group of this timeout),
    so no collective timeout (NCCL's watchdog) ends them meanwhile."""
    resident_rank_grace_s: float = 10.0
    """How long after one rank of a resident trainer service failed an op its other ranks may still be inside it;
    a rank still there is blocked in a collective the failed one never entered, and the service stops with the
    reason instead of hanging (docs/cluster.md#reliability-of-the-services)."""
    seed: int = 0
    """Seed for prompt order, sampling and updates."""
    algorithm: str = "ppo"
    """ppo, reinforce, rloo, grpo, dr_grpo or reinforce_pp, each declared in ``models/algorithms/``
    (docs/algorithms.md)."""
    mlflow_experiment: str = "flyte-rlhf"
    """MLflow experiment name (tracking URI from ``MLFLOW_TRACKING_URI``)."""
    num_logged_samples: int = 8
    """Sample generations logged to MLflow per iteration."""
    registered_model_name: str = "flyte-rlhf-policy"
    """MLflow Model Registry name the final policy is registered under (alias ``candidate``);
    empty: log the final policy without registering it. A name MLflow refuses (``/``, ``:``, ``%``)
    is refused when the config is read, not after training."""
    checkpoint_artifact_max_mb: float = 512.0
    """Checkpoints kept at ``save_interval`` up to this size are copied into the MLflow run as
    artifacts; larger ones are recorded by reference (a ``checkpoint.*`` tag with their URL)."""
    lock_ttl_s: float = 1800.0
    """The run's lock (``{run}/lock.json``: one launch per run name) is stale this many seconds after
    its holder's last heartbeat, and another launch may take it over. A local run renews it every
    quarter of this, and its lock is taken over at once once its process is gone; on a cluster the
    update, commit and evaluation tasks renew it, so it must exceed the longest rollout + score with
    pod start-up."""
    memory_limit_gib: float = 0.0
    """A local run's processes together (``pyflyte`` and everything it started: the engine, elastic workers,
    services, reward workers) may hold this much resident memory (RSS, sampled every 0.5 s by the run's keeper);
    over it the keeper SIGKILLs the largest of them and the run fails naming it, the memory it reached and this
    limit, resumable from its last commit (docs/reliability.md). Set it below the machine's memory to fail with
    that message before the kernel's OOM killer acts. 0: no limit (the keeper still watches)."""

    def __post_init__(self) -> None:
        check(bool(self.storage_root), "run.storage_root must not be empty")
        check(self.num_iterations >= 1, "run.num_iterations must be >= 1")
        check(self.eval_interval >= 0, "run.eval_interval must be >= 0")
        check(not self.eval_before_training or self.eval_interval > 0,
              "run.eval_before_training needs run.eval_interval > 0 (held-out evaluation is off at 0)")
        check(self.save_interval >= 1, "run.save_interval must be >= 1")
        for key, keep in (("keep_checkpoints", self.keep_checkpoints), ("keep_batches", self.keep_batches)):
            check(keep >= -1, f"run.{key} must be >= -1 (-1 keeps all, 0 only what a resume needs), got {keep}")
        check(self.iterations_per_chunk >= 1, "run.iterations_per_chunk must be >= 1")
        check(1 <= self.iterations_per_execution <= MAX_ITERATIONS_PER_EXECUTION,
              f"run.iterations_per_execution must be 1 to {MAX_ITERATIONS_PER_EXECUTION}: each iteration adds about "
              f"440 bytes to its execution's record in etcd, which refuses 1.5 MiB (docs/cluster.md#long-runs)")
        chunks = -(-self.iterations_per_execution // self.iterations_per_chunk)
        check(chunks <= MAX_CHUNKS_PER_EXECUTION,
              f"run.iterations_per_execution={self.iterations_per_execution} in chunks of run.iterations_per_chunk="
              f"{self.iterations_per_chunk} is {chunks} chunks per execution, over {MAX_CHUNKS_PER_EXECUTION}: the "
              f"execution's dynamic workflow binds the whole config once per chunk (about 4 KB each), and propeller "
              f"reads it within storage.limits.maxDownloadMBs (2 MB by default). Raise run.iterations_per_chunk or "
              f"lower run.iterations_per_execution")
        check(self.off_policy_steps in (0, 1), f"run.off_policy_steps must be 0 (on-policy) or 1 (one-step "
                                               f"off-policy pipelining), got {self.off_policy_steps}")
        check(self.max_staleness >= 0, f"run.max_staleness must be >= 0, got {self.max_staleness}")
        check(not (self.off_policy_steps and self.max_staleness), f"run.off_policy_steps={self.off_policy_steps} "
              f"with run.max_staleness={self.max_staleness}: off_policy_steps is max_staleness's older name (1 is "
              f"max_staleness=1); set max_staleness alone")
        check_choice("run.stale_samples", self.stale_samples, ["drop", "reweight"])
        check(self.staleness < 2 or self.resident, f"run.max_staleness={self.max_staleness} (asynchronous "
              f"training) needs run.resident=true: the engine service generates between the iterations' tasks")
        check_choice("run.algorithm", self.algorithm, list(algorithms.ALGORITHMS))
        check("/" not in self.name and " " not in self.name,
              f"run.name={self.name!r} must not contain '/' or spaces")
        check(self.checkpoint_artifact_max_mb >= 0, "run.checkpoint_artifact_max_mb must be >= 0")
        check(self.lock_ttl_s > 0, "run.lock_ttl_s must be > 0")
        check(self.memory_limit_gib >= 0, "run.memory_limit_gib must be >= 0 (0: no limit)")
        check(self.resident_idle_timeout_s > 0, "run.resident_idle_timeout_s must be > 0")
        check(self.resident_start_timeout_s > 0, "run.resident_start_timeout_s must be > 0")
        check(self.resident_answer_timeout_s > 0, "run.resident_answer_timeout_s must be > 0")
        check(self.resident_push_wait_s > 0, "run.resident_push_wait_s must be > 0")
        check(self.resident_rank_grace_s > 0, "run.resident_rank_grace_s must be > 0")
        check_choice("run.resident_weight_transport", self.resident_weight_transport, ["collective", "http"])
        check_choice("run.resident_layout", self.resident_layout, ["separate", "colocated"])
        check_choice("run.weight_push", self.weight_push, ["full", "delta"])
        check_choice("run.resident_reference", self.resident_reference, ["keep", "reload"])
        if self.resident and self.resident_layout == "colocated":  # (read only by a resident run, as a preset sets it)
            setting = (f"run.off_policy_steps={self.off_policy_steps}" if self.off_policy_steps
                       else f"run.max_staleness={self.max_staleness}")
            check(self.staleness == 0,
                  f"run.resident_layout=colocated generates on the actor trainer's own ranks, so generation and "
                  f"training cannot overlap: {setting} needs run.resident_layout=separate (an engine service of "
                  f"its own), or set it to 0")
        _check_registered_model_name(self.registered_model_name)

    @property
    def staleness(self) -> int:
        """k: ``max_staleness``, or ``off_policy_steps`` (its older name)."""
        return max(self.max_staleness, self.off_policy_steps)

    @property
    def pipelined(self) -> bool:
        """One-step off-policy pipelining (k = 1): the graph samples iteration i+1 beside iteration i's update."""
        return self.staleness == 1

    @property
    def asynchronous(self) -> bool:
        """k ≥ 2: the engine service samples continuously into a buffer (:mod:`models.hosts.producer`)."""
        return self.staleness >= 2
