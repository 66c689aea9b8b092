"""The cost of a stateless PPO iteration at scale, on paper: every task is a fresh pod that reads its
state (weights, AdamW's moments) from S3 and writes it back, as this project runs on a Flyte cluster.

    python benchmarks/project_iteration.py [--json PATH] [--check-small]

For the 8B and 70B presets (``configs/llama8b_ppo_gpu.yaml``, ``configs/llama70b_ppo_gpu.yaml``) and
NeMo-Aligner's Llama-2-70B layout (described below, not a preset), on H100 nodes, each task's seconds per
iteration = pod start + state bytes / S3 bandwidth + compute (generation at a stated tokens/s, forward and
backward FLOPs at a stated MFU), and the share of the iteration that is state movement. Every input is an :class:`Assumptions` or :class:`Shape` field.

Checked against NeMo-Aligner's published Llama-2-70B PPO step, 253.8 s on 8 actor + 8 critic nodes of
8 GPUs (Shen et al. 2024, "NeMo-Aligner: Scalable Toolkit for Efficient Model Alignment",
arXiv:2405.01481; the figure as the project's issue #21 quotes it). NeMo-Aligner keeps every model
resident between steps (no state movement), so it is compared with this projection's compute terms
(:func:`compute_seconds`), the part both systems share; the state terms are what statelessness adds.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

NEMO_ALIGNER_70B_STEP_S = 253.8
"""Llama-2-70B PPO step on 8+8 H100 nodes (NeMo-Aligner, arXiv:2405.01481)."""


MEASURED_SHARD_SHARE = 22848 / 45696
"""Moment bytes one of 2 FSDP2 ranks reads with the cut / without, measured through S3 by
``tests/unit/models/test_optimizer_shards.py`` (22848 of 45696 bytes: exactly 1/ranks; each file adds its
~7 KB header and step scalars, nothing at 8B). The projection takes each rank's share as 1/ranks."""


@dataclass(frozen=True)
class Assumptions:
    """What the projection takes as given (each a stated, checkable number)."""

    pod_start_s: float = 60.0
    """Pod scheduled to the task's code running: image cached on the node, Python, torch, CUDA and NCCL
    initialised (the harness measures 30-100 s for a cold CPU pod on a loaded 2-core machine)."""
    s3_gb_per_s: float = 2.0
    """S3 throughput of one node, read or write, GB/s (parallel ranged requests on a 100-400 Gbit/s NIC;
    one process with one stream gets far less)."""
    peak_tflops: float = 989.0
    """H100 SXM dense bf16 peak, TFLOP/s per GPU."""
    train_mfu: float = 0.35
    """Model FLOPs utilisation of the actor and critic updates (FSDP2, bf16)."""
    forward_mfu: float = 0.45
    """MFU of the scoring forwards (π_old, π_ref, critic, reward model)."""
    gen_tokens_per_s_per_gpu: float = 2500.0
    """vLLM decode throughput per GPU at the rollout's batch (8B, bf16, 1024-token responses)."""


@dataclass(frozen=True)
class Shape:
    """A PPO run's sizes: models, batch and the GPUs of each task."""

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
    """The cut of the largest term, ``actor.optimizer_state_sharded`` and ``critic.optimizer_state_sharded``
    (``models/training/optimizer_shards.py``): AdamW's moments written and read per rank under FSDP2, each rank its
    own shard, so each node moves O × :data:`MEASURED_SHARD_SHARE` × its ranks = O/nodes in parallel,
    instead of every node reading the whole O and rank 0 writing it (``models/training/optimizer_state.py``). A LoRA
    critic's state (adapters only) is left out either way."""


