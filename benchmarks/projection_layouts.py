"""The resident layouts on paper (issues #39 and #40): the engine on its own GPUs (``separate``, as the resident
mode runs since #38), the engine inside the actor trainer's ranks (``colocated``), and the separate layout trained
asynchronously with a staleness bound k >= 1 (``async``), for every GPU preset, beside NeMo-Aligner, NeMo-RL, veRL
and AReaL. ``benchmarks/project_iteration.py`` prints it; every input is an :class:`Assumptions` or
:class:`Shape` field, or a peer's figure in ``benchmarks/projection_inputs.py``, each with its source.

**Colocated** (veRL's hybrid engine, NeMo-RL's colocated mode): every actor rank also holds a vLLM engine, in
tensor-parallel groups of ``rollout.tensor_parallel_size``, so generation is data-parallel over all the actor's
GPUs; the engine sleeps (weights discarded, KV cache freed) while the trainer scores and updates, wakes after the
actor's update and loads the new weights in process (:func:`inprocess_load_seconds`): nothing crosses between
processes and there is no engine GPU. Generation does not overlap training. The critic trainer is unchanged.

**Async** (``run.max_staleness`` k >= 1, separate layout): the engine generates the next batch while the trainer
scores and updates, so an iteration is the longer of generation and the trainer's side, plus the whole push
(:func:`async_breakdown`). Steady state is the same for every k >= 1; a larger k only absorbs the variance of
generation times, which this projection does not model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

from benchmarks.project_iteration import PARTS, breakdown, compute_seconds, line, push_seconds
from benchmarks.projection_inputs import (AREAL_SPEEDUP, LLAMA_8B, LLAMA_8B_GRPO, NEMO_70B, NEMO_ALIGNER_70B_GPUS,
                                          NEMO_ALIGNER_70B_STEP_S, NEMO_RL_8B_GPUS, NEMO_RL_8B_STEP_S,
                                          NEMO_RL_8B_TOKENS, NEMO_RL_V04_8B_STEP_S, NEMO_RL_V04_32B, PRESETS,
                                          VERL_ASYNC_128_STEP_S, Assumptions, Shape, tokens)
from benchmarks.projection_memory import memory_line
from benchmarks.rows import Row, row

LAYOUTS = ("separate", "colocated", "async")
"""The layouts of a resident run, in the order the tables print them."""
SYNC_LAYOUTS = ("separate", "colocated")
"""The on-policy layouts (k = 0), among which :func:`recommend` picks the default."""
LAYOUT_PARTS = (*PARTS, "sleep and wake", "overlap")
""":data:`PARTS` plus the colocated engine's sleep and wake and the seconds async training hides (negative)."""
GRPO_8B = LLAMA_8B_GRPO
"""The 8B GRPO preset, the shape NeMo-RL's GRPO step has: no critic, no reward model (a reward function), only
π_old and π_ref scored and the actor updated, on the actor's 8 GPUs."""


def inprocess_load_seconds(s: Shape, a: Assumptions) -> Dict[str, float]:
    """The colocated engine's load after each actor update, layer by layer in process, at the engine's dtype.
    Each rank gathers the layer's FSDP2 shards (every rank receives the whole layer, all ranks at once: its node's
    rows over NVLink, other nodes' over its own NIC) and copies its tensor-parallel slice into the engine's
    buffers (read and write in HBM). B = params × engine bytes, W = actor GPUs, g = GPUs per node, t = tensor
    parallel size:

      gather: B·(W − g)/W / NIC + B·(g − 1)/W / NVLink
      copy:   2·B/t / HBM"""
    b, world, g = s.params * s.engine_bytes_per_param, s.actor_nodes * s.gpus_per_node, s.gpus_per_node
    remote, local = b * (world - g) / world, b * (g - 1) / world
    return {"gather": remote / (a.nccl_gb_per_s * 1e9) + local / (a.nvlink_gb_per_s * 1e9),
            "copy": 2 * b / s.rollout_gpus / (a.hbm_gb_per_s * 1e9)}


def colocated_generation_seconds(s: Shape, a: Assumptions) -> float:
    """Generation data-parallel over all the actor's GPUs (tensor-parallel groups of :attr:`Shape.rollout_gpus`),
    at the per-GPU rate of :func:`compute_seconds`: responses × tokens / (rate × speed × actor GPUs). Each
    group decodes a smaller batch than one engine does, 64 sequences at 8B and 128 per 70B group; the rate still
    holds there. A decode step reads the weights and the batch's KV cache from 3.35 TB/s HBM:
      8B:  16 GB + at most 13 GB (64 × 1536 tokens × 128 KiB), 4.8-8.6 ms: 7,400-13,000 tokens/s per GPU
           against the assumed 2500;
      70B: per GPU 17.6 GB + at most 8 GB (128 × 1536 × 320 KiB / 8), 5.3-7.7 ms: 2,100-3,000 tokens/s per GPU
           against the assumed 625."""
    world = s.actor_nodes * s.gpus_per_node
    return s.samples * s.response_tokens / (a.gen_tokens_per_s_per_gpu * s.gen_speed * world)


