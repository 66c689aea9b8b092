"""RolloutBatch write + read throughput on a local folder and on S3 (a moto server on 127.0.0.1).

    python benchmarks/bench_batch_io.py [--quick] [--rows 4096] [--tokens 1024] [--json PATH]

The batch has every column of an advantages-stage batch (128 prompt tokens and ``--tokens``
response tokens per row; 1 int32 + 8 float32 response-aligned columns). ``write`` is
:meth:`RolloutBatch.write` (Arrow IPC, BLAKE3 sidecar, atomic local write, no fsync);
``read`` is :meth:`RolloutBatch.read` (BLAKE3 check of every byte, schema validation,
zero-copy table). Local reads are timed twice: from the page cache (the file was just
written, as when tasks share a machine) and cold (pages dropped with
``posix_fadvise(DONTNEED)`` first). GB/s = file bytes / seconds, median of ``--repeats``.
The "alone" rows are the bounds: BLAKE3 on every core (both directions), and, for scale,
writing the same bytes with fsync (the disk's sync speed, which batch writes do not wait for:
see :meth:`RolloutBatch.write`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, List

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402
from models import storage  # noqa: E402
from models.checkpoint import buffer_digest  # noqa: E402
from models.data.batch import ADVANTAGE_COLUMNS, BatchMetadata, RolloutBatch  # noqa: E402
from tests.processes import S3_ENV_TO_UNSET, moto_s3_server, s3_client_env  # noqa: E402

PROMPT_TOKENS = 128


def make_batch(rows: int, tokens: int, seed: int = 0) -> RolloutBatch:
    """A PPO batch after the advantages stage, every response ``tokens`` long."""
    rng = np.random.default_rng(seed)
    full = np.ones((rows, tokens), dtype=bool)  # [B, T]

    def floats() -> tuple:
        return rng.standard_normal((rows, tokens), dtype=np.float32), full

    columns = dict(
        prompt_id=np.arange(rows) // 4,
        prompt_tokens=(rng.integers(0, 32000, (rows, PROMPT_TOKENS), dtype=np.int32),
                       np.ones((rows, PROMPT_TOKENS), dtype=bool)),
        response_tokens=(rng.integers(0, 32000, (rows, tokens), dtype=np.int32), full),
        sampler_logprobs=floats(), is_end=rng.random(rows) < 0.5,
        old_logprobs=floats(), ref_logprobs=floats(), values=floats(),
        reward=rng.standard_normal(rows, dtype=np.float32),
        token_rewards=floats(), advantages=floats(), returns=floats(), loss_mask=(full, full),
    )
    batch = RolloutBatch.from_columns(BatchMetadata(iteration=0, policy_version=0, algorithm="ppo"), **columns)
    return batch.validate(required=ADVANTAGE_COLUMNS)


def median_s(fn: Callable[[], object], repeats: int, before: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read(url: str) -> None:
    RolloutBatch.read(url, required=ADVANTAGE_COLUMNS)


def write_fsynced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def drop_page_cache(path: str) -> None:
    """Evict ``path``'s pages, so the next read comes from the disk (synced first: batch writes
    do not fsync, and dirty pages cannot be dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_local(batch: RolloutBatch, repeats: int, folder: str) -> List[Row]:
    url = os.path.join(folder, "iter-000000", "advantages.arrow")
    write_s = median_s(lambda: batch.write(url), repeats)
    size = os.path.getsize(url)
    warm_s = median_s(lambda: read(url), repeats)
    cold_s = median_s(lambda: read(url), repeats, before=lambda: drop_page_cache(url))
    gb = size / 1e9
    with open(url, "rb") as f:
        data = f.read()
    hash_s = median_s(lambda: buffer_digest(data), repeats)
    disk_s = median_s(lambda: write_fsynced(os.path.join(folder, "plain.bin"), data), repeats)
    return [
        row("batch_io", "BLAKE3 alone GB/s (bound)", gb / hash_s, "GB/s", f"{hash_s:.3f} s, all cores"),
        row("batch_io", "file write + fsync alone GB/s (bound)", gb / disk_s, "GB/s", f"{disk_s:.3f} s"),
        row("batch_io", "local write GB/s", gb / write_s, "GB/s", f"{size / 2**20:.0f} MiB in {write_s:.3f} s",
            at_least=1.0),
        row("batch_io", "local read GB/s (page cache)", gb / warm_s, "GB/s", f"{warm_s:.3f} s", at_least=1.0),
        row("batch_io", "local read GB/s (cold)", gb / cold_s, "GB/s", f"{cold_s:.3f} s; disk-bound"),
    ]


def bench_s3(batch: RolloutBatch, repeats: int) -> List[Row]:
    bucket = "bench-batch-io"
    with moto_s3_server(bucket) as endpoint:
        os.environ.update(s3_client_env(endpoint))
        for key in S3_ENV_TO_UNSET:
            os.environ.pop(key, None)
        url = f"s3://{bucket}/{uuid.uuid4().hex[:8]}/iter-000000/advantages.arrow"
        write_s = median_s(lambda: batch.write(url), repeats)
        size = storage.size(url)
        read_s = median_s(lambda: read(url), repeats)
    gb = size / 1e9
    return [
        row("batch_io", "S3 (moto, loopback) write GB/s", gb / write_s, "GB/s", f"{write_s:.3f} s"),
        row("batch_io", "S3 (moto, loopback) read GB/s", gb / read_s, "GB/s", f"{read_s:.3f} s"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)
    parser.add_argument("--rows", type=int, help="samples in the batch (default 4096; quick 512)")
    parser.add_argument("--tokens", type=int, default=1024, help="response tokens per sample")
    parser.add_argument("--repeats", type=int, help="timed runs per figure (default 5; quick 2)")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 figures")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows_n = args.rows or (512 if args.quick else 4096)
    repeats = args.repeats or (2 if args.quick else 5)
    batch = make_batch(rows_n, args.tokens)
    print(f"RolloutBatch: {rows_n} rows x {args.tokens} response tokens, {len(batch.column_names)} columns, "
          f"{batch.table.nbytes / 2**20:.0f} MiB in memory; median of {repeats}")
    with tempfile.TemporaryDirectory(prefix="bench-batch-io-") as folder:
        rows = bench_local(batch, repeats, folder)
    if not args.no_s3:
        rows += bench_s3(batch, repeats)
    print_rows(rows)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
