"""The inputs of the iteration projection (``benchmarks/project_iteration.py``): what it assumes, each figure
with its source (a figure measured here, a peer's published one, or a hardware spec), the shapes of the 8B and
70B presets it projects, and the peers' published steps it is compared with."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

NEMO_ALIGNER_70B_STEP_S = 253.8
"""Llama-2-70B PPO step on 8+8 H100 nodes (NeMo-Aligner, arXiv:2405.01481)."""
NEMO_RL_8B_STEP_S = 92.8
"""Llama-3.1-8B GRPO step, on-policy, on 16 H100s in all (NeMo RL v0.5 performance summary,
NVIDIA-NeMo/RL docs/about/performance-summary.md, Megatron backend, bf16)."""
NEMO_RL_8B_TOKENS = 2048 * 1019
"""Tokens of that step: 2048 sequences (its generation batch), 1019 tokens each on average (the same table)."""

NEMO_RL_8B_GPUS = 16
"""GPUs of that step, colocated: its recipe (``examples/configs/recipes/llm/performance/
grpo-llama3.1-8b-instruct-2n8g.yaml``, 2 nodes of 8) keeps ``policy.generation.colocated.enabled: true`` from
``grpo_math_1B.yaml``, so vLLM generates data-parallel on all 16 (tensor parallel 1) and sleeps while they train."""
NEMO_RL_V04_8B_STEP_S = (97.7, 74.6)
"""Llama-3.1-8B GRPO step on 16 H100s, on-policy (colocated) and one-step off-policy (generation on one node of 8,
training on the other: ``async-grpo-llama3.1-8b-instruct-2n8g.yaml``, ``colocated.enabled: false``), NeMo RL v0.4
performance summary (NVIDIA-NeMo/RL ``docs/about/performance-summary.md``): 0.76x the on-policy step."""
NEMO_RL_V04_32B = ((393.0, 32, 540.0), (215.0, 64, 494.0))
"""Qwen3-32B GRPO, on-policy then one-step off-policy: (step seconds, H100s, published tokens/s/GPU), the same
v0.4 table; the largest dense model it lists, the nearest to the 70B presets. Off-policy on twice the GPUs, its
step is 0.55x and its tokens/s/GPU 0.91x the on-policy ones."""
VERL_ASYNC_128_STEP_S = (356.30, 150.63)
"""Qwen2.5-Math-7B DAPO step on 128 H20s, colocated synchronous against veRL's fully asynchronous trainer (64
GPUs generating, 64 training, staleness 0.5, partial rollouts): 2.35x over 400 steps, 2.67x over the first 100
(volcengine/verl ``recipe/fully_async_policy/README.md``, "128-card 7B Asynchronous Mode Experiment")."""
AREAL_SPEEDUP = 2.77
"""AReaL's asynchronous training against synchronous systems on the same GPUs, "up to 2.77x" (Fu et al. 2025,
"AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning", arXiv:2505.24298)."""
NEMO_ALIGNER_70B_GPUS = 128
"""GPUs of NeMo-Aligner's 70B step: 8 actor nodes and 8 critic nodes of 8 (arXiv:2405.01481); its generation runs on
the actor's 64."""

MEASURED_PUSH_DENSITY = 0.028
"""Elements of a bfloat16 policy an update at lr 1e-6 changes: the median of three updates (0.042, 0.028, 0.023)
measured by ``benchmarks/bench_delta_push.py`` (Qwen3-0.6B's width at 8 layers, random weights, AdamW on a
GRPO-shaped loss; ``benchmarks/RESULTS.md``, 2026-11-28), within the 1-3 % veRL, slime and NeMo-RL report for
real RL steps after the first (AdamW's first step moves every weight by the whole learning rate)."""
MEASURED_SHARD_SHARE = 22848 / 45696
"""Moment bytes one of 2 FSDP2 ranks reads with the cut / without, measured through S3 by
``tests/unit/models/test_optimizer_shards.py`` (22848 of 45696 bytes: exactly 1/ranks; each file adds its
~7 KB header and step scalars, nothing at 8B). The projection takes each rank's share as 1/ranks."""

