"""torch's CPU allocations with and without transparent huge pages (``THP_MEM_ALLOC_ENABLE``, which the product
sets for its processes: :func:`models.memory.use_huge_pages`), where a trainer rank spends them: a copy into a new
tensor (what FSDP2's gathers and copies do with every layer), and on two FSDP2 ranks at Qwen3-0.6B's shape the
probe's forward (every layer gathered, a forward of 4 x 16 tokens) and the gather of every weight whole on every
rank (a colocated engine's load).

    python benchmarks/bench_huge_pages.py [--layers 28] [--quick]

Each side runs in fresh processes (torch reads the variable once per process), one torch thread a rank with
``mallopt``'s mmap threshold at 4 MiB as a trainer rank has it (:func:`models.memory.bound_heap`). Prints the
seconds of each side and their ratio; both sides' probe log-probs must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402
from models.memory import HUGE_PAGES_ENV  # noqa: E402

SECTION = "huge_pages"
COPY_MB = 60
"""A Qwen3-0.6B decoder layer's float32 weights, about."""


def copy_ms(repeat: int = 20) -> Dict[str, float]:
    """Milliseconds of a copy of :data:`COPY_MB` MB into a new tensor, and into one written before."""
    import torch

    from models.memory import bound_heap

    torch.set_num_threads(1)
    bound_heap()
    src = torch.randn(COPY_MB * 250_000)
    dst = torch.empty_like(src).copy_(src)
    out = {}
    for name, make in (("new", lambda: torch.empty_like(src)), ("reused", lambda: dst)):
        make().copy_(src)
        t0 = time.perf_counter()
        for _ in range(repeat):
            make().copy_(src)
        out[name] = (time.perf_counter() - t0) / repeat * 1e3
    return out


def _rank(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from models.training.distributed import init_distributed, wrap_for_training
    from models.training.policy import PolicyLogprobs
    from models.training.probe import reference_logprobs
    from models.training.weight_source import WeightSource

    info = init_distributed()  # bound_heap, as a trainer rank
    lm = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    policy = wrap_for_training(PolicyLogprobs(lm), info, "fsdp2")
    vocab = lm.config.vocab_size
    reference_logprobs(policy, vocab)  # first forward: FSDP2's lazy set-up
    t0 = time.perf_counter()
    _, logprobs = reference_logprobs(policy, vocab)
    forward_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _name, _t in WeightSource(policy, info).gathered(info.device, torch.float32, everywhere=True):
        pass
    gather_s = time.perf_counter() - t0
    if rank == 0:
        Path(out).write_text(json.dumps({"forward_s": forward_s, "gather_s": gather_s, "logprobs": logprobs}))
    dist.destroy_process_group()


def fsdp2_side(ckpt: str, ranks: int, out: str) -> None:
    import torch.multiprocessing as mp

    from tests.processes import free_port

    mp.spawn(_rank, args=(ranks, free_port(), ckpt, out), nprocs=ranks, join=True)


def side(enabled: bool, what: str, args: List[str]) -> dict:
    """This script's ``what`` in a fresh interpreter with huge pages ``enabled``; its JSON answer."""
    env = {**os.environ, HUGE_PAGES_ENV: "1" if enabled else "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, "--side", what, *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{what} with {HUGE_PAGES_ENV}={int(enabled)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the Qwen3-0.6B-shaped checkpoint")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--side", choices=["copy", "fsdp2"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side == "copy":
        print(json.dumps(copy_ms()))
        return 0
    if args.side == "fsdp2":
        fsdp2_side(args.ckpt, args.ranks, args.out)
        print(Path(args.out).read_text())
        return 0

    from models.demos.real_shapes import QWEN3_0_6B, BuildOptions, real_checkpoint

    layers = 2 if args.quick else args.layers
    ckpt = str(real_checkpoint(QWEN3_0_6B, BuildOptions(num_layers=layers)))
    rows: List[Row] = []
    copies = {on: side(on, "copy", []) for on in (False, True)}
    for kind in ("new", "reused"):
        off, on = copies[False][kind], copies[True][kind]
        rows.append(row(SECTION, f"copy of {COPY_MB} MB into a {kind} tensor, THP off / on", off / on, "x",
                        f"off {off:.1f} ms, on {on:.1f} ms"))
    results = {}
    for on in (False, True):
        out = f"/tmp/bench-huge-pages-{os.getpid()}-{int(on)}.json"
        try:
            results[on] = side(on, "fsdp2", ["--ckpt", ckpt, "--ranks", str(args.ranks), "--out", out])
        finally:
            Path(out).unlink(missing_ok=True)
    same = results[False]["logprobs"] == results[True]["logprobs"]
    shape = f"Qwen3-0.6B shape, {layers} layers, {args.ranks} FSDP2 ranks"
    for key, what in (("forward_s", "probe forward (4 x 16 tokens)"), ("gather_s", "every weight gathered whole")):
        off, on = results[False][key], results[True][key]
        rows.append(row(SECTION, f"{what}, THP off / on ({shape})", off / on, "x",
                        f"off {off:.2f} s, on {on:.2f} s; log-probs {'equal' if same else 'DIFFER'}"))
    if not same:
        rows.append(Row(SECTION, "probe log-probs equal with and without THP", None, "", "equal", False, "differ"))
    print_rows(rows)
    write_rows(args.json, rows)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