def llama_params(layers: int, d_model: int, kv_heads: int, ffn: int, vocab: int, heads: int, tied: bool) -> float:
    """Parameters of a Llama-style decoder: per layer q and o (d²), k and v (d · d_kv, d_kv = d · kv_heads /
    heads, GQA), gate, up and down (3 · d · ffn), two RMSNorms (2d); the embedding and, untied, the LM head
    (vocab · d each) and the final norm."""
    d_kv = d_model * kv_heads // heads
    layer = 2 * d_model * d_model + 2 * d_model * d_kv + 3 * d_model * ffn + 2 * d_model
    return layers * layer + (1 if tied else 2) * vocab * d_model + d_model


LLAMA_8B = Shape("llama8b_ppo_gpu", params=8.03e9, samples=128 * 4, prompt_tokens=512, response_tokens=1024,
                 actor_nodes=1)
"""``configs/llama8b_ppo_gpu.yaml``: 128 prompts × 4, 1024-token budget, the actor on one node of 8, rollout,
score and the LoRA critic on one GPU each."""
LLAMA_70B = Shape("llama70b_ppo_gpu", params=llama_params(80, 8192, 8, 28672, 128256, heads=64, tied=False),
                  samples=256 * 4, prompt_tokens=512, response_tokens=1024, actor_nodes=8, rollout_gpus=8,
                  score_gpus=8, critic_gpus=1, critic_params=LLAMA_8B.params, gen_speed=0.25)
"""``configs/llama70b_ppo_gpu.yaml`` (Llama-3-70B shapes, 70.6B): 256 prompts × 4, 1024-token budget, the actor
FSDP2 over 8 nodes of 8, rollout (tensor parallel 8) and score on one node of 8, an 8B LoRA critic on one
GPU (the critic update is one process), a 70B reward model."""
NEMO_70B = Shape("Llama-2-70B, NeMo-Aligner's layout (no preset)", params=69.0e9, samples=1024, prompt_tokens=512,
                 response_tokens=1024, actor_nodes=8, rollout_gpus=8, score_gpus=8, critic_gpus=64,
                 critic_lora=False, gen_speed=0.25)
"""The NeMo-Aligner Llama-2-70B shape: actor and a full critic on 8 nodes each, rollout and score with
8 GPUs (tensor parallel); 1024 responses per step (their rollout batch), 1024-token budget. Not runnable
here: the critic update is one process (the cut of its state is projected, not measured)."""