@dataclass(frozen=True)
class Assumptions:
    """What the projection takes as given (each a stated, checkable number with its source)."""

    pod_start_s: float = 60.0
    """Stateless GPU pod scheduled to the task's code running: image cached on the node, Python, torch, CUDA and
    NCCL initialised (the harness measures 30-100 s for a cold CPU pod on a loaded 2-core machine)."""
    s3_gb_per_s: float = 2.0
    """S3 throughput of one node, read or write, GB/s (parallel ranged requests on a 100-400 Gbit/s NIC;
    one process with one stream gets far less)."""
    peak_tflops: float = 989.0
    """H100 SXM dense bf16 peak, TFLOP/s per GPU (NVIDIA's H100 datasheet)."""
    train_mfu: float = 0.35
    """Model FLOPs utilisation of the actor and critic updates (FSDP2, bf16)."""
    forward_mfu: float = 0.45
    """MFU of the scoring forwards (π_old, π_ref, critic, reward model)."""
    gen_tokens_per_s_per_gpu: float = 2500.0
    """vLLM decode throughput per GPU at the rollout's batch (8B, bf16, 1024-token responses), with CUDA graphs
    (``rollout.enforce_eager: false``, the engine's default on a GPU since #38; eager decoding is typically 1.5-2x
    slower)."""
    engine_start_s: float = 12.0
    """vLLM's start in a stateless rollout pod on top of the pod's (a resident engine starts once a run): the
    harness's rollout pods took 20 and 32 s with vLLM against 8 s with the HF engine (tiny model, CPU;
    benchmarks/RESULTS.md, 2026-11-25), so at least 12 s; CUDA graph capture on a GPU adds to it."""
    cpu_pod_start_s: float = 9.0
    """A stateless CPU task's pod (advantages, commit): Kubernetes' pod-startup SLO, 99th percentile <= 5 s
    for a stateless pod whose image is on the node (kubernetes/community, sig-scalability/slos/
    pod_startup_latency.md), plus importing its task module (``import tasks.advantages``: torch,
    transformers, flytekit), 3.6 s measured on the project's 2-core box on 2026-11-26."""
    thin_pod_start_s: float = 6.0
    """A resident-mode task's pod (CPU, imports neither torch nor vLLM): the same 5 s SLO plus
    ``import flytekit``, 0.8 s measured on the same box."""
    nccl_gb_per_s: float = 25.0
    """Trainer → engine weight broadcast, GB/s: one sending GPU's NIC across nodes, as verl measured it
    (verl-project/verl#7167: ~25 GB/s from the master rank alone, ~90 GB/s with every trainer GPU of the node
    sending); an H100 node's ConnectX-7 is 400 Gbit/s = 50 GB/s per GPU. Peers report 0.2-7 s at 0.6B-30B. The
    push's gather into the trainer's rank 0 takes the rows of other nodes at the same rate (one GPU's NIC)."""
    nvlink_gb_per_s: float = 450.0
    """Into one H100 from the other GPUs of its node, GB/s: NVLink 4's 900 GB/s per GPU counts both directions
    (NVIDIA's H100 datasheet), so 450 into rank 0 during the push's gather of the node's rows."""
    hbm_gb_per_s: float = 3350.0
    """H100 SXM HBM3 bandwidth, GB/s (NVIDIA's H100 datasheet: 3.35 TB/s): a colocated engine's in-process load
    copies its slice of each gathered layer into its own buffers at this rate (read and write)."""
    engine_sleep_s: float = 0.31
    """A colocated engine's sleep per iteration, after generation: vLLM sleep mode at level 2 (weights discarded,
    KV cache freed, nothing copied; the level veRL's hybrid engine uses for full-weight rollouts,
    verl-project/verl#6661), 0.31 s for Qwen3-8B freeing 47.4 GiB of one A100 (level 1, copying the weights to
    host memory: 10.57 s), measured in colocated RL runs and posted on vllm-project/vllm#48337 (2026-07-15). Each
    GPU frees about as much at 70B (tensor parallel 8), so the figure is taken per GPU at both sizes."""
    engine_wake_s: float = 6.53
    """A colocated engine's wake per iteration, before its in-process load: level 2, 6.53 s for the same Qwen3-8B
    on an A100 (vllm-project/vllm#48337; level 1: 2.19 s), which reallocates weights and KV cache and reloads the
    weights, a load the projection counts apart, so an over-count. Cross-checks: vLLM's sleep-mode post
    (blog.vllm.ai, 2025-10-26) measures level-1 wakes of 3-6 s for large models and level-2 wakes of 0.85-2.58 s
    for 0.6-4B ones; veRL's colocated 7B step on 128 GPUs spends 10.7 s outside generation, log-probs and the
    update (356.30 - 177.85 - 53.92 - 113.81, ``recipe/fully_async_policy/README.md``), sleep, wake and weight
    sync included."""


