"""``make bench``: run every benchmark and print one table of the figures measured in this run.

    python benchmarks/run_all.py [--quick] [--threads N] [--only rollout,batch_io] [--json PATH]

Each ``bench_*.py`` below runs as its own process with ``--json PATH`` (and ``--quick``),
with ``OMP_NUM_THREADS=N`` so torch uses the same thread count everywhere; its rows (see
``benchmarks/rows.py``) go into the table, its output into ``--logs``. A benchmark that is
not there yet gets a "not present" row; one that fails gets a failed row with the end of
its error, and the others still run. Exit status 1 if any figure misses its target or any
benchmark failed.

Read the ratios ("x"): both sides were measured in the same run on the same machine,
while absolute times vary with the load of a shared machine (they are in "detail").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.rows import Row, exit_status  # noqa: E402

BENCHMARKS: Dict[str, str] = {
    "kernels": "bench_kernels.py",  # GAE and log-prob kernels vs their references
    "rollout": "bench_rollout.py",  # vLLM vs HF generate; weights into a running engine
    "batch_io": "bench_batch_io.py",  # RolloutBatch write/read, local and S3
    "checkpoint": "bench_checkpoint.py",  # committed checkpoint save
    "iteration": "bench_iteration.py",  # one PPO iteration per phase, Flyte overhead
    "trl": "bench_trl.py",  # against TRL
    "lora": "bench_lora.py",  # LoRA vs full fine-tuning
    "gpu": "bench_gpu.py",  # actor update (FSDP2, bf16) and kernels on a GPU; a "skipped" row without one
    "resident": "bench_resident.py",  # resident vs stateless s/iteration and rewards on the tiny presets (#29)
    "sharded_load": "bench_sharded_load.py",  # rank-local vs whole checkpoint load, full weights and LoRA (#30)
    "huge_pages": "bench_huge_pages.py",  # torch's CPU allocations with and without transparent huge pages (#46)
    "projection": "project_iteration.py",  # an iteration at 8B / 70B on paper, both run modes (docs/cluster.md)
    "weight_push": "bench_weight_push.py",  # the engine's peak extra memory per resident push vs the model (#38)
    "delta_push": "bench_delta_push.py",  # delta vs full pushes at Qwen3-0.6B's width: bytes, seconds, density (#48)
    "pipeline": "bench_pipeline.py",  # on- vs off-policy s/iteration in the pod-level harness (docs/off_policy.md)
    "async": "bench_async.py",  # run.max_staleness k = 0, 1, 2, 4: s/iteration, idle fractions, rewards (#40)
    "async_pods": "bench_async_pods.py",  # k = 0 vs 2 in the pod-level harness, a core per pod (#40)
    "resident_pods": "bench_resident_pods.py",  # resident vs stateless in the pod-level harness (docs/cluster.md)
    "long_run": "bench_long_run.py",  # s/iteration against the iteration index over 500 iterations (docs/cluster.md#long-runs)
    "real_shape": "bench_real_shape.py",  # Qwen3-0.6B's shape in each mode vs TRL: peak memory, s/iteration (#46)
    "episodes": "bench_episodes.py",  # multi-turn episodes in lockstep vs each at its own pace, slow environments (#49)
}
"""Section name -> script in this folder, in table order."""
NOT_QUICK = {"pipeline": "tens of harness pods per run", "resident_pods": "tens of harness pods per run",
             "async_pods": "tens of harness pods per run",
             "long_run": "1,000 iterations through pyflyte run",
             "real_shape": "a 0.6B model trained in four runs, up to 16 GiB each"}
"""Sections ``--quick`` leaves out unless named in ``--only`` (why: their cost)."""
MIN_TIMEOUT_S = {"pipeline": 4 * 3600.0, "resident_pods": 3600.0, "long_run": 2 * 3600.0, "real_shape": 3 * 3600.0}
"""Sections that need more than ``--timeout-s``'s default: the pipeline's four harness runs took 39 min for the
demo pair and 39 min for the compute-bound pair at 3 iterations on a loaded 2-core machine (benchmarks/RESULTS.md);
``make bench`` runs 4 iterations each. A larger ``--timeout-s`` wins."""


def machine_lines(threads: int) -> List[str]:
    """Date, cores, CPU model, GPU and thread count: what the figures depend on."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = (", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
           if torch.cuda.is_available() else "none")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return [f"date: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}",
            f"machine: {usable} cores usable ({os.cpu_count()} online), CPU {cpu}, GPU {gpu}; load average {load}",
            f"torch {torch.__version__}, {threads} thread(s) in every benchmark (OMP_NUM_THREADS)"]


