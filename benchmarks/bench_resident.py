"""Resident vs stateless seconds per iteration on the tiny presets, through ``pyflyte run`` as a user runs it.

    python benchmarks/bench_resident.py [--quick] [--iterations N] [--cases ppo,grpo,grpo-off-policy,ppo-bf16]
                                        [--layouts] [--json PATH]

Each case runs its preset twice with the same seeds, ``run.resident=false`` then ``=true``. Seconds per
iteration: the median of ``time/iteration_s`` (commit to commit, the run's own metric) over the
iterations after the first two (the first carries the engine start, the second the services' and
workers' warm-up). The rewards: ``rollout/reward_mean`` of every iteration on both sides, which must
agree within 1e-6 (the same samples and the same updates; with ``ppo-bf16`` the engine in bfloat16, which the
stateless run loads from the float32 checkpoint and the resident one receives cast by the trainer: the same
bits). Also printed: the launch-to-end wall time of
each run (set-up and the services' start included), and the resident run's weight transfer per update
(``time/weights_to_engine_s``, ``resident/weights_bytes``).

With ``--layouts`` each case runs resident twice instead, ``run.resident_layout=separate`` then ``=colocated``
(the engine in the actor trainer's ranks): seconds per iteration (median after the first), the rewards of every
iteration, which must agree within 1e-6, and the weights' bytes sent to an engine per update (0 colocated).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

CASES: Dict[str, Tuple[str, str, List[str]]] = {
    "ppo": ("ppo", "configs/tiny_ppo.yaml", []),
    "ppo-bf16": ("ppo", "configs/tiny_ppo.yaml", ["rollout.vllm_dtype=bfloat16"]),  # the push cast to bfloat16
    "grpo": ("reinforce", "configs/tiny_grpo.yaml", []),
    # one engine sharded over 2 workers: separate, its service's 2 processes; colocated, the actor's 2 ranks as
    # one engine group
    "grpo-tp2": ("reinforce", "configs/tiny_grpo.yaml", ["rollout.tensor_parallel_size=2"]),
    "grpo-off-policy": ("reinforce", "configs/tiny_grpo.yaml", ["run.off_policy_steps=1", "actor.tis_cap=2",
                                                                "actor.old_logprobs=recompute"]),
}
COMMON = ["run.eval_interval=0", "run.registered_model_name=", "run.checkpoint_artifact_max_mb=0"]


def run(workflow: str, preset: str, overrides: List[str], name: str, root: str) -> float:
    """Launch-to-end seconds of one ``pyflyte run``."""
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{root}/mlflow.db", PYTHONUNBUFFERED="1")
    pyflyte = os.path.join(os.path.dirname(sys.executable), "pyflyte")
    t0 = time.perf_counter()
    proc = subprocess.run([pyflyte, "run", f"workflows/{workflow}.py", f"{workflow}_training", "--preset", preset,
                           "--overrides", json.dumps(overrides + [f"run.storage_root={root}"]), "--run_name", name],
                          cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def metrics(root: str, name: str, key: str) -> List[float]:
    from mlflow.tracking import MlflowClient

    from models.run.layout import RunLayout

    run_id = RunLayout(root, name).read_run_info().mlflow_run_id
    history = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db").get_metric_history(run_id, key)
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def bench_case(case: str, iterations: int, root: str) -> List[Row]:
    workflow, preset, extra = CASES[case]
    overrides = [f"run.num_iterations={iterations}"] + COMMON + extra
    walls, per_iter, rewards = {}, {}, {}
    for mode in ("stateless", "resident"):
        name = f"{case}-{mode}"
        walls[mode] = run(workflow, preset, overrides + [f"run.resident={str(mode == 'resident').lower()}"], name,
                          root)
        per_iter[mode] = statistics.median(metrics(root, name, "time/iteration_s")[1:])
        rewards[mode] = metrics(root, name, "rollout/reward_mean")
    gap = max(abs(a - b) for a, b in zip(rewards["stateless"], rewards["resident"]))
    transfer = metrics(root, f"{case}-resident", "time/weights_to_engine_s")
    size = metrics(root, f"{case}-resident", "resident/weights_bytes")
    ratio = per_iter["resident"] / per_iter["stateless"]
    detail = (f"{per_iter['resident']:.2f} s vs {per_iter['stateless']:.2f} s per iteration (median after the "
              f"second); whole runs {walls['resident']:.0f} s vs {walls['stateless']:.0f} s")
    print(f"{case}: stateless rewards {[round(r, 4) for r in rewards['stateless']]}")
    print(f"{case}: resident  rewards {[round(r, 4) for r in rewards['resident']]}")
    return [row("resident", f"{case}: resident / stateless s per iteration", ratio, "x", detail, at_most=0.6),
            row("resident", f"{case}: max |reward resident - stateless|", gap, "",
                f"{len(rewards['resident'])} iterations", at_most=1e-6),
            row("resident", f"{case}: weights trainer -> engine per update", statistics.median(transfer), "s",
                f"{size[0] / 1e6:.1f} MB in memory (run.resident_weight_transport: its default), probe included")]


def bench_layouts(case: str, iterations: int, root: str) -> List[Row]:
    """The resident run of ``case`` in both layouts (``run.resident_layout``): seconds per iteration, the rewards
    (the same samples: every sample seeded by its prompt's index, whichever rank draws it) and the weights' bytes
    sent to the engine per update (colocated: 0, loaded in each rank's process)."""
    workflow, preset, extra = CASES[case]
    overrides = [f"run.num_iterations={iterations}", "run.resident=true"] + COMMON + extra
    per_iter, rewards, sent = {}, {}, {}
    for layout in ("separate", "colocated"):
        name = f"{case}-{layout}"
        wall = run(workflow, preset, overrides + [f"run.resident_layout={layout}"], name, root)
        per_iter[layout] = statistics.median(metrics(root, name, "time/iteration_s")[1:])
        rewards[layout] = metrics(root, name, "rollout/reward_mean")
        sent[layout] = statistics.median(metrics(root, name, "resident/weights_bytes"))
        print(f"{case} {layout}: {per_iter[layout]:.2f} s/iteration, whole run {wall:.0f} s, "
              f"{sent[layout] / 1e6:.2f} MB to the engine per update, rewards {[round(r, 4) for r in rewards[layout]]}")
    gap = max(abs(a - b) for a, b in zip(rewards["separate"], rewards["colocated"]))
    sleeps = metrics(root, f"{case}-colocated", "resident/sleep_s")
    return [row("resident", f"{case}: colocated / separate s per iteration", per_iter["colocated"] / per_iter["separate"],
                "x", f"{per_iter['colocated']:.2f} s vs {per_iter['separate']:.2f} s (median after the first)",
                at_most=1.0),
            row("resident", f"{case}: max |reward colocated - separate|", gap, "", f"{len(rewards['colocated'])} "
                f"iterations", at_most=1e-6),
            row("resident", f"{case}: colocated weights bytes to the engine per update", sent["colocated"], "B",
                f"separate: {sent['separate'] / 1e6:.2f} MB; colocated engine sleep {statistics.median(sleeps):.3f} "
                f"s per rollout", at_most=0.0)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--iterations", type=int, default=0, help="iterations per run (default 12; --quick 6)")
    parser.add_argument("--cases", default="", help=f"comma-separated, of {sorted(CASES)} (default: ppo,grpo,"
                                                    f"grpo-off-policy; with --layouts ppo,grpo)")
    parser.add_argument("--layouts", action="store_true",
                        help="resident colocated vs separate (run.resident_layout) instead of resident vs stateless")
    args = parser.parse_args(argv)
    iterations = args.iterations or (6 if args.quick else 12)
    cases = args.cases or ("ppo,grpo" if args.layouts else "ppo,grpo,grpo-off-policy")
    rows: List[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-resident-") as root:
        for case in cases.split(","):
            rows += (bench_layouts if args.layouts else bench_case)(case, iterations, root)
    print_rows(rows)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