@dataclass(frozen=True)
class Dims:
    """A Llama-style decoder's sizes (the model's ``config.json``), what the update's activations scale with."""

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    @property
    def d_kv(self) -> int:
        """Width of the keys (and of the values): ``d_model · kv_heads / heads`` (grouped-query attention)."""
        return self.d_model * self.kv_heads // self.heads

    def layer_params(self) -> float:
        """Parameters of one decoder layer (:func:`llama_params`' per-layer term)."""
        return 2 * self.d_model ** 2 + 2 * self.d_model * self.d_kv + 3 * self.d_model * self.ffn + 2 * self.d_model


LLAMA3_8B_DIMS = Dims(layers=32, d_model=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
"""Llama-3(.1)-8B's ``config.json`` (meta-llama on the Hugging Face hub): 32 layers, 4096 wide, 32 query and 8 KV
heads, FFN 14336, vocabulary 128256."""
LLAMA3_70B_DIMS = Dims(layers=80, d_model=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)
"""Llama-3-70B's ``config.json``: 80 layers, 8192 wide, 64 query and 8 KV heads, FFN 28672, vocabulary 128256."""


@dataclass(frozen=True)
class Shape:
    """A PPO run's sizes: models, batch and the GPUs of each task (stateless) or service (resident)."""

    name: str
    params: float
    """Actor parameters (reference and reward model the same size)."""
    samples: int
    """Responses per iteration (prompts × samples per prompt)."""
    prompt_tokens: int
    """Mean prompt length (tokens)."""
    response_tokens: int
    """Mean response length (tokens; the budget when responses run to it)."""
    actor_nodes: int
    gpus_per_node: int = 8
    rollout_gpus: int = 1
    score_gpus: int = 1
    """GPUs of one scoring pod (``resources.score_gpu``), stateless; resident, scoring runs on the actor trainer's
    ranks (π_old, π_ref and the reward model sharded there) and the critic trainer's (the values)."""
    critic_gpus: int = 1
    critic_lora: bool = True
    """The critic trains LoRA adapters on a frozen base (the 8B preset); else a full critic like the actor."""
    gen_speed: float = 1.0
    """Decode throughput per GPU relative to :attr:`Assumptions.gen_tokens_per_s_per_gpu` (larger models
    decode slower per GPU)."""
    checkpoint_bytes_per_param: int = 4
    """Committed checkpoints hold float32 weights (the training master copy)."""
    optimizer_bytes_per_param: int = 8
    """AdamW's two moments in the parameters' dtype (``models/training/optimizer_state.py``)."""
    critic_params: Optional[float] = None
    """Critic parameters (None: :attr:`params`; a value head in place of the LM head differs a little)."""
    reward_model: bool = True
    """Score loads a reward model the actor's size (False: a reward function, as the tiny runs use)."""
    sharded_state: bool = False
    """The cut of the largest term, ``actor.optimizer_state_sharded`` (and the critic's, unless
    :attr:`critic_sharded_state` says otherwise; ``models/training/optimizer_shards.py``): AdamW's moments
    written and read per rank under FSDP2, each rank its own shard, so each node moves O ×
    :data:`MEASURED_SHARD_SHARE` × its ranks = O/nodes in parallel, instead of every node reading the whole O
    and rank 0 writing it (``models/training/optimizer_state.py``). A LoRA critic's state (adapters only) is
    left out either way."""
    critic_sharded_state: Optional[bool] = None
    """``critic.optimizer_state_sharded`` (None: as :attr:`sharded_state`)."""
    score_nodes: int = 1
    """Nodes of the stateless scoring task, :attr:`score_gpus` each: 1 (one pod), or the actor's topology
    where scoring is the elastic task (the 70B presets, being built)."""
    save_interval: int = 50
    """``run.save_interval``: a resident run writes a checkpoint every this many iterations."""
    engine_bytes_per_param: int = 2
    """The engine's weights, bfloat16 (``rollout.vllm_dtype``): what the trainer sends it after each update (cast
    on each rank before the gather, ``models/training/weight_source.py``; ``resident/weights_bytes`` logs it)."""
    push_density: float = 1.0
    """``run.weight_push=delta``: the elements of the engine's weights an update changes at its dtype (1.0: full
    pushes, what the totals count: a restarted engine's push, and the bound). Each changed element travels as a
    byte of position in its block of 256 and its value, each block as a byte of count (``models/engines/
    weight_delta.py``), so a push moves :func:`~benchmarks.project_iteration.push_share` of the full push's bytes.
    The push's line also prints the delta's seconds at :data:`MEASURED_PUSH_DENSITY`."""
    push_bucket_bytes: int = 256 << 20
    """Most tensor bytes of one bucket of a push (``models/engines/weight_stream.py``, ``BUCKET_BYTES``): the
    engine loads a bucket before it takes the next, so it holds two at most."""
    dims: Optional[Dims] = None
    """The actor's decoder sizes (None: no update memory is projected, ``benchmarks/projection_memory.py``)."""
    critic_dims: Optional[Dims] = None
    """The critic's (None: :attr:`dims`)."""
    max_prompt_tokens: int = 1024
    """``data.max_prompt_tokens``: with ``rollout.max_new_tokens`` the longest row of a micro-batch."""
    micro_batch: int = 4
    """``actor.micro_batch_size``: rows of one forward and backward on a rank."""
    critic_micro_batch: int = 8
    """``critic.micro_batch_size``."""
    activation_checkpointing: bool = True
    """``actor.activation_checkpointing``: each decoder layer keeps only its input through the forward."""
    critic_activation_checkpointing: bool = True
    """``critic.activation_checkpointing``."""
    critic_lora_rank: int = 64
    """``critic.lora.rank`` of a LoRA critic (:attr:`critic_lora`): its adapters on every projection of every
    layer are what it trains."""


def llama_params(layers: int, d_model: int, kv_heads: int, ffn: int, vocab: int, heads: int, tied: bool) -> float:
    """Parameters of a Llama-style decoder: per layer q and o (d²), k and v (d · d_kv, d_kv = d · kv_heads /
    heads, GQA), gate, up and down (3 · d · ffn), two RMSNorms (2d); the embedding and, untied, the LM head
    (vocab · d each) and the final norm."""
    d_kv = d_model * kv_heads // heads
    layer = 2 * d_model * d_model + 2 * d_model * d_kv + 3 * d_model * ffn + 2 * d_model
    return layers * layer + (1 if tied else 2) * vocab * d_model + d_model


LLAMA_8B = Shape("llama8b_ppo_gpu", params=8.03e9, samples=128 * 4, prompt_tokens=512, response_tokens=1024,
                 actor_nodes=1, dims=LLAMA3_8B_DIMS)
"""``configs/llama8b_ppo_gpu.yaml``: 128 prompts × 4, 1024-token budget, the actor on one node of 8, rollout,
score and the LoRA critic on one GPU each."""
LLAMA_8B_FULL = replace(LLAMA_8B, name="llama8b_ppo_full_critic_gpu", critic_gpus=8, critic_lora=False,
                        critic_sharded_state=True, critic_micro_batch=4)
"""``configs/llama8b_ppo_full_critic_gpu.yaml``: the 8B preset with a full critic, an FSDP2 job on one node of
8 whose ranks commit their shards of AdamW's moments (the actor's are committed whole, as the base sets)."""
LLAMA_70B = Shape("llama70b_ppo_gpu", params=llama_params(80, 8192, 8, 28672, 128256, heads=64, tied=False),
                  samples=256 * 4, prompt_tokens=512, response_tokens=1024, actor_nodes=8, rollout_gpus=8,
                  score_gpus=8, critic_gpus=1, critic_params=LLAMA_8B.params, gen_speed=0.25, save_interval=20,
                  dims=LLAMA3_70B_DIMS, critic_dims=LLAMA3_8B_DIMS, micro_batch=2)
"""``configs/llama70b_ppo_gpu.yaml`` (Llama-3-70B shapes, 70.6B): 256 prompts × 4, 1024-token budget, the actor
FSDP2 over 8 nodes of 8, rollout (tensor parallel 8) and score on one node of 8, an 8B LoRA critic on one
GPU (the critic update is one process), a 70B reward model. :data:`PRESETS` projects it as shipped."""
LLAMA_70B_FULL = replace(LLAMA_70B, name="llama70b_ppo_full_critic_gpu", critic_gpus=64, critic_lora=False,
                         critic_params=None, sharded_state=True, score_nodes=8, critic_dims=None,
                         critic_micro_batch=2)
"""``configs/llama70b_ppo_full_critic_gpu.yaml``: a full 70B critic, an FSDP2 job on 8 nodes of 8, both
trainers committing AdamW per rank, and scoring as the elastic task on the actor's 8 nodes."""
LLAMA_8B_GRPO = replace(LLAMA_8B, name="llama8b_grpo_gpu", samples=64 * 8, critic_params=0.0, critic_gpus=0,
                        critic_lora=False, reward_model=False, max_prompt_tokens=512)
"""``configs/llama8b_grpo_gpu.yaml``: GRPO with a verifier as NeMo-RL's Llama-3.1-8B GRPO step runs it, 64 prompts
× 8, 1024-token budget, no critic and no reward model (a reward function): only π_old and π_ref scored and the
actor updated, FSDP2 on one node of 8, resident and colocated."""
NEMO_70B = Shape("Llama-2-70B, NeMo-Aligner's layout (no preset)", params=69.0e9, samples=1024, prompt_tokens=512,
                 response_tokens=1024, actor_nodes=8, rollout_gpus=8, score_gpus=8, critic_gpus=64,
                 critic_lora=False, gen_speed=0.25)
"""The NeMo-Aligner Llama-2-70B shape: actor and a full critic on 8 nodes each, rollout and score with
8 GPUs (tensor parallel); 1024 responses per step (their rollout batch), 1024-token budget. Its compute
terms are what :func:`rows` compares with their published step."""

PRESETS = (LLAMA_8B, LLAMA_8B_FULL, replace(LLAMA_70B, sharded_state=True, score_nodes=8), LLAMA_70B_FULL)
"""The presets as shipped (``configs/<name>.yaml``): the 70B ones with the actor's AdamW state per rank and
scoring as the elastic task on the actor's topology (being built; the 8B presets score on one GPU, as
``resources.score_gpu`` says). Every actor rank loads only its shard (``models/training/sharded_load.py``)."""


def tokens(s: Shape) -> int:
    """Tokens of an iteration's sequences, prompts and responses."""
    return s.samples * (s.prompt_tokens + s.response_tokens)


def critic_sharded(s: Shape) -> bool:
    """Whether the critic's AdamW state is committed per rank."""
    return s.sharded_state if s.critic_sharded_state is None else s.critic_sharded_state


def critic_size(s: Shape) -> float:
    return s.params if s.critic_params is None else s.critic_params


def critic_nodes(s: Shape) -> int:
    return max(1, s.critic_gpus // s.gpus_per_node)
