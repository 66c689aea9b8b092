"""GPU figures (issue #8, part 3): the actor update on a random-initialised Llama-shape model, through
the project's own training path (packed forwards, PPO's clipped loss, FSDP2 with bfloat16 compute
on float32 master weights, fused AdamW), and the kernels against their torch references.
Prints figures; asserts nothing.

    torchrun --nproc_per_node 1 benchmarks/bench_gpu.py --model 0.5b        # one GPU (FSDP2 on one rank)
    torchrun --nproc_per_node 8 benchmarks/bench_gpu.py --model 1b          # FSDP2 over 8 GPUs
    python benchmarks/bench_gpu.py --device cpu --model tiny --quick        # the same code on CPU (tests)

Update: ``--steps`` optimizer steps of ``--samples`` sequences each (prompt and response lengths
drawn between half and all of ``--prompt-len`` / ``--response-len``; ``--fixed-lengths``: exactly
those), micro-batches of ``--micro-batch`` per rank, after one warm-up step. Reported: samples/s
and tokens/s (prompt + response tokens, all ranks), model TFLOP/s (6 x parameters x tokens, no
attention term) and its share of the GPU's dense bfloat16 peak where known, and peak memory per
rank (CUDA: ``max_memory_allocated``; CPU: the process's peak resident set).

Kernels (rank 0): log-probs + entropy with backward from logits (Triton on CUDA) and from hidden
states (vocabulary chunks), and GAE, each against its plain torch reference on the same device:
time and peak extra memory.

``--json PATH`` writes the figures as rows (benchmarks/rows.py).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_kernels import best_ms  # noqa: E402
from benchmarks.rows import Row, print_rows, row, write_rows  # noqa: E402
from kernels.gae import compute_gae, compute_gae_reference  # noqa: E402
from kernels.logprobs import (token_logprobs_and_entropy, token_logprobs_and_entropy_from_hidden,  # noqa: E402
                              token_logprobs_and_entropy_from_hidden_reference,
                              token_logprobs_and_entropy_reference)
from kernels.losses import PolicyLossConfig  # noqa: E402
from models.training.distributed import (DistInfo, is_sharded, join_process_group, shutdown_distributed,  # noqa: E402
                                wrap_for_training)
from models.training.policy import PolicyLogprobs, with_packing  # noqa: E402
from models.training.update import LoopSettings, UpdateData, actor_loss_fn, make_optimizer, run_update  # noqa: E402
from models.demos.real_shapes import QWEN3_0_6B  # noqa: E402

SHAPES: Dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    # about 0.5B parameters: 28 layers of 1024, GQA 16/8 heads, Llama-2's vocabulary
    "0.5b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=32000),
    # TinyLlama-1.1B's shape
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
}
# Qwen/Qwen3-0.6B's real shape, read from its released config (models/demos/real_shapes.py): a tied 151,936-row
# embedding, heads of 128; build_policy builds it from every field of that config
SHAPES["qwen3-0.6b"] = {k: QWEN3_0_6B.config[k] for k in SHAPES["0.5b"]}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}
"""Dense bfloat16 tensor-core peak by GPU name (the share is reported only for these)."""


def build_policy(shape: str, seed: int = 0) -> PolicyLogprobs:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    if shape == QWEN3_0_6B.name:  # the released config, every field (QK-norm, tied head, rope theta)
        fields = dict(QWEN3_0_6B.config)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False)
    # float32 master weights, as the update loads them
    return PolicyLogprobs(AutoModelForCausalLM.from_config(config).float())


def make_rows(n: int, prompt_len: int, response_len: int, vocab: int, fixed: bool, seed: int = 0) -> UpdateData:
    """``n`` right-padded prompt ++ response rows with PPO's loss columns (random, seeded)."""
    g = torch.Generator().manual_seed(seed)

    def lengths(top: int) -> torch.Tensor:
        return torch.full((n,), top) if fixed else torch.randint(max(top // 2, 1), top + 1, (n,), generator=g)

    p, r = lengths(prompt_len), lengths(response_len)
    L, T = int((p + r).max()), int(r.max())
    ids = torch.randint(1, vocab, (n, L), generator=g)
    att = (torch.arange(L)[None] < (p + r)[:, None]).long()
    pos = torch.clamp(p[:, None] + torch.arange(T)[None], max=L - 1)
    mask = torch.arange(T)[None] < r[:, None]
    old = (-torch.rand(n, T, generator=g) * 5) * mask
    adv = torch.randn(n, T, generator=g) * mask
    return UpdateData(ids * att, att, pos, mask, old_logp=old, adv=adv)


def shard(data: UpdateData, rank: int, world: int) -> UpdateData:
    return UpdateData(*(None if t is None else t[rank::world] for t in data))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def all_max(x: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def join(device: torch.device) -> DistInfo:
    """This rank under torchrun (a process group even for one rank, so FSDP2 can run there), or a
    plain process."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device(f"cuda:{local}")
        torch.cuda.set_device(device)
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        join_process_group(backend="nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    return DistInfo(rank, world, local, device)


def bench_update(args, info: DistInfo, rows: List[Row]) -> None:
    model = build_policy(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    model = wrap_for_training(with_packing(model, not args.no_packing), info, args.sharding, getattr(torch, args.dtype),
                              args.activation_checkpointing)
    optimizer = make_optimizer(model, 1e-6)
    loss_fn = actor_loss_fn(PolicyLossConfig(), 1.0)
    global_rows = args.samples * (args.steps + 1)
    data = make_rows(global_rows, args.prompt_len, args.response_len, SHAPES[args.model]["vocab_size"],
                     args.fixed_lengths)
    warm, timed = (shard(UpdateData(*(None if t is None else t[a:b] for t in data)), info.rank, info.world_size)
                   for a, b in ((0, args.samples), (args.samples, global_rows)))
    settings = LoopSettings(epochs=1, minibatch_size=args.samples, micro_batch_size=args.micro_batch,
                            grad_clip=1.0, seed=0)
    run_update(model, optimizer, warm, loss_fn, settings, info)  # kernels compiled, allocator warm
    sync(info.device)
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    t0 = time.perf_counter()
    stats = run_update(model, optimizer, timed, loss_fn, settings, info)
    sync(info.device)
    seconds = all_max(time.perf_counter() - t0, info.device)
    peak = all_max(peak_memory_gib(info.device), info.device)
    samples = args.samples * args.steps
    tokens = int(data.attention_mask[args.samples:].sum())
    response_tokens = int(data.response_mask[args.samples:].sum())
    tflops = 6 * n_params * tokens / seconds / 1e12
    name = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "CPU"
    peak_tf = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    where = (f"{args.model} ({n_params / 1e9:.2f}B params), {info.world_size} x {name}, "
             f"{'FSDP2' if is_sharded(model) else 'unsharded'}, {args.dtype} compute, "
             f"{args.samples} samples x {args.steps} steps, micro {args.micro_batch}")
    if info.is_main:
        print(f"update: {where}; loss {stats['loss']:.4f}, grad norm {stats['grad_norm']:.3f}, "
              f"{int(stats['steps'])} steps")
    rows += [row("gpu", "actor update samples/s", samples / seconds, "1/s", where),
             row("gpu", "actor update tokens/s", tokens / seconds, "1/s",
                 f"{tokens} tokens ({response_tokens} response) in {seconds:.4g} s"),
             row("gpu", "actor update model TFLOP/s", tflops, "TF/s",
                 f"6 x params x tokens; {100 * tflops / (peak_tf * info.world_size):.1f}% of {peak_tf:g} TF/s bf16 "
                 f"peak per GPU" if peak_tf else "6 x params x tokens"),
             row("gpu", "actor update peak memory per rank", peak, "GiB",
                 "max_memory_allocated" if info.device.type == "cuda" else "peak resident set of the process")]


def timed_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple:
    """Best time of ``repeats`` runs after a warm-up, and the peak extra memory of one (CUDA only)."""
    run = lambda: (fn(), sync(device))  # noqa: E731 (a CUDA run ends when its kernels do)
    best = best_ms(run, repeats)
    extra = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        extra = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return best, extra


def _both(section_figure: str, fast, ref, device: torch.device, repeats: int, rows: List[Row], what: str) -> None:
    fast_ms, fast_mb = timed_ms(fast, device, repeats)
    ref_ms, ref_mb = timed_ms(ref, device, repeats)
    mem = "" if fast_mb is None else f"; extra memory {ref_mb:.0f} vs {fast_mb:.0f} MiB"
    detail = f"{what}: reference {ref_ms:.2f} ms, fast {fast_ms:.2f} ms{mem}"
    print(f"{section_figure}: {detail}")
    rows.append(row("gpu", f"{section_figure}: time reference/fast", ref_ms / fast_ms, "x", detail))
    if fast_mb is not None:
        rows.append(row("gpu", f"{section_figure}: memory reference/fast", ref_mb / max(fast_mb, 1e-3), "x", detail))


def bench_kernels(args, device: torch.device, rows: List[Row]) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, args.dtype)
    B, T = (2, 256) if args.quick else (4, 2048)
    repeats = 2 if args.quick else 10
    for V in ((SHAPES[args.model]["vocab_size"],) if args.quick else (32000, 128256)):
        logits = (torch.randn(B, T, V, generator=g, device=device) * 2).to(dtype).requires_grad_(True)
        ids = torch.randint(0, V, (B, T), generator=g, device=device)

        def run(fn, x=logits, i=ids):
            out = fn(x, i)
            torch.autograd.grad(out.logp.sum() + out.entropy.sum(), x)

        _both(f"log-probs+entropy+bwd, logits V={V}", lambda: run(token_logprobs_and_entropy),
              lambda: run(token_logprobs_and_entropy_reference), device, repeats, rows,
              f"[{B}, {T}, {V}] {args.dtype}")
        del logits
    D, V = SHAPES[args.model]["hidden_size"], SHAPES[args.model]["vocab_size"]
    hidden = torch.randn(B, T, D, generator=g, device=device).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, D, generator=g, device=device) / D**0.5).to(dtype).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g, device=device)

    def run_hidden(fn):
        out = fn(hidden, weight, ids)
        torch.autograd.grad(out.logp.sum() + out.entropy.sum(), (hidden, weight))

    _both("log-probs+entropy+bwd from hidden", lambda: run_hidden(token_logprobs_and_entropy_from_hidden),
          lambda: run_hidden(token_logprobs_and_entropy_from_hidden_reference), device, repeats, rows,
          f"hidden [{B}, {T}, {D}], head [{V}, {D}] {args.dtype}")
    Bg, Tg = (16, 128) if args.quick else (256, 1024)
    rewards, values = (torch.randn(Bg, Tg, generator=g, device=device) for _ in range(2))
    mask = torch.arange(Tg, device=device)[None] < torch.randint(Tg // 4, Tg + 1, (Bg, 1), generator=g, device=device)
    _both("GAE", lambda: compute_gae(rewards, values, mask, 1.0, 0.95),
          lambda: compute_gae_reference(rewards, values, mask, 1.0, 0.95), device, 1 if args.quick else 3, rows,
          f"[{Bg}, {Tg}] float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto: CUDA if there is a GPU, else report that there is none and stop")
    parser.add_argument("--model", default="0.5b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype")
    parser.add_argument("--sharding", default="fsdp2", choices=["fsdp2", "ddp", "auto"])
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="checkpoint each decoder layer's activations (actor.activation_checkpointing)")
    parser.add_argument("--samples", type=int, default=64, help="sequences per optimizer step, all ranks")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward on one rank")
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--fixed-lengths", action="store_true", help="every row exactly --prompt-len + --response-len")
    parser.add_argument("--no-packing", action="store_true", help="padded forwards (model.pack_sequences=false)")
    parser.add_argument("--only", choices=["update", "kernels"], help="one of the two parts")
    parser.add_argument("--quick", action="store_true", help="small kernel sizes, few repeats")
    parser.add_argument("--threads", type=int, default=0, help="CPU: torch intra-op threads (0: torch's choice)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH (rank 0)")
    args = parser.parse_args()
    if args.device == "auto" and not torch.cuda.is_available():
        print("no CUDA device here: the GPU figures need one (--device cpu runs the same code on CPU)")
        write_rows(args.json, [row("gpu", "actor update and kernels on a GPU", None, "",
                                   "skipped: no CUDA device on this machine")])
        return
    args.device = "cuda" if args.device == "auto" else args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu)")
    if args.threads:
        torch.set_num_threads(args.threads)
    info = join(torch.device(args.device))
    if args.samples % (args.micro_batch * info.world_size):
        parser.error(f"--samples {args.samples} must be divisible by --micro-batch x ranks "
                     f"({args.micro_batch} x {info.world_size})")
    rows: List[Row] = []
    try:
        if args.only != "kernels":
            bench_update(args, info, rows)
        if args.only != "update" and info.is_main:
            bench_kernels(args, info.device, rows)
    finally:
        shutdown_distributed()
    if info.is_main:
        print(f"\n{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, command: {' '.join(sys.argv)}")
        print_rows(rows)
        write_rows(args.json, rows)


if __name__ == "__main__":
    main()