def state_terms(s: Shape) -> Dict[str, Dict[Tuple[str, str], float]]:
    """Bytes each task moves through S3 per iteration by kind, ``{task: {(op, kind): bytes}}``, op ``read`` or
    ``write``, kind ``weights``, ``optimizer`` or ``batch`` (checked against a measured small run by
    ``--check-small``).

    W = params × checkpoint bytes per param, O = params × optimizer bytes per param (the critic's at
    :attr:`Shape.critic_params`: Wc, Oc). Each pod downloads a checkpoint once for all its ranks
    (``models/checkpoint/cache.py``); every node of an update job does.
      rollout: actor + reference (tokenizer home) = 2W             writes the batch
      score:   actor, reference, reward model, critic = 3W + Wc    writes the scored batch
      actor:   per node actor + reference + O (sharded: O/nodes)   rank 0 writes W + O
      critic:  per node critic + reference (+ Oc when full)        writes Wc + Oc (full) or adapters (LoRA)
    Batches (token ids and float32 columns, ~24 B per token) are read by score and by each update node.
    """
    w, o = s.params * s.checkpoint_bytes_per_param, s.params * s.optimizer_bytes_per_param
    cp = s.params if s.critic_params is None else s.critic_params
    wc, oc = cp * s.checkpoint_bytes_per_param, cp * s.optimizer_bytes_per_param
    batch = s.samples * (s.prompt_tokens + s.response_tokens) * 24.0
    critic_nodes = max(1, s.critic_gpus // s.gpus_per_node)
    share = MEASURED_SHARD_SHARE * 2  # × ranks = 1: each rank its 1/ranks, so the nodes together read O once
    o_read = (lambda nodes, o: share * o) if s.sharded_state else (lambda nodes, o: nodes * o)  # noqa: E731
    full = not s.critic_lora
    return {
        "rollout": {("read", "weights"): 2 * w, ("write", "batch"): batch},
        "score": {("read", "weights"): (3 if s.reward_model else 2) * w + wc, ("read", "batch"): batch,
                  ("write", "batch"): batch},
        "actor_update": {("read", "weights"): s.actor_nodes * 2 * w, ("read", "batch"): s.actor_nodes * batch,
                         ("read", "optimizer"): o_read(s.actor_nodes, o), ("write", "weights"): w,
                         ("write", "optimizer"): o},
        "critic_update": {("read", "weights"): critic_nodes * (w + wc), ("read", "batch"): critic_nodes * batch,
                          ("read", "optimizer"): o_read(critic_nodes, oc) if full else 0.0,
                          ("write", "weights"): wc if full else 0.0, ("write", "optimizer"): oc if full else 0.0},
    }


def state_bytes(s: Shape) -> Dict[str, Dict[str, float]]:
    """:func:`state_terms` summed per task and direction, ``{task: {"read", "write"}}``."""
    return {t: {op: sum(b for (o, _), b in terms.items() if o == op) for op in ("read", "write")}
            for t, terms in state_terms(s).items()}


def compute_seconds(s: Shape, a: Assumptions) -> Dict[str, float]:
    """Seconds of GPU work per task: generation at the stated tokens/s, forwards 2·P·tokens FLOPs per model
    (the critic at its own size), updates 6·P·tokens (LoRA critic: 4·P·tokens, no weight gradients) at the
    stated MFU."""
    tokens = s.samples * (s.prompt_tokens + s.response_tokens)
    cp = s.params if s.critic_params is None else s.critic_params
    models = (3 if s.reward_model else 2) * s.params + cp  # π_old, π_ref (and the reward model), the critic
    flops = lambda gpus, mfu: gpus * a.peak_tflops * 1e12 * mfu  # noqa: E731
    return {
        "rollout": s.samples * s.response_tokens / (a.gen_tokens_per_s_per_gpu * s.gen_speed * s.rollout_gpus),
        "score": 2 * models * tokens / flops(s.score_gpus, a.forward_mfu),
        "actor_update": 6 * s.params * tokens / flops(s.actor_nodes * s.gpus_per_node, a.train_mfu),
        "critic_update": (4 if s.critic_lora else 6) * cp * tokens / flops(s.critic_gpus, a.train_mfu),
    }


def state_seconds(s: Shape, a: Assumptions) -> Dict[str, float]:
    """Seconds moving state per task: each node reads its share in parallel; one writer writes the checkpoint."""
    nodes = {"rollout": max(1, s.rollout_gpus // s.gpus_per_node), "score": max(1, s.score_gpus // s.gpus_per_node),
             "actor_update": s.actor_nodes, "critic_update": max(1, s.critic_gpus // s.gpus_per_node)}
    rate = a.s3_gb_per_s * 1e9
    o = s.params * s.optimizer_bytes_per_param
    out = {}
    for t, b in state_bytes(s).items():
        sharded = s.sharded_state and t in ("actor_update", "critic_update") and b["write"] > 0
        # today rank 0 writes W + O alone; sharded, each node writes its share of O beside it
        write = (b["write"] - o) / rate + o / (nodes[t] * rate) if sharded else b["write"] / rate
        out[t] = b["read"] / (nodes[t] * rate) + write
    return out


def project(s: Shape, a: Assumptions) -> Dict[str, Dict[str, float]]:
    """``{task: {"start", "state", "compute", "total"}}`` seconds, plus ``"iteration"`` (the chain's sum;
    actor and critic updates run side by side, so the longer counts)."""
    comp, move = compute_seconds(s, a), state_seconds(s, a)
    out = {t: {"start": a.pod_start_s, "state": move[t], "compute": comp[t]} for t in comp}
    for v in out.values():
        v["total"] = v["start"] + v["state"] + v["compute"]
    upd = max(("actor_update", "critic_update"), key=lambda t: out[t]["total"])
    chain = [out["rollout"], out["score"], out[upd]]
    out["iteration"] = {k: sum(c[k] for c in chain) for k in ("start", "state", "compute", "total")}
    return out


def table(s: Shape, a: Assumptions) -> str:
    p = project(s, a)
    lines = [f"{s.name}: {s.params / 1e9:.0f}B, {s.samples} responses × {s.response_tokens} tokens, "
             f"S3 {a.s3_gb_per_s:g} GB/s per node, pod start {a.pod_start_s:g} s, MFU {a.train_mfu:g}",
             f"  {'task':14s} {'start s':>8s} {'state s':>8s} {'compute s':>10s} {'total s':>8s} {'GB moved':>9s}"]
    moved = state_bytes(s)
    for t, v in p.items():
        gb = sum(moved[t].values()) / 1e9 if t in moved else sum(sum(b.values()) for b in moved.values()) / 1e9
        lines.append(f"  {t:14s} {v['start']:8.0f} {v['state']:8.0f} {v['compute']:10.0f} {v['total']:8.0f} {gb:9.0f}")
    it = p["iteration"]
    lines.append(f"  state movement: {it['state'] / it['total']:.0%} of the iteration, pod starts "
                 f"{it['start'] / it['total']:.0%}")
    return "\n".join(lines)


def shapes() -> List[Shape]:
    """Each shape with the default whole optimizer state, then with the cut of its largest term
    (``actor.optimizer_state_sharded=true``, and ``critic.`` where the critic is trained in full; the 70B
    preset sets the actor's)."""
    return [v for s in (LLAMA_8B, LLAMA_70B, NEMO_70B)
            for v in (s, replace(s, name=f"{s.name}, sharded AdamW state", sharded_state=True))]


def rows(a: Assumptions) -> List[Row]:
    out = []
    for s in shapes():
        it = project(s, a)["iteration"]
        out.append(row("projection", f"{s.name} s/iteration (stateless pods)", it["total"], "s",
                       f"state {it['state']:.0f} s ({it['state'] / it['total']:.0%}), starts {it['start']:.0f} s, "
                       f"compute {it['compute']:.0f} s"))
    out.append(row("projection", "AdamW bytes a rank reads, sharded / whole (2 ranks, measured)",
                   MEASURED_SHARD_SHARE, "x", "tests/unit/models/test_optimizer_shards.py through S3 (moto)"))
    nemo = project(NEMO_70B, a)["iteration"]["compute"]
    out.append(row("projection", "70B compute terms / NeMo-Aligner step", nemo / NEMO_ALIGNER_70B_STEP_S, "x",
                   f"{nemo:.0f} s projected vs {NEMO_ALIGNER_70B_STEP_S} s published (models resident; "
                   f"their rollout runs on the actor's 64 GPUs, this shape's on 8)"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)  # --quick, --threads: no effect (the projection takes no time)
    parser.add_argument("--s3-gb-per-s", type=float, default=Assumptions.s3_gb_per_s)
    parser.add_argument("--pod-start-s", type=float, default=Assumptions.pod_start_s)
    parser.add_argument("--check-small", action="store_true",
                        help="run one tiny PPO iteration on S3 (moto) and compare its measured bytes per task "
                             "with the formula at its shape (benchmarks/iteration_bytes.py)")
    args = parser.parse_args()
    if args.check_small:
        from benchmarks.iteration_bytes import measure_on_moto, report

        print(report(measure_on_moto()) + "\n")
    a = replace(Assumptions(), s3_gb_per_s=args.s3_gb_per_s, pod_start_s=args.pod_start_s)
    for s in shapes():
        print(table(s, a) + "\n")
    out = rows(a)
    print_rows(out)
    write_rows(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
