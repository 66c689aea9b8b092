"""Committed checkpoint save to a local folder: now vs before (one file, copied, hashed serially).

    python benchmarks/bench_checkpoint.py [--quick] [--json PATH]

Both sides save the same random Llama (8 layers x 1024 hidden, 134M parameters, 538 MB in
float32; quick: 4 x 512) as a committed checkpoint. "now" is
:func:`models.checkpoint.save_model_checkpoint`: safetensors shards (one per core) written
next to the target, hashed in parallel threads and hard-linked into place. "before" is what
it did until then, with the same public pieces: ``save_pretrained`` into /tmp as one
``model.safetensors``, then :func:`save_checkpoint` with one thread, copying every file.
Runs alternate between the two sides; median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def save_before(model, tokenizer, url: str) -> None:
    """The save path before shards: one file in /tmp, copied and hashed by one thread."""
    from models.checkpoint import save_checkpoint

    with tempfile.TemporaryDirectory(prefix="ckpt-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=50 * 10**9)
        tokenizer.save_pretrained(tmp)
        save_checkpoint(tmp, url, workers=1)


def bench(quick: bool, repeats: int) -> List[Row]:
    from transformers.utils import logging as hf_logging

    from models.checkpoint import save_model_checkpoint, shard_bytes
    from models.demos.tiny import TinyModelConfig, build_actor
    from models.demos.tokenizer import build_char_tokenizer

    hf_logging.disable_progress_bar()
    layers, hidden = (4, 512) if quick else (8, 1024)
    tok = build_char_tokenizer()
    model = build_actor(TinyModelConfig(hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                                        num_kv_heads=hidden // 64, intermediate_size=4 * hidden), tok)
    state = model.state_dict()
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    # quick: a small model is one shard by default; cut it as a big one would be, one shard per core
    shard = -(-int(mb * 1e6) // (os.cpu_count() or 1)) if quick else shard_bytes(state)
    before, now = [], []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as root:
        for i in range(repeats):
            before.append(timed(lambda: save_before(model, tok, f"{root}/before-{i}")))
            now.append(timed(lambda: save_model_checkpoint(model, tok, f"{root}/now-{i}", max_shard_size=shard)))
        shards = len([f for f in os.listdir(f"{root}/now-0") if f.endswith(".safetensors")])
    before_s, now_s = statistics.median(before), statistics.median(now)
    detail = (f"{mb:.0f} MB ({layers}x{hidden}): before {before_s:.2f} s, now {now_s:.2f} s "
              f"({shards} shards, {os.cpu_count()} cores)")
    return [row("checkpoint", "save speed-up: shards, parallel, linked", before_s / now_s, "x", detail)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)
    parser.add_argument("--repeats", type=int, help="timed saves per side (default 3; quick 2)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = bench(args.quick, args.repeats or (2 if args.quick else 3))
    print_rows(rows)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
