"""LoRA against full fine-tuning: seconds and extra peak memory per actor update.

Both sides update the bench model (random Llama, 8 layers x 512 hidden, MLP 2048, 8 heads; see
benchmarks/bench_trl.py) with the real update loop (``models.training.update.run_update``, clipped
surrogate, AdamW, one optimiser step over two micro-batches) on the same random batch, with the
same torch thread count. LoRA: rank 16 on every attention and MLP projection (the default
``actor.lora.target_modules``).

Each side runs in a fresh subprocess: it builds the model, then resets the kernel's
resident-set high-water mark (``echo 5 > /proc/self/clear_refs``) and reports
``VmHWM − VmRSS`` over its updates: gradients, optimiser state and activations (an upper
bound: every page touched counts, allocator slack included). Time: best of the repeats after a
warm-up update (the warm-up allocates AdamW's state).

What LoRA saves is the full model's gradient and AdamW moments (12 bytes per parameter in fp32,
about 400 MB here); activations stay (the adapters need their inputs saved). On this 34M-parameter
model the activations of 2048 tokens outweigh that, so the memory ratio is near 1 in the full run
and well below 1 with ``--quick`` (256 tokens); on billion-parameter models the saving dominates.

    python benchmarks/bench_lora.py [--quick] [--threads N] [--json rows.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.rows import add_bench_args, print_rows, row, write_rows  # noqa: E402

SECTION = "lora"
RANK = 16


def _status_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def worker(variant: str, quick: bool, threads: int) -> dict:
    """One side: seconds per update (best of repeats) and extra peak MiB over the built model."""
    import torch

    from kernels.losses import PolicyLossConfig
    from models.training.distributed import DistInfo
    from models.training.lora import CAUSAL_LM, add_adapter
    from models.training.policy import PolicyLogprobs
    from models.demos.tiny import TinyModelConfig, build_actor
    from models.demos.tokenizer import build_char_tokenizer
    from models.training.update import LoopSettings, UpdateData, actor_loss_fn, make_optimizer, run_update
    from models.config import LoraConfig

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    batch, prompt, response, repeats = (8, 16, 16, 2) if quick else (16, 32, 96, 3)
    tok = build_char_tokenizer()
    lm = build_actor(TinyModelConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8,
                                     intermediate_size=2048, max_position_embeddings=prompt + response), tok)
    if variant == "lora":
        lm = add_adapter(lm, LoraConfig(rank=RANK, alpha=2.0 * RANK), CAUSAL_LM)
    model = PolicyLogprobs(lm)
    seq = prompt + response
    ids = torch.randint(3, len(tok), (batch, seq))  # [B, L]
    positions = torch.arange(prompt, seq).expand(batch, -1).contiguous()  # [B, T]
    mask = torch.ones(batch, response, dtype=torch.bool)  # [B, T]
    data = UpdateData(ids, torch.ones_like(ids), positions, mask, old_logp=torch.full((batch, response), -4.6),
                      adv=torch.randn(batch, response))
    optimizer = make_optimizer(model, lr=1e-5)
    loss_fn = actor_loss_fn(PolicyLossConfig(), temperature=1.0)
    settings = LoopSettings(epochs=1, minibatch_size=batch, micro_batch_size=batch // 2, grad_clip=1.0, seed=0)
    cpu = DistInfo(0, 1, 0, torch.device("cpu"))
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    run_update(model, optimizer, data, loss_fn, settings, cpu)  # warm-up: AdamW state is allocated here
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_update(model, optimizer, data, loss_fn, settings, cpu)
        best = min(best, time.perf_counter() - t0)
    return {"seconds": best, "extra_mib": (_status_kb("VmHWM") - before) / 1024,
            "trainable": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
            "total": sum(p.numel() for p in model.parameters()), "tokens": batch * seq}


def measure(variant: str, quick: bool, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--threads", str(threads)] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"bench_lora --worker {variant} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--worker", choices=["lora", "full"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.quick, args.threads)))
        return
    full, lora = measure("full", args.quick, args.threads), measure("lora", args.quick, args.threads)
    size = f"8x512 Llama, {full['total'] / 1e6:.1f}M params, {full['tokens']} tokens/update, {args.threads} threads"
    rows = [
        row(SECTION, "LoRA vs full: time per update", lora["seconds"] / full["seconds"], "x",
            f"LoRA r={RANK} {lora['seconds']:.2f} s, full {full['seconds']:.2f} s ({size})"),
        row(SECTION, "LoRA vs full: extra peak memory per update", lora["extra_mib"] / full["extra_mib"], "x",
            f"LoRA {lora['extra_mib']:.0f} MiB, full {full['extra_mib']:.0f} MiB over the built model"),
        row(SECTION, "LoRA trainable share of parameters", lora["trainable"] / full["trainable"], "x",
            f"{lora['trainable'] / 1e6:.2f}M of {full['trainable'] / 1e6:.1f}M in the optimizer"),
    ]
    print_rows(rows)
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