def colocated_breakdown(s: Shape, a: Assumptions) -> Dict[str, float]:
    """Seconds per iteration by :data:`LAYOUT_PARTS` and ``"total"``, colocated. As the separate resident
    iteration (:func:`breakdown`), except: generation on the actor's GPUs (:func:`colocated_generation_seconds`),
    the engine's sleep after it (before scoring: the trainer needs the memory), and after the actor's update its
    wake and in-process load (:func:`inprocess_load_seconds`) beside the critic's update, so only what outlasts
    the critic's update counts; no push."""
    p = dict(breakdown(s, a, "resident"))
    comp = compute_seconds(s, a)
    updates = max(comp["actor_update"], comp["critic_update"])
    load = sum(inprocess_load_seconds(s, a).values())
    extra = max(comp["actor_update"] + a.engine_wake_s + load, comp["critic_update"]) - updates
    wake = min(a.engine_wake_s, extra)
    p.update({"generation": colocated_generation_seconds(s, a), "weight transfer": extra - wake,
              "sleep and wake": a.engine_sleep_s + wake, "overlap": 0.0})
    return totalled(p)


def async_breakdown(s: Shape, a: Assumptions) -> Dict[str, float]:
    """Seconds per iteration, separate layout trained asynchronously (k >= 1): max(generation, trainer side) +
    the whole push, with trainer side = pod starts + state movement + scoring + updates + checkpoint (the
    rollout task takes a finished batch). The push (:func:`push_seconds`) is counted whole on the critical path:
    the engine pauses for its load and the trainer waits for its gather. ``overlap`` is what is hidden,
    −min(generation, trainer side)."""
    p = dict(breakdown(s, a, "resident"))
    trainer = sum(p[k] for k in ("pod starts", "state movement", "scoring", "updates", "checkpoint"))
    p.update({"weight transfer": sum(push_seconds(s, a).values()), "sleep and wake": 0.0,
              "overlap": -min(p["generation"], trainer)})
    return totalled(p)


def totalled(p: Dict[str, float]) -> Dict[str, float]:
    out = {k: p.get(k, 0.0) for k in LAYOUT_PARTS}
    out["total"] = sum(out.values())
    return out


def layout_breakdown(s: Shape, a: Assumptions, layout: str) -> Dict[str, float]:
    """:data:`LAYOUT_PARTS` and ``"total"`` of ``layout`` (one of :data:`LAYOUTS`)."""
    if layout == "separate":
        return totalled(breakdown(s, a, "resident"))
    if layout == "colocated":
        return colocated_breakdown(s, a)
    if layout == "async":
        return async_breakdown(s, a)
    raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")


def layout_gpus(s: Shape, layout: str) -> int:
    """GPUs a resident run holds: the actor's and the critic's, and the engine's unless colocated."""
    engine = 0 if layout == "colocated" else s.rollout_gpus
    return engine + s.actor_nodes * s.gpus_per_node + s.critic_gpus


def tokens_per_s_per_gpu(s: Shape, seconds: float, gpus: int) -> float:
    """Tokens of an iteration (prompts and responses) / (seconds × GPUs): NeMo-RL's tokens/s/GPU."""
    return tokens(s) / (seconds * gpus)


def recommend(s: Shape, a: Assumptions) -> str:
    """The default layout of a preset: of the on-policy layouts (:data:`SYNC_LAYOUTS`), the one holding the
    fewest GPU-hours per iteration (GPUs × seconds), the cost of the same work."""
    return min(SYNC_LAYOUTS, key=lambda m: layout_gpus(s, m) * layout_breakdown(s, a, m)["total"])


def colocated_memory_gb(s: Shape) -> Dict[str, float]:
    """GB per GPU that stay while a colocated rank generates: the trainer's shard of the float32 weights and AdamW's
    moments (checkpoint + optimizer bytes per parameter), of π_ref and the reward model (float32, as the actor's
    ranks hold them), over the actor's GPUs; the engine's weights at its dtype over its tensor-parallel group. The
    rest of an 80-GB H100 is for the KV cache and the engine's activations."""
    world = s.actor_nodes * s.gpus_per_node
    frozen = (2 if s.reward_model else 1) * s.params * s.checkpoint_bytes_per_param
    trainer = (s.params * (s.checkpoint_bytes_per_param + s.optimizer_bytes_per_param) + frozen) / world
    return {"trainer": trainer / 1e9, "engine": s.params * s.engine_bytes_per_param / s.rollout_gpus / 1e9}


