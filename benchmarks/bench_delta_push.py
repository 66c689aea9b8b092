"""Delta pushes against full pushes (#48, ``run.weight_push``): bytes and seconds per push, and the density of each
update (the elements whose bfloat16 value changed), at a real width.

    flock /tmp/heavy.lock python benchmarks/bench_delta_push.py [--layers 8] [--updates 3] [--lr 1e-6] [--ranks 2]
                                                                 [--dtype bfloat16] [--quick] [--json PATH]

The trainer's float32 model is Qwen3-0.6B's shape (hidden 1024, MLP 3072, 16 query and 8 key-value heads of 128,
vocabulary 151,936, tied head) with random weights at ``--layers`` of its 28 layers (8: 281M parameters, 4.5 GB with
AdamW's state), on ``--ranks`` FSDP2 ranks over gloo (2, as the project's actor trains here: each rank casts and
compares its own rows, rank 0 gathers and sends; 1: one process holds it all); the engine, the HF engine at
``--dtype`` started from the same weights, runs in a child process behind the engine service's push ops
(``benchmarks/bench_weight_push.py``'s), over the collective transport (gloo). Each update is an AdamW step at
``--lr`` on a GRPO-shaped loss, ``-mean(adv * log p(token))`` over 4 random sequences of 64 tokens with
advantages of ±1 (no rollout: the gradient's shape, not its content, sets which bfloat16 values move), then the
same weights pushed twice: as a delta against the push the engine holds, then whole. Per update: the density, the
delta's bytes and seconds over the full push's (the sender's wall time, the engine's receive, load and read-back
included). Goals (#48): ≤ 0.05 of the bytes, ≤ 0.2 of the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_weight_push import URL_LINE  # noqa: E402
from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=512)
"""Qwen3-0.6B's ``config.json`` widths (28 layers there)."""


def build(layers: int, folder: Optional[Path], quick: bool):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from models.demos.tiny import save_model
    from models.demos.tokenizer import build_char_tokenizer

    torch.manual_seed(0)
    shape = dict(QWEN3_06B, vocab_size=4096, hidden_size=256, intermediate_size=768, head_dim=32) if quick else \
        QWEN3_06B
    model = Qwen3ForCausalLM(Qwen3Config(**shape, num_hidden_layers=layers))
    if folder is not None:
        save_model(model, build_char_tokenizer(), folder)
    return model.float()


def grpo_like_step(model, opt, gen) -> None:
    """One AdamW step on ``-mean(adv * log p(token_t | tokens_<t))``, random tokens, advantages ±1 per sequence."""
    import torch

    tokens = torch.randint(0, model.config.vocab_size, (4, 64), generator=gen)  # [B, T]
    adv = torch.randint(0, 2, (4, 1), generator=gen).float() * 2 - 1  # [B, 1]
    logits = model(input_ids=tokens).logits[:, :-1]  # [B, T-1, V]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T-1]
    (-(adv * logp).mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed_push(transport, client, source, version: int, plan, shadow) -> Dict[str, float]:
    t0 = time.perf_counter()
    out = transport.send(client, {"version": version, "probe": []}, None, source, plan, shadow)
    return {**out, "seconds": time.perf_counter() - t0}


def start_engine(folder: Path, dtype: str):
    from models.service.client import ServiceClient

    child = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "bench_weight_push.py"), "--serve",
                              str(folder), "--engine", "hf", "--dtype", dtype], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
    line = ""
    while not line.startswith(URL_LINE):
        line = child.stdout.readline()
        if not line:
            raise SystemExit("the engine's process ended before it served")
    threading.Thread(target=child.stdout.read, daemon=True).start()  # the rest, so its pipe never fills
    return child, ServiceClient(line[len(URL_LINE):].strip(), "bench", "the engine service")


