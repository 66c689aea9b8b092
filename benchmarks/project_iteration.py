"""A PPO iteration at scale on paper, in both run modes, for the 8B and 70B presets on H100 nodes.

    python benchmarks/project_iteration.py [--mode stateless|resident|both] [--json PATH] [--check-small]

**Stateless** (the default): each task is a fresh pod that reads its state (weights, AdamW's moments) from S3
and writes it back. **Resident** (``run.resident: true``, as the code runs it since #38): the actor trainer (an
elastic torchrun job holding the FSDP2-sharded weights, AdamW state, the reference and the reward model, sharded
on its ranks, computing π_old, π_ref and the rewards as well as the update), the vLLM engine and the critic
trainer stay up for the whole run; each iteration's tasks are thin CPU pods that send requests; scoring runs the
actor's ranks' forwards, then the critic's values (:func:`resident_scoring_seconds`); after each actor update the
new weights go from trainer to engine at the engine's dtype, bucket by bucket (:func:`push_seconds`), while the
critic may still be updating; state reaches storage only at checkpoints, every ``run.save_interval`` iterations,
each rank writing its own shard.

Per preset and mode (:func:`breakdown`): s/iteration split into pod starts, state movement, weight transfer,
generation, scoring, updates and checkpoints, bytes moved (:func:`moved`), beside NeMo-Aligner's and NeMo-RL's
published steps. Every input is an :class:`Assumptions` or :class:`Shape` field whose docstring names its
source (a figure measured here, a peer's published figure, or a hardware spec). With the resident mode, the
tables of its layouts follow (separate, colocated, asynchronous; ``benchmarks/projection_layouts.py``): seconds,
GPUs, tokens/s/GPU and the recommended default per preset, beside NeMo-Aligner, NeMo-RL, veRL and AReaL.

NeMo-Aligner's Llama-2-70B PPO step, 253.8 s on 8 actor + 8 critic nodes of 8 GPUs (Shen et al. 2024,
"NeMo-Aligner: Scalable Toolkit for Efficient Model Alignment", arXiv:2405.01481; the figure as the project's
issue #21 quotes it), keeps every model resident, so it compares with the resident mode, and its layout's
compute terms (:func:`compute_seconds`) with this projection's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.projection_inputs import (LLAMA_8B, LLAMA_8B_FULL, LLAMA_70B, LLAMA_70B_FULL,  # noqa: E402,F401
                                          MEASURED_PUSH_DENSITY, MEASURED_SHARD_SHARE, NEMO_70B, NEMO_ALIGNER_70B_STEP_S, NEMO_RL_8B_STEP_S,
                                          NEMO_RL_8B_TOKENS, PRESETS, Assumptions, Shape, critic_nodes, critic_sharded,
                                          critic_size, llama_params, tokens)
from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

MODES = ("stateless", "resident")
PARTS = ("pod starts", "state movement", "weight transfer", "generation", "scoring", "updates", "checkpoint")
"""The parts of an iteration's seconds (:func:`breakdown`), in the order the tables print them."""
CHAIN = ("rollout", "score", "advantages", "updates", "commit")
"""An iteration's tasks, one after another in both modes (the actor and critic updates side by side)."""
CPU_TASKS = ("advantages", "commit")
"""The tasks of :data:`CHAIN` without a GPU: a CPU pod each in both modes."""


