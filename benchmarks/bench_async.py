"""Asynchronous training against the synchronous modes on the tiny GRPO preset, resident, through ``pyflyte run``.

    python benchmarks/bench_async.py [--quick] [--iterations N] [--staleness 0,1,2,4] [--overrides JSON]
                                     [--partial] [--slow-engine S] [--json PATH]

One run per k of ``run.max_staleness`` (``actor.tis_cap=2`` from k = 1), the same seeds, with ``--overrides`` (a
JSON list, e.g. ``'["rollout.engine=hf"]'``) on every run and ``--partial`` (``run.partial_rollouts=true``, either
engine) on those with k ≥ 2. ``--slow-engine S``: every engine call sleeps S seconds per prompt after generating,
in every run (``RLHF_FAULT_SLOW_ENGINE``, models/faults.py): generation made the slower side as an engine on a GPU of
its own would be, taking no CPU from the trainer (the tiny preset's generation is otherwise the faster side here).
Printed per k:

- seconds per iteration: the median of ``time/iteration_s`` (commit to commit, the run's own metric) over the
  iterations after the first two (the first carries the engine start);
- the idle fractions: with k ≥ 2 the means of ``async/engine_idle_fraction`` (the engine held back by the bound)
  and ``async/trainer_idle_fraction`` (the rollout task waiting for its batch) after the first iteration; with
  k = 0 and 1 the engine idles outside the rollout (1 − ``time/generate_s`` / ``time/iteration_s``) and the
  trainer waits for the whole rollout (``time/rollout_s`` / ``time/iteration_s``: a local run executes the
  graph's nodes one after another, so k = 1 overlaps nothing here; docs/off_policy.md);
- the rewards: ``rollout/reward_mean`` of every iteration, and the held-out ``eval/reward_mean`` of the starting
  policy and of the last one (the same held-out prompts, sampled at the training temperature), whose gain is
  compared with k = 0's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_resident import metrics, run  # noqa: E402
from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

COMMON = ["run.resident=true", "run.registered_model_name=", "run.checkpoint_artifact_max_mb=0",
          "run.eval_before_training=true", "rollout.eval_temperature=1.0", "run.save_interval=100"]


def overrides(k: int, iterations: int, eval_prompts: int, extra: List[str], partial: bool) -> List[str]:
    lag = [f"run.max_staleness={k}", "actor.tis_cap=2"] if k else []
    lag += ["run.partial_rollouts=true"] if partial and k >= 2 else []
    return COMMON + lag + [f"run.num_iterations={iterations}", f"run.eval_interval={iterations}",
                           f"data.num_demo_eval_prompts={eval_prompts}"] + extra


def idle(root: str, name: str, k: int) -> Dict[str, float]:
    """The engine's and the trainer's idle fractions after the first iteration (the module docstring)."""
    if k >= 2:
        return {side: statistics.mean(metrics(root, name, f"async/{side}_idle_fraction")[1:])
                for side in ("engine", "trainer")}
    wall = metrics(root, name, "time/iteration_s")  # from the second iteration on
    generate, rollout = (metrics(root, name, key)[1:] for key in ("time/generate_s", "time/rollout_s"))
    return {"engine": statistics.mean(1 - g / w for g, w in zip(generate, wall)),
            "trainer": statistics.mean(r / w for r, w in zip(rollout, wall))}


def bench(ks: List[int], iterations: int, eval_prompts: int, root: str, extra: List[str] = (),
          partial: bool = False) -> List[Row]:
    per_iter, gains, rows = {}, {}, []
    for k in ks:
        name = f"k{k}"
        wall = run("reinforce", "configs/tiny_grpo.yaml", overrides(k, iterations, eval_prompts, list(extra), partial),
                   name, root)
        per_iter[k] = statistics.median(metrics(root, name, "time/iteration_s")[1:])
        before, after = metrics(root, name, "eval/reward_mean")
        gains[k] = after - before
        sides = idle(root, name, k)
        rewards = [round(r, 3) for r in metrics(root, name, "rollout/reward_mean")]
        partial_share = metrics(root, name, "async/partial_fraction") if k >= 2 else []
        if partial_share:
            print(f"k={k}: partial samples per iteration {[round(p, 3) for p in partial_share]}")
        print(f"k={k}: {per_iter[k]:.2f} s/iteration, idle engine {sides['engine']:.0%} trainer "
              f"{sides['trainer']:.0%}, held-out reward {before:.3f} -> {after:.3f} ({gains[k]:+.3f}), "
              f"run {wall:.0f} s; rollout rewards {rewards}", flush=True)
        rows += [row("async", f"k={k}: s per iteration", per_iter[k], "s", "median after the second"),
                 row("async", f"k={k}: engine idle", sides["engine"], "", ""),
                 row("async", f"k={k}: trainer idle", sides["trainer"], "", ""),
                 row("async", f"k={k}: held-out reward gain", gains[k], "", f"{before:.3f} -> {after:.3f}, "
                     f"{eval_prompts} prompts")]
    if 0 in per_iter:
        for k in (k for k in ks if k):
            rows.append(row("async", f"k={k} / k=0 s per iteration", per_iter[k] / per_iter[0], "x",
                            f"{per_iter[k]:.2f} vs {per_iter[0]:.2f} s", at_most=0.7 if k >= 2 else None))
            if gains[0] > 0:
                rows.append(row("async", f"k={k} / k=0 reward gain", gains[k] / gains[0], "x",
                                f"{gains[k]:+.3f} vs {gains[0]:+.3f}", at_least=0.8))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--iterations", type=int, default=0, help="iterations per run (default 15; --quick 6)")
    parser.add_argument("--staleness", default="0,1,2,4", help="comma-separated values of run.max_staleness")
    parser.add_argument("--eval-prompts", type=int, default=512, help="held-out prompts (default 512)")
    parser.add_argument("--overrides", default="[]", help="JSON list of config overrides for every run")
    parser.add_argument("--partial", action="store_true", help="run.partial_rollouts=true with k >= 2")
    parser.add_argument("--slow-engine", type=float, default=0.0,
                        help="seconds per prompt every engine call sleeps, in every run (generation the slower side)")
    args = parser.parse_args(argv)
    if args.slow_engine:
        from models.faults import SLOW_ENGINE_ENV

        os.environ[SLOW_ENGINE_ENV] = str(args.slow_engine)  # the runs' services inherit it
    iterations = args.iterations or (6 if args.quick else 15)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as root:
        rows = bench([int(k) for k in args.staleness.split(",")], iterations, args.eval_prompts, root,
                     json.loads(args.overrides), args.partial)
    print_rows(rows)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