def trainer(rank: int, world: int, port: int, args, folder: str, out: str) -> None:
    """Rank ``rank`` of ``world`` (FSDP2 over gloo when more than one, as the project's actor trains): every update
    then the two pushes, rank 0 sending (and timing) while the others take their part (:meth:`Transport.follow`);
    rank 0 writes the rows to ``out``."""
    import torch
    import torch.distributed as dist

    from models.hosts.transports import CollectiveTransport
    from models.training.distributed import DistInfo, wrap_for_training
    from models.training.weight_shadow import Shadow
    from models.training.weight_source import WeightSource

    torch.set_num_threads(args.threads)
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        info = DistInfo(rank, world, rank, torch.device("cpu"))
    model = build(args.layers, Path(folder) if rank == 0 else None, args.quick)
    model = wrap_for_training(model, info, "fsdp2") if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)  # the same batch on every rank
    child, client = start_engine(Path(folder), args.dtype) if rank == 0 else (None, None)
    transport, shadow, rows = CollectiveTransport(args.dtype), Shadow(), []
    source = WeightSource(model, info, prefix="")

    def push(version: int, plan, kept) -> Dict[str, float]:
        if world > 1:
            dist.barrier()
        if rank:
            transport.follow(source, plan, kept)
            return {}
        return timed_push(transport, client, source, version, plan, kept)

    try:
        push(0, {"id": "f0", "seed": 0, "base": ""}, shadow)  # fills the shadow
        for k in range(1, args.updates + 1):
            grpo_like_step(model, opt, gen)
            delta = push(k, {"id": f"d{k}", "seed": k, "base": f"f{k - 1}"}, shadow)
            full = push(k, {"id": f"f{k}", "seed": k, "base": ""}, None)
            if rank == 0:
                rows.append({"density": delta["resident/push_density"], "delta_bytes": delta["resident/weights_bytes"],
                             "full_bytes": full["resident/weights_bytes"], "delta_s": delta["seconds"],
                             "full_s": full["seconds"], "params": full["resident/weights_params"]})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        transport.close()
        if child is not None:
            child.stdin.close()
            child.wait(60)
        if world > 1:
            dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def run(args) -> List[Dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as work:  # the model's checkpoint: 1.1 GB at 8 layers
        folder = str(Path(work) / "start")
        out = folder + ".rows.json"
        if args.ranks == 1:
            trainer(0, 1, 0, args, folder, out)
        else:
            import torch.multiprocessing as mp

            from tests.processes import free_port

            mp.spawn(trainer, args=(args.ranks, free_port(), args, folder, out), nprocs=args.ranks, join=True)
        return json.loads(Path(out).read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)
    parser.add_argument("--layers", type=int, default=8, help="of Qwen3-0.6B's 28 (--quick: 2, narrower)")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--ranks", type=int, default=2,
                        help="trainer ranks (FSDP2 over gloo; 2: as the project's actor trains on this machine, each "
                             "rank comparing its own rows; 1: one process holds the whole model)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.quick:
        args.layers, args.updates = 2, 2
    rows = run(args)
    bytes_ratio = max(r["delta_bytes"] / r["full_bytes"] for r in rows)
    seconds_ratio = statistics.median(r["delta_s"] / r["full_s"] for r in rows)
    what = f"{'quick ' if args.quick else ''}Qwen3-0.6B width, {args.layers} layers, {rows[0]['params'] / 1e6:.0f}M " \
           f"parameters on {args.ranks} trainer rank(s), AdamW lr {args.lr:g}, engine {args.dtype}"
    out: List[Row] = [
        row("delta_push", "density per update (changed / all)", max(r["density"] for r in rows), "x",
            f"{what}; per update {[round(r['density'], 5) for r in rows]}"),
        row("delta_push", "delta bytes / full bytes (worst update)", bytes_ratio, "x",
            f"full {rows[0]['full_bytes'] / 2**20:.1f} MiB; delta {[round(r['delta_bytes'] / 2**20, 2) for r in rows]} "
            f"MiB", at_most=0.05),
        row("delta_push", "delta seconds / full seconds (median)", seconds_ratio, "x",
            f"full {[round(r['full_s'], 2) for r in rows]} s, delta {[round(r['delta_s'], 2) for r in rows]} s "
            f"(sender's wall time, the engine's load and read-back included; gloo, one machine)", at_most=0.2),
    ]
    print_rows(out)
    write_rows(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
