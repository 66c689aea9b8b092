"""Rank-local loading against the whole-model load: peak host memory per rank of an FSDP2 actor's load.

Two ranks (gloo, CPU) load the same checkpoint (a random Llama, 8 layers x 1024 hidden, MLP 2816,
vocabulary 32000, untied head: 168M parameters, 642 MiB in float32; ``--quick``: 4 x 512, 8000, 80 MiB),
saved in float32 (as the run commits it) and in bfloat16 (as hub checkpoints ship), into float32
``PolicyLogprobs`` under FSDP2:

- **whole**: today's path for a model that does not take the sharded one: every rank
  ``from_pretrained``'s the whole checkpoint, then ``fully_shard`` keeps its shard
  (``models.training.lora.load_pretrained`` + ``wrap_for_training``);
- **sharded**: ``models.training.sharded_load.load_sharded``: the model built on the meta device,
  sharded, then each rank reads its rows of every weight out of the safetensors file.

and the same two for a LoRA actor's first load (a fresh rank-16 adapter on every projection, the base
frozen in float32): **whole** ``load_pretrained`` + ``with_adapter`` + ``wrap_for_training``, against
**sharded** ``models.training.sharded_load.load_sharded_lora`` (the base read by shard, the adapter
made whole on every rank and each keeping its rows).

Each side runs in its own pair of fresh processes. A rank reports the rise of its resident-set
high-water mark over the load alone: with torch, transformers and the process group in, it resets the
mark to the present resident set (``echo 5 > /proc/self/clear_refs``), loads, and reports the mark
(``VmHWM`` of ``/proc/self/status``) minus the resident set before. ``getrusage``'s ``ru_maxrss`` is
the same mark but keeps the peak the imports left behind, which hides the load's (both sides then
read the same). Every page the load touches counts, the checkpoint's memory-mapped pages included.
The issue's target: the sharded load's rise per rank at most ``1/ranks + 10%`` of the whole load's
(0.6 on two ranks).

    python benchmarks/bench_sharded_load.py [--quick] [--threads N] [--json rows.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.rows import add_bench_args, print_rows, row, write_rows  # noqa: E402

SECTION = "sharded_load"
RANKS = 2


def build_checkpoint(out: str, quick: bool, dtype: str = "float32") -> int:
    """A random Llama saved as safetensors in ``dtype`` in ``out``; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, mlp, vocab = (512, 4, 1408, 8000) if quick else (1024, 8, 2816, 32000)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         tie_word_embeddings=False, max_position_embeddings=512)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _status_kib(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


LORA = SimpleNamespace(rank=16, alpha=32.0, dropout=0.0,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def _load(side: str, ckpt: str, info):
    """``PolicyLogprobs`` of ``ckpt`` FSDP2-sharded over ``info``'s ranks, loaded as ``side`` says."""
    import functools

    import torch
    from transformers import AutoModelForCausalLM as auto

    from models.training.distributed import wrap_for_training
    from models.training.lora import CAUSAL_LM, load_pretrained, with_adapter
    from models.training.policy import PolicyLogprobs
    from models.training.sharded_load import load_sharded, load_sharded_lora

    adapt = functools.partial(with_adapter, local_dir=ckpt, spec=LORA, task_type=CAUSAL_LM)
    if side == "sharded":
        return load_sharded(ckpt, auto, info, "fsdp2", torch.float32, PolicyLogprobs)
    if side == "lora-sharded":
        return load_sharded_lora(ckpt, ckpt, auto, info, "fsdp2", torch.float32, adapt, PolicyLogprobs)
    model = load_pretrained(ckpt, auto, torch.float32)
    return wrap_for_training(PolicyLogprobs(adapt(model) if side == "lora-whole" else model), info, "fsdp2")


def _rank(rank: int, port: int, side: str, ckpt: str, threads: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from models.training.distributed import DistInfo

    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401  (what both sides import on their way, in before the measurement)
    import torch.distributed.fsdp  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    info = DistInfo(rank, RANKS, rank, torch.device("cpu"))
    dist.barrier()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from here (ru_maxrss and VmHWM alike)
    model = _load(side, ckpt, info)
    rise = _status_kib("VmHWM") - before
    local = sum(p.to_local().numel() for p in model.parameters())
    with open(os.path.join(out_dir, f"{side}-{rank}.txt"), "w") as f:
        f.write(f"{rise} {local}\n")
    dist.barrier()
    dist.destroy_process_group()


def measure(side: str, ckpt: str, threads: int, out_dir: str):
    """Per rank: (rise of the RSS high-water mark over the load in MiB, parameters held)."""
    import torch.multiprocessing as mp

    from tests.processes import free_port

    mp.spawn(_rank, args=(free_port(), side, ckpt, threads, out_dir), nprocs=RANKS, join=True)
    per_rank = []
    for rank in range(RANKS):
        rise, local = open(os.path.join(out_dir, f"{side}-{rank}.txt")).read().split()
        per_rank.append((int(rise) / 1024, int(local)))
    return per_rank


SIDES = ("whole", "sharded", "lora-whole", "lora-sharded")


def _rows(what: str, whole, sharded, params: int):
    """One row per rank: the sharded load's rise of the high-water mark over the whole load's."""
    mib = params * 4 / 2**20
    return [row(SECTION, f"sharded vs whole load, {what}: peak host memory, rank {rank} of {RANKS}", s / w, "x",
                f"sharded {s:.0f} MiB, whole {w:.0f} MiB (rise of the VmHWM over the load); the model "
                f"{mib:.0f} MiB in float32 ({params / 1e6:.0f}M parameters), this rank holds {local / 1e6:.1f}M",
                at_most=1 / RANKS + 0.1)
            for rank, ((w, _), (s, local)) in enumerate(zip(whole, sharded))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    args = parser.parse_args()
    rows = []
    for dtype in ("float32", "bfloat16"):  # what the run commits; what a hub checkpoint ships in
        with tempfile.TemporaryDirectory(prefix="bench-sharded-load-") as tmp:
            ckpt = os.path.join(tmp, "checkpoint")
            params = build_checkpoint(ckpt, args.quick, dtype)
            sides = {side: measure(side, ckpt, args.threads, tmp) for side in SIDES}
        for lora in ("", "lora-"):
            rows += _rows(f"{'LoRA (rank 16) on a ' if lora else ''}{dtype} checkpoint", sides[f"{lora}whole"],
                          sides[f"{lora}sharded"], params)
    print_rows(rows)
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