def state_terms(s: Shape) -> Dict[str, Dict[Tuple[str, str], float]]:
    """Bytes each task moves through S3 per stateless iteration by kind, ``{task: {(op, kind): bytes}}``, op
    ``read`` or ``write``, kind ``weights``, ``optimizer`` or ``batch`` (checked against a measured small run by
    ``--check-small``).

    W = params × checkpoint bytes per param, O = params × optimizer bytes per param (the critic's at
    :attr:`Shape.critic_params`: Wc, Oc). Each pod downloads a checkpoint once for all its ranks
    (``models/checkpoint/cache.py``; rank-local loading reads each rank's rows from that copy); every node of
    an update or scoring job does.
      rollout: actor + reference (tokenizer home) = 2W             writes the batch
      score:   per node actor, reference, reward model, critic     writes the scored batch
      actor:   per node actor + reference + O (sharded: O/nodes)   rank 0 writes W + O
      critic:  per node critic + reference (+ Oc when full)        writes Wc + Oc (full) or adapters (LoRA)
    Batches (token ids and float32 columns, ~24 B per token) are read by each scoring and update node.
    """
    w, o = s.params * s.checkpoint_bytes_per_param, s.params * s.optimizer_bytes_per_param
    cp = critic_size(s)
    wc, oc = cp * s.checkpoint_bytes_per_param, cp * s.optimizer_bytes_per_param
    batch = tokens(s) * 24.0
    cn = critic_nodes(s)
    share = MEASURED_SHARD_SHARE * 2  # × ranks = 1: each rank its 1/ranks, so the nodes together read O once
    o_read = lambda cut, nodes, o: share * o if cut else nodes * o  # noqa: E731
    full = not s.critic_lora
    return {
        "rollout": {("read", "weights"): 2 * w, ("write", "batch"): batch},
        "score": {("read", "weights"): s.score_nodes * ((3 if s.reward_model else 2) * w + wc),
                  ("read", "batch"): s.score_nodes * batch, ("write", "batch"): batch},
        "actor_update": {("read", "weights"): s.actor_nodes * 2 * w, ("read", "batch"): s.actor_nodes * batch,
                         ("read", "optimizer"): o_read(s.sharded_state, s.actor_nodes, o), ("write", "weights"): w,
                         ("write", "optimizer"): o},
        "critic_update": {("read", "weights"): cn * (w + wc), ("read", "batch"): cn * batch,
                          ("read", "optimizer"): o_read(critic_sharded(s), cn, oc) if full else 0.0,
                          ("write", "weights"): wc if full else 0.0, ("write", "optimizer"): oc if full else 0.0},
    }


def state_bytes(s: Shape) -> Dict[str, Dict[str, float]]:
    """:func:`state_terms` summed per task and direction, ``{task: {"read", "write"}}``."""
    return {t: {op: sum(b for (o, _), b in terms.items() if o == op) for op in ("read", "write")}
            for t, terms in state_terms(s).items()}


def compute_seconds(s: Shape, a: Assumptions) -> Dict[str, float]:
    """Seconds of GPU work per stateless task: generation at the stated tokens/s, forwards 2·P·tokens FLOPs per
    model (the critic at its own size), updates 6·P·tokens (LoRA critic: 4·P·tokens, no weight gradients) at
    the stated MFU."""
    cp, n = critic_size(s), tokens(s)
    models = (3 if s.reward_model else 2) * s.params + cp  # π_old, π_ref (and the reward model), the critic
    return {
        "rollout": s.samples * s.response_tokens / (a.gen_tokens_per_s_per_gpu * s.gen_speed * s.rollout_gpus),
        "score": 2 * models * n / flops(task_gpus(s)["score"], a.forward_mfu, a),
        "actor_update": 6 * s.params * n / flops(task_gpus(s)["actor_update"], a.train_mfu, a),
        "critic_update": gpu_seconds((4 if s.critic_lora else 6) * cp * n, s.critic_gpus, a.train_mfu, a),
    }


def flops(gpus: int, mfu: float, a: Assumptions) -> float:
    """FLOP/s of ``gpus`` GPUs at ``mfu``."""
    return gpus * a.peak_tflops * 1e12 * mfu


def gpu_seconds(work: float, gpus: int, mfu: float, a: Assumptions) -> float:
    """Seconds of ``work`` FLOPs on ``gpus`` GPUs at ``mfu``; no work takes none (a shape without a critic,
    ``critic_params=0``, ``critic_gpus=0``)."""
    return 0.0 if work == 0 else work / flops(gpus, mfu, a)