def run_one(section: str, script: Path, quick: bool, threads: int, log_dir: Path, timeout_s: float) -> List[Row]:
    """The rows ``script`` wrote, or one row saying why there are none."""
    if not script.is_file():
        return [Row(section, f"{script.name}", None, "", None, None, "not present (not written yet)")]
    json_path = log_dir / f"{section}.json"
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(script), "--json", str(json_path)] + (["--quick"] if quick else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    log_path = log_dir / f"{section}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout_s:.0f} s"
    seconds = time.perf_counter() - t0
    print(f"  {section}: {seconds:.0f} s, log {log_path}", file=sys.stderr)
    if rc != 0 or not json_path.is_file():
        why = f"killed by signal {-rc}" if isinstance(rc, int) and rc < 0 else f"exit {rc}"
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip() and "WARNING" not in ln]
        return [Row(section, f"{script.name} runs", None, "", "runs", False,
                    f"{why}: {' | '.join(lines[-3:])}"[:300])]
    try:
        return [Row(**r) for r in json.loads(json_path.read_text())]
    except (ValueError, TypeError) as err:
        return [Row(section, f"{script.name} rows", None, "", "runs", False, f"bad --json output: {err}")]


def format_table(rows: Sequence[Row]) -> str:
    """Fixed-width table: section, figure, value, unit, target, verdict, detail."""
    def value(r: Row) -> str:
        return "-" if r.value is None else f"{r.value:.3g}"

    def verdict(r: Row) -> str:
        return "" if r.ok is None else ("ok" if r.ok else "MISSED" if r.value is not None else "FAILED")

    cells = [(r.section, r.figure, value(r), r.unit, r.target or "", verdict(r), r.detail) for r in rows]
    head = ("section", "figure", "value", "unit", "target", "", "detail")
    widths = [max(len(c[i]) for c in cells + [head]) for i in range(6)]
    aligns = ["<", "<", ">", "<", "<", "<"]
    lines = []
    for c in [head] + cells:
        lines.append("  ".join(f"{c[i]:{aligns[i]}{widths[i]}}" for i in range(6)) + "  " + c[6])
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (minutes in all, not tens)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in every benchmark (default 1: steady on a shared machine; a "
                             "dedicated one gives faster CPU generation with every core)")
    parser.add_argument("--only", default="", help=f"comma-separated sections of {list(BENCHMARKS)}")
    parser.add_argument("--json", metavar="PATH", help="also write every row as a JSON list")
    parser.add_argument("--logs", default=str(HERE.parent / ".cache" / "bench"), help="folder for each run's output")
    parser.add_argument("--timeout-s", type=float, default=3600, help="limit per benchmark (at least MIN_TIMEOUT_S for the slow sections)")
    args = parser.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; known: {list(BENCHMARKS)}")
    log_dir = Path(args.logs)
    log_dir.mkdir(parents=True, exist_ok=True)
    header = machine_lines(args.threads)
    print(f"running {'quick ' if args.quick else ''}benchmarks, logs in {log_dir}", file=sys.stderr)
    rows: List[Row] = []
    for section, script in BENCHMARKS.items():
        if args.quick and section in NOT_QUICK and not only:  # named in --only: it runs
            rows.append(Row(section, script, None, "", None, None,
                            f"left out with --quick ({NOT_QUICK[section]}): make bench, or --only {section}"))
        elif not only or section in only:
            limit = max(args.timeout_s, MIN_TIMEOUT_S.get(section, 0.0))
            rows += run_one(section, HERE / script, args.quick, args.threads, log_dir, limit)
    print("\n".join(header + [f"mode: {'quick (small sizes)' if args.quick else 'full'}", ""]))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": [r.__dict__ for r in rows]}, f, indent=2)
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