def balanced_async(s: Shape, a: Assumptions) -> Tuple[int, float]:
    """The fewest engine GPUs (a multiple of the tensor-parallel size, at most the actor's GPUs) whose generation
    is no longer than the trainer's side of an async iteration, as NeMo-RL and veRL size theirs, and that
    iteration's seconds."""
    n = s.rollout_gpus
    while True:
        t = async_breakdown(replace(s, rollout_gpus=n), a)
        if t["generation"] <= -t["overlap"] or n >= s.actor_nodes * s.gpus_per_node:
            return n, t["total"]
        n += s.rollout_gpus


def layout_table(s: Shape, a: Assumptions) -> str:
    """One preset's iteration by part in each of :data:`LAYOUTS`, its GPUs, tokens/s/GPU and GPU-hours, the
    in-process load and the push, and the recommended default."""
    parts = {m: layout_breakdown(s, a, m) for m in LAYOUTS}
    groups = s.actor_nodes * s.gpus_per_node // s.rollout_gpus
    lines = [f"{s.name}: resident layouts; separate: engine on {s.rollout_gpus} GPU(s) of its own; colocated: "
             f"{groups} engines of tensor parallel {s.rollout_gpus} in the actor's ranks; async: separate, k >= 1",
             f"  {'seconds per iteration':34s}" + "".join(f"{m:>11s}" for m in LAYOUTS)]
    lines += [line(k, [parts[m][k] for m in LAYOUTS]) for k in (*LAYOUT_PARTS, "total")]
    gpus = {m: layout_gpus(s, m) for m in LAYOUTS}
    lines.append(line("GPUs", [gpus[m] for m in LAYOUTS]))
    lines.append(line("tokens/s/GPU", [tokens_per_s_per_gpu(s, parts[m]["total"], gpus[m]) for m in LAYOUTS]))
    lines.append(line("GPU·h per iteration", [gpus[m] * parts[m]["total"] / 3600 for m in LAYOUTS]))
    load, push = inprocess_load_seconds(s, a), push_seconds(s, a)
    lines.append(f"  colocated load after each actor update: {sum(load.values()):.2f} s in process (gather "
                 f"{load['gather']:.2f}, copy {load['copy']:.3f}), 0 bytes between processes; sleep "
                 f"{a.engine_sleep_s:g} s, wake {a.engine_wake_s:g} s; separate push {sum(push.values()):.1f} s")
    mem = colocated_memory_gb(s)
    lines.append(f"  colocated GPU memory while generating: trainer {mem['trainer']:.1f} GB + engine weights "
                 f"{mem['engine']:.1f} GB per GPU; the rest of 80 GB for the KV cache")
    if s.dims is not None:
        lines.append(memory_line(s))
    n, t = balanced_async(s, a)
    lines.append(f"  async with the engine sized to the trainer's side: {n} engine GPUs, {t:.1f} s, "
                 f"{tokens_per_s_per_gpu(s, t, layout_gpus(s, 'async') - s.rollout_gpus + n):.0f} tokens/s/GPU")
    lines.append(f"  recommended default: {recommend(s, a)} (fewest GPU·h per iteration on-policy)")
    return "\n".join(lines)


def nemo_rl_per_gpu() -> float:
    """NeMo-RL's 8B GRPO step in tokens/s/GPU: 2.09M tokens / (92.8 s × 16 GPUs)."""
    return NEMO_RL_8B_TOKENS / (NEMO_RL_8B_STEP_S * NEMO_RL_8B_GPUS)


def bar_rows(a: Assumptions) -> List[Row]:
    """Issue #39's bars: the 70B full-critic iteration colocated at most 200 s (beside NeMo-Aligner's 253.8 s and
    per GPU), and each 8B shape's tokens/s/GPU within 1.5× of NeMo-RL's; each 8B miss says the seconds that
    would meet it on the same GPUs."""
    big = PRESETS[-1]
    t = layout_breakdown(big, a, "colocated")["total"]
    ours, theirs = tokens_per_s_per_gpu(big, t, layout_gpus(big, "colocated")), tokens_per_s_per_gpu(
        NEMO_70B, NEMO_ALIGNER_70B_STEP_S, NEMO_ALIGNER_70B_GPUS)
    out = [row("layouts", f"{big.name} colocated s/iteration", t, "s",
               f"NeMo-Aligner {NEMO_ALIGNER_70B_STEP_S} s ({t / NEMO_ALIGNER_70B_STEP_S:.2f}x); per GPU {ours:.0f} "
               f"vs {theirs:.0f} tokens/s/GPU on {NEMO_ALIGNER_70B_GPUS} GPUs each", at_most=200)]
    peer = nemo_rl_per_gpu()
    for s in (*PRESETS[:2], GRPO_8B):
        t, g = layout_breakdown(s, a, "colocated")["total"], layout_gpus(s, "colocated")
        need = tokens(s) / (peer / 1.5 * g)
        out.append(row("layouts", f"NeMo-RL tokens/s/GPU / {s.name} colocated", peer / tokens_per_s_per_gpu(s, t, g),
                       "x", f"{peer:.0f} vs {tokens_per_s_per_gpu(s, t, g):.0f} tokens/s/GPU; {t:.0f} s on {g} GPUs, "
                       f"1.5x needs <= {need:.0f} s", at_most=1.5))
    return out