def task_gpus(s: Shape) -> Dict[str, int]:
    return {"rollout": s.rollout_gpus, "score": s.score_nodes * s.score_gpus,
            "actor_update": s.actor_nodes * s.gpus_per_node, "critic_update": s.critic_gpus}


def task_nodes(s: Shape) -> Dict[str, int]:
    return {"rollout": max(1, s.rollout_gpus // s.gpus_per_node),
            "score": s.score_nodes * max(1, s.score_gpus // s.gpus_per_node),
            "actor_update": s.actor_nodes, "critic_update": critic_nodes(s)}


def state_seconds(s: Shape, a: Assumptions) -> Dict[str, float]:
    """Seconds moving state per task: each node reads its share in parallel; one writer writes the checkpoint
    (AdamW's moments, when committed per rank, each node its share beside it)."""
    nodes, rate = task_nodes(s), a.s3_gb_per_s * 1e9
    moments = {"actor_update": (s.sharded_state, s.params * s.optimizer_bytes_per_param),
               "critic_update": (critic_sharded(s), critic_size(s) * s.optimizer_bytes_per_param)}
    out = {}
    for t, b in state_bytes(s).items():
        cut, o = moments.get(t, (False, 0.0))
        sharded = cut and b["write"] > 0
        write = (b["write"] - o) / rate + o / (nodes[t] * rate) if sharded else b["write"] / rate
        out[t] = b["read"] / (nodes[t] * rate) + write
    return out


def project(s: Shape, a: Assumptions) -> Dict[str, Dict[str, float]]:
    """The stateless GPU tasks, ``{task: {"start", "state", "compute", "total"}}`` seconds, plus ``"iteration"``
    (the chain's sum; actor and critic updates run side by side, so the longer counts)."""
    comp, move = compute_seconds(s, a), state_seconds(s, a)
    out = {t: {"start": a.pod_start_s, "state": move[t], "compute": comp[t]} for t in comp}
    for v in out.values():
        v["total"] = v["start"] + v["state"] + v["compute"]
    chain = [out["rollout"], out["score"], out[longer_update(out)]]
    out["iteration"] = {k: sum(c[k] for c in chain) for k in ("start", "state", "compute", "total")}
    return out


def longer_update(tasks: Dict[str, Dict[str, float]]) -> str:
    return max(("actor_update", "critic_update"), key=lambda t: tasks[t]["total"])


def resident_scoring_seconds(s: Shape, a: Assumptions) -> Dict[str, float]:
    """Resident scoring, one after the other as ``ActorHost.score`` runs them (``models/hosts/trainers.py``):
    π_old, π_ref and the reward model on the actor trainer's ranks (each rank its share of the rows, the
    models sharded there), then the critic trainer's values on its own GPUs."""
    n = tokens(s)
    models = (3 if s.reward_model else 2) * s.params
    return {"actor": 2 * models * n / flops(s.actor_nodes * s.gpus_per_node, a.forward_mfu, a),
            "critic": gpu_seconds(2 * critic_size(s) * n, s.critic_gpus, a.forward_mfu, a)}


def push_seconds(s: Shape, a: Assumptions) -> Dict[str, float]:
    """The push after each actor update (``models/hosts/pushes.py``), bucket by bucket, each step after the one
    before (the trainer gathers a bucket once the last is sent, the engine loads one before it takes the next).
    B = parameters × the engine's bytes: every rank casts its rows to the engine's dtype before they travel; a
    delta push (``push_density`` < 1) moves the changed elements only, :func:`push_share` of B.

      gather:    each tensor's rows into the trainer's rank 0: the node's own over NVLink, other nodes' over
                 rank 0's NIC (at the broadcast's rate)
      broadcast: rank 0 → the engine over NCCL
      load:      in place on each engine GPU (nothing at these rates): a tensor-parallel engine's workers each
                 receive their own share of every bucket (``models/engines/worker_channel.py``; the shares add up
                 to B, a delta is broadcast once), so nothing goes through host memory"""
    b, world = s.params * s.engine_bytes_per_param * push_share(s), s.actor_nodes * s.gpus_per_node
    remote = (world - s.gpus_per_node) / world
    local = (s.gpus_per_node - 1) / world
    return {"gather": b * remote / (a.nccl_gb_per_s * 1e9) + b * local / (a.nvlink_gb_per_s * 1e9),
            "broadcast": b / (a.nccl_gb_per_s * 1e9), "load": 0.0}


def push_share(s: Shape) -> float:
    """The share of the full push's bytes a push moves: ``min(1, density × (1 + v) / e + 1 / (256 e))`` (BLOCK8 of
    ``models/engines/weight_delta.py``: a byte per block of 256 elements and a byte of position per changed element,
    then ``v`` bytes of value: a 2-byte engine's as STEP8 steps of its bits, one byte each, as
    ``benchmarks/bench_delta_push.py`` measures them; a wider one's raw, ``e`` bytes)."""
    e = s.engine_bytes_per_param
    v = 1 if e == 2 else e
    return min(1.0, s.push_density * (1 + v) / e + 1 / (256 * e))


def checkpoint_bytes(s: Shape) -> Dict[str, float]:
    """A resident checkpoint: the actor's W + O, and the full critic's Wc + Oc (a LoRA critic's adapters:
    nothing at this scale)."""
    cp = critic_size(s)
    per_param = s.checkpoint_bytes_per_param + s.optimizer_bytes_per_param
    return {"actor": s.params * per_param, "critic": 0.0 if s.critic_lora else cp * per_param}


def checkpoint_seconds(s: Shape, a: Assumptions) -> float:
    """One resident checkpoint: every rank writes its shard, so each node its share in parallel; the two
    trainers at once."""
    b, rate = checkpoint_bytes(s), a.s3_gb_per_s * 1e9
    return max(b["actor"] / (s.actor_nodes * rate), b["critic"] / (critic_nodes(s) * rate))


def breakdown(s: Shape, a: Assumptions, mode: str) -> Dict[str, float]:
    """Seconds per iteration by :data:`PARTS`, and ``"total"``, in ``mode`` (``stateless`` or ``resident``).

    Both modes run :data:`CHAIN`; evaluation (every ``run.eval_interval``) is left out of both.
    Stateless: :func:`project`'s GPU pods, vLLM's start in the rollout pod and the CPU pods of
    :data:`CPU_TASKS`; state moves every iteration (its checkpoint is that state), no weight transfer.
    Resident: a thin pod per task, batches only through storage, scoring (:func:`resident_scoring_seconds`,
    the actor's ranks then the critic's) and checkpoints (:func:`checkpoint_seconds` / ``save_interval``) on
    the services' ranks; the actor's update and then its push (:func:`push_seconds`) beside the critic's update:
    ``weight transfer`` is what the push adds to the longer of the two."""
    check_mode(mode)
    comp = compute_seconds(s, a)
    if mode == "stateless":
        p = project(s, a)
        parts = {"pod starts": p["iteration"]["start"] + a.engine_start_s + len(CPU_TASKS) * a.cpu_pod_start_s,
                 "state movement": p["iteration"]["state"], "weight transfer": 0.0,
                 "scoring": comp["score"], "updates": comp[longer_update(p)], "checkpoint": 0.0}
    else:
        updates = max(comp["actor_update"], comp["critic_update"])
        actor_branch = comp["actor_update"] + sum(push_seconds(s, a).values())
        parts = {"pod starts": len(CHAIN) * a.thin_pod_start_s,
                 "state movement": batch_bytes(s) / (a.s3_gb_per_s * 1e9),
                 "weight transfer": max(actor_branch, comp["critic_update"]) - updates,
                 "scoring": sum(resident_scoring_seconds(s, a).values()), "updates": updates,
                 "checkpoint": checkpoint_seconds(s, a) / s.save_interval}
    parts["generation"] = comp["rollout"]
    out = {k: parts[k] for k in PARTS}
    out["total"] = sum(out.values())
    return out


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")


def batch_bytes(s: Shape) -> float:
    """Batch bytes of a resident iteration: the batches the stateless tasks move (:func:`state_terms`), which
    the services read and write through storage as the tasks did; the one thing a resident iteration moves
    there between checkpoints."""
    return sum(b for terms in state_terms(s).values() for (_, kind), b in terms.items() if kind == "batch")


def moved(s: Shape, mode: str) -> Dict[str, float]:
    """Bytes per iteration: ``storage`` in all, ``state`` (weights and AdamW's moments between checkpoints),
    ``checkpoint`` (a resident checkpoint's bytes / ``save_interval``; stateless: every iteration's state is
    its checkpoint) and ``in memory`` (trainer → engine over NCCL)."""
    if mode == "stateless":
        terms = [(k, b) for t in state_terms(s).values() for (_, k), b in t.items()]
        state = sum(b for k, b in terms if k != "batch")
        return {"storage": sum(b for _, b in terms), "state": state, "checkpoint": 0.0, "in memory": 0.0}
    check_mode(mode)
    ckpt = sum(checkpoint_bytes(s).values()) / s.save_interval
    return {"storage": batch_bytes(s) + ckpt, "state": 0.0, "checkpoint": ckpt,
            "in memory": s.params * s.engine_bytes_per_param}


def gpus_held(s: Shape, a: Assumptions, mode: str) -> float:
    """GPU-seconds an iteration holds: stateless, each GPU pod for its own seconds; resident, every service's
    GPUs (engine, actor with the reward model, critic) for the whole iteration."""
    if mode == "stateless":
        p, gpus = project(s, a), task_gpus(s)
        return sum(gpus[t] * p[t]["total"] for t in gpus) + s.rollout_gpus * a.engine_start_s
    held = s.rollout_gpus + s.actor_nodes * s.gpus_per_node + s.critic_gpus
    return held * breakdown(s, a, mode)["total"]


def actor_load_host_bytes(s: Shape) -> Tuple[float, float]:
    """Host memory per node to load the float32 actor: rank-local (``models/training/sharded_load.py``: the
    node's share, W / nodes; measured 0.46-0.47 of the whole load per rank at 2 ranks) and whole (every rank
    the whole W, as before)."""
    w = s.params * s.checkpoint_bytes_per_param
    return w / s.actor_nodes, s.gpus_per_node * w


def table(s: Shape, a: Assumptions) -> str:
    """The stateless GPU tasks of :func:`project`, one line each, with the bytes each moves."""
    p = project(s, a)
    lines = [f"{s.name}, stateless, per task: S3 {a.s3_gb_per_s:g} GB/s per node, pod start {a.pod_start_s:g} s, "
             f"MFU {a.train_mfu:g}",
             f"  {'task':14s} {'start s':>8s} {'state s':>8s} {'compute s':>10s} {'total s':>8s} {'GB moved':>9s}"]
    moved_by_task = state_bytes(s)
    for t, v in p.items():
        b = moved_by_task[t] if t in moved_by_task else {"all": sum(sum(x.values()) for x in moved_by_task.values())}
        lines.append(f"  {t:14s} {v['start']:8.0f} {v['state']:8.0f} {v['compute']:10.0f} {v['total']:8.0f} "
                     f"{sum(b.values()) / 1e9:9.0f}")
    return "\n".join(lines)


def line(label: str, values: Sequence[float]) -> str:
    """A table line: the label, then each value (0 as ``0``, under 10 with two decimals, else one)."""
    return f"  {label:34s}" + "".join(f"{'0' if v == 0 else f'{v:.{2 if v < 10 else 1}f}':>11s}" for v in values)


def mode_table(s: Shape, a: Assumptions, modes: Sequence[str]) -> str:
    """One preset's iteration by part in each of ``modes``, bytes moved and GPU time, one column a mode."""
    critic = f"{'LoRA' if s.critic_lora else 'full'} critic on {s.critic_gpus}"
    lines = [f"{s.name}: {s.params / 1e9:.1f}B, {s.samples} responses × {s.response_tokens} tokens "
             f"({tokens(s) / 1e6:.2f}M tokens), actor {s.actor_nodes}×{s.gpus_per_node} GPUs, "
             f"engine {s.rollout_gpus}, score {s.score_nodes}×{s.score_gpus}, {critic}, "
             f"save_interval {s.save_interval}",
             f"  {'seconds per iteration':34s}" + "".join(f"{m:>11s}" for m in modes)]
    parts = {m: breakdown(s, a, m) for m in modes}
    lines += [line(k, [parts[m][k] for m in modes]) for k in (*PARTS, "total")]
    b = {m: moved(s, m) for m in modes}
    lines += [line(label, [b[m][k] / 1e9 for m in modes]) for k, label in (
        ("storage", "GB through storage"), ("state", "  of which weights + AdamW state"),
        ("checkpoint", "  of which checkpoint (amortised)"), ("in memory", "GB trainer → engine (NCCL)"))]
    lines.append(line("GPU·h per iteration", [gpus_held(s, a, m) / 3600 for m in modes]))
    if "resident" in modes:
        push = push_seconds(s, a)
        lines.append(f"  push after each actor update: {sum(push.values()):.1f} s (" +
                     ", ".join(f"{k} {v:.1f}" for k, v in push.items()) +
                     f"), {s.params * s.engine_bytes_per_param / 1e9:.0f} GB at {s.engine_bytes_per_param} B/parameter; "
                     f"the engine holds {2 * s.push_bucket_bytes / 2**30:.1f} GiB of it at most (2 buckets); "
                     f"a delta push at the measured density {MEASURED_PUSH_DENSITY:g} (benchmarks/bench_delta_push.py): "
                     f"{sum(push_seconds(replace(s, push_density=MEASURED_PUSH_DENSITY), a).values()):.1f} s")
    local, whole = actor_load_host_bytes(s)
    lines.append(f"  actor load, host memory per node: {local / 1e9:.0f} GB rank-local ({whole / 1e9:.0f} GB with the "
                 f"whole model on each rank); S3 bytes the same (each node downloads whole checkpoints)")
    return "\n".join(lines)


def assumptions_text(a: Assumptions) -> str:
    """The inputs as printed above the tables (their sources: the :class:`Assumptions` docstrings)."""
    return (f"assumptions (each with its source: benchmarks/projection_inputs.py, Assumptions): "
            f"GPU pod start {a.pod_start_s:g} s, vLLM start {a.engine_start_s:g} s, CPU pod {a.cpu_pod_start_s:g} s, "
            f"thin pod {a.thin_pod_start_s:g} s, "
            f"S3 {a.s3_gb_per_s:g} GB/s per node, NCCL trainer → engine {a.nccl_gb_per_s:g} GB/s, "
            f"NVLink into a GPU {a.nvlink_gb_per_s:g} GB/s, "
            f"{a.peak_tflops:g} TFLOP/s bf16 peak, MFU {a.train_mfu:g} updates / {a.forward_mfu:g} scoring, "
            f"vLLM {a.gen_tokens_per_s_per_gpu:g} tokens/s per GPU at 8B")


def peer_rows(a: Assumptions, modes: Sequence[str]) -> List[Row]:
    """Each mode's 70B full-critic iteration against NeMo-Aligner's step, and the 8B LoRA-critic one per
    million tokens against NeMo-RL's (a GRPO step: no critic, 2048 sequences on 16 GPUs)."""
    out = []
    for m in modes:
        big, small = breakdown(LLAMA_70B_FULL, a, m)["total"], breakdown(LLAMA_8B, a, m)["total"]
        out.append(row("projection", f"70B full critic {m} / NeMo-Aligner step", big / NEMO_ALIGNER_70B_STEP_S, "x",
                       f"{big:.0f} s vs {NEMO_ALIGNER_70B_STEP_S} s published (Llama-2-70B PPO, 8+8 nodes, resident)"))
        per_m, peer = small / tokens(LLAMA_8B) * 1e6, NEMO_RL_8B_STEP_S / NEMO_RL_8B_TOKENS * 1e6
        out.append(row("projection", f"8B {m} / NeMo-RL, s per 1M tokens", per_m / peer, "x",
                       f"{small:.0f} s for {tokens(LLAMA_8B) / 1e6:.2f}M tokens vs {NEMO_RL_8B_STEP_S} s for "
                       f"{NEMO_RL_8B_TOKENS / 1e6:.2f}M (Llama-3.1-8B GRPO, 16 H100s, NeMo RL v0.5)"))
    return out


def rows(a: Assumptions, modes: Sequence[str] = MODES) -> List[Row]:
    out = []
    for s in PRESETS:
        for m in modes:
            p, b = breakdown(s, a, m), moved(s, m)
            out.append(row("projection", f"{s.name} s/iteration ({m})", p["total"], "s",
                           ", ".join(f"{k} {p[k]:.0f}" for k in PARTS) + f"; {b['storage'] / 1e9:.0f} GB stored"))
    out += peer_rows(a, modes)
    if "resident" in modes:
        from benchmarks.projection_layouts import layout_rows  # imports this module

        out += layout_rows(a)
    out.append(row("projection", "AdamW bytes a rank reads, sharded / whole (2 ranks, measured)",
                   MEASURED_SHARD_SHARE, "x", "tests/unit/models/test_optimizer_shards.py through S3 (moto)"))
    nemo = project(NEMO_70B, a)["iteration"]["compute"]
    out.append(row("projection", "70B compute terms / NeMo-Aligner step", nemo / NEMO_ALIGNER_70B_STEP_S, "x",
                   f"{nemo:.0f} s projected vs {NEMO_ALIGNER_70B_STEP_S} s published (models resident; "
                   f"their rollout runs on the actor's 64 GPUs, this shape's on 8)"))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)  # --quick, --threads: no effect (the projection takes no time)
    parser.add_argument("--mode", choices=("stateless", "resident", "both"), default="both",
                        help="the run mode(s) to project (default: both, side by side)")
    parser.add_argument("--s3-gb-per-s", type=float, default=Assumptions.s3_gb_per_s)
    parser.add_argument("--pod-start-s", type=float, default=Assumptions.pod_start_s)
    parser.add_argument("--nccl-gb-per-s", type=float, default=Assumptions.nccl_gb_per_s)
    parser.add_argument("--check-small", action="store_true",
                        help="run one tiny PPO iteration on S3 (moto) and compare its measured bytes per task "
                             "with the formula at its shape (benchmarks/iteration_bytes.py)")
    args = parser.parse_args(argv)
    if args.check_small:
        from benchmarks.iteration_bytes import measure_on_moto, report

        print(report(measure_on_moto()) + "\n")
    a = replace(Assumptions(), s3_gb_per_s=args.s3_gb_per_s, pod_start_s=args.pod_start_s,
                nccl_gb_per_s=args.nccl_gb_per_s)
    modes = MODES if args.mode == "both" else (args.mode,)
    print(assumptions_text(a) + "\n")
    for s in PRESETS:
        print(mode_table(s, a, modes) + "\n")
        if "stateless" in modes:
            print(table(s, a) + "\n")
    if "resident" in modes:
        from benchmarks.projection_layouts import GRPO_8B, layout_tables  # imports this module

        print(layout_tables(a, (*PRESETS, GRPO_8B)) + "\n")
    out = rows(a, modes)
    print_rows(out)
    write_rows(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
