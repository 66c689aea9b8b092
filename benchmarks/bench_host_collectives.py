"""FSDP2's collectives between CPU ranks of one host: gloo (TCP over loopback) against the shared-memory region of
``models/training/host_collectives.py``, at the sizes of Qwen3-0.6B in float32 (a decoder layer's 15M parameters,
the tied 151,936 x 1,024 embedding).

    python benchmarks/bench_host_collectives.py [--ranks 2] [--repeat 28]

Each rank runs with one torch thread, as a trainer's ranks on a shared host do. Prints GB/s of the gathered (or
reduced) tensor's bytes for each way, and checks that both give the same result.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = [("decoder layer", 15_000_000), ("embedding", 151_936 * 1_024)]


def _rank(rank: int, world: int, port: int, repeat: int) -> None:
    from models.training.host_collectives import HostCollectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    host = HostCollectives.open(dist.group.WORLD)
    assert host is not None, "no shared-memory region could be made"
    try:
        for what, numel in SIZES:
            n = repeat if what == "decoder layer" else 1
            numel -= numel % world
            shard = torch.randn(numel // world) + rank
            full = torch.randn(numel) * (rank + 1)
            results = {}
            for way in ("gloo", "shm"):
                out, part = torch.empty(numel), torch.empty(numel // world)
                gather = (lambda: dist.all_gather_into_tensor(out, shard)) if way == "gloo" \
                    else (lambda: host.all_gather(out, shard))
                scatter = (lambda: dist.reduce_scatter_tensor(part, full)) if way == "gloo" \
                    else (lambda: host.reduce_scatter(part, full))
                for name, call in (("all-gather", gather), ("reduce-scatter", scatter)):
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        call()
                    dist.barrier()
                    dt = time.perf_counter() - t0
                    results[(way, name)] = (dt, (out if name == "all-gather" else part).clone())
            for name in ("all-gather", "reduce-scatter"):
                (g, want), (s, got) = results[("gloo", name)], results[("shm", name)]
                assert torch.equal(got, want), f"{name}: shared memory differs from gloo"
                if rank == 0:
                    gb = numel * 4 * n / 1e9
                    print(f"{name:14s} {what:13s} {numel * 4 / 1e6:6.0f} MB x{n:<3d} gloo {gb / g:5.2f} GB/s  "
                          f"shared memory {gb / s:5.2f} GB/s  ({g / s:.1f}x; the same result)", flush=True)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=28, help="decoder layers gathered per measurement")
    args = parser.parse_args(argv)
    from tests.processes import free_port

    print(f"{args.ranks} CPU ranks of one host, float32, one torch thread each", flush=True)
    mp.spawn(_rank, args=(args.ranks, free_port(), args.repeat), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