def async_rows(a: Assumptions) -> List[Row]:
    """Async (k >= 1) against the on-policy layouts per preset, and the peers' published async speed-ups, whose
    on-policy baselines are colocated."""
    out = []
    for s in PRESETS:
        t = {m: layout_breakdown(s, a, m)["total"] for m in LAYOUTS}
        out.append(row("layouts", f"{s.name} async / separate", t["async"] / t["separate"], "x",
                       f"{t['async']:.0f} s vs {t['separate']:.0f} s; async / colocated "
                       f"{t['async'] / t['colocated']:.2f}x ({t['colocated']:.0f} s, {layout_gpus(s, 'colocated')} "
                       f"vs {layout_gpus(s, 'async')} GPUs)"))
    on, off = NEMO_RL_V04_8B_STEP_S
    out.append(row("layouts", "NeMo-RL 8B one-step-off / on-policy (published)", off / on, "x",
                   f"{on} -> {off} s, 16 H100s: on-policy colocated, async 8 generating + 8 training (NeMo RL v0.4)"))
    (on, on_gpus, on_rate), (off, off_gpus, off_rate) = NEMO_RL_V04_32B
    out.append(row("layouts", "NeMo-RL 32B one-step-off / on-policy tokens/s/GPU (published)", off_rate / on_rate,
                   "x", f"{on:g} s on {on_gpus} H100s -> {off:g} s on {off_gpus}, {on_rate:g} -> {off_rate:g} "
                   f"tokens/s/GPU (Qwen3-32B, NeMo RL v0.4)"))
    sync, fully = VERL_ASYNC_128_STEP_S
    out.append(row("layouts", "veRL fully async / colocated sync (published)", fully / sync, "x",
                   f"{sync} -> {fully} s, Qwen2.5-Math-7B on 128 H20s (64+64 async), 2.35-2.67x"))
    out.append(row("layouts", "AReaL async / sync (published)", 1 / AREAL_SPEEDUP, "x",
                   f"up to {AREAL_SPEEDUP}x on the same GPUs (arXiv:2505.24298)"))
    return out


def layout_rows(a: Assumptions) -> List[Row]:
    """Per preset and layout the s/iteration, the recommended layout, then :func:`bar_rows` and
    :func:`async_rows`."""
    out = []
    for s in PRESETS:
        for m in LAYOUTS:
            p, g = layout_breakdown(s, a, m), layout_gpus(s, m)
            out.append(row("layouts", f"{s.name} s/iteration ({m})", p["total"], "s",
                           f"{g} GPUs, {tokens_per_s_per_gpu(s, p['total'], g):.0f} tokens/s/GPU; " +
                           ", ".join(f"{k} {p[k]:.{0 if abs(p[k]) >= 10 else 1}f}" for k in LAYOUT_PARTS if p[k])))
        h = {m: layout_gpus(s, m) * layout_breakdown(s, a, m)["total"] / 3600 for m in SYNC_LAYOUTS}
        out.append(row("layouts", f"{s.name} GPU·h colocated / separate", h["colocated"] / h["separate"], "x",
                       f"recommended: {recommend(s, a)} ({h['colocated']:.2f} vs {h['separate']:.2f} GPU·h per "
                       f"iteration)"))
    return out + bar_rows(a) + async_rows(a)


def summary_table(a: Assumptions, shapes: Sequence[Shape] = PRESETS) -> str:
    """One line a preset: each layout's seconds per iteration and GPUs, and the recommended default
    (:func:`recommend`), the column the runtime's default layout follows."""
    lines = ["resident layouts: s/iteration (GPUs) and the recommended default",
             f"  {'preset':34s}" + "".join(f"{m:>16s}" for m in LAYOUTS) + f"{'recommended':>14s}"]
    for s in shapes:
        cells = [f"{layout_breakdown(s, a, m)['total']:.0f} ({layout_gpus(s, m)})" for m in LAYOUTS]
        lines.append(f"  {s.name:34s}" + "".join(f"{c:>16s}" for c in cells) + f"{recommend(s, a):>14s}")
    return "\n".join(lines)


def layout_tables(a: Assumptions, shapes: Sequence[Shape] = PRESETS) -> str:
    """:func:`layout_table` for each of ``shapes``, then :func:`summary_table`."""
    return "\n\n".join([*(layout_table(s, a) for s in shapes), summary_table(a, shapes)])
