"""Episodes in lockstep against episodes at their own pace (``rollout.episode_pace``, docs/multi_turn.md), and
asynchronous training with episodes (``run.max_staleness=2``), on the tool demo's warm-started chat model in
vLLM, with an environment whose every step takes ``--step-s`` seconds (as a remote environment, a sandbox or a
judge does) and whose episodes last 1 to 4 turns by row (lengths varying 4x): :class:`VaryingEnv`.

Rollout rows (one rollout in this process): seconds per rollout, the engine's idle share (the rollout's wall time
outside vLLM's ``generate`` or step calls: environments stepping, tools running, the loop itself) and the episodes'
mean turns (the same environments, so the same turn counts).

Run rows (``--runs``, three resident GRPO runs of ``configs/tiny_tools.yaml`` through ``pyflyte run``, the separate
layout, ``--iterations`` each): seconds per iteration in lockstep, per episode, and per episode with
``run.max_staleness=2`` (the engine service sampling episodes ahead while the trainer updates), from the MLflow
timestamps of iteration 1 to the last (start-up excluded), and the sampled reward of the last two iterations (the
same number of samples each). The issue's goal: per episode with k=2 at most 0.6x lockstep.

    python benchmarks/bench_episodes.py [--quick] [--step-s 0.2] [--repeats 2] [--runs] [--iterations 4]
                                        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402
from models.demos.tool_tasks import ArithmeticEnv  # noqa: E402
from models.environments.episodes import Step  # noqa: E402

SECTION = "episodes"
STEP_ENV = "BENCH_EPISODES_STEP_S"
"""Seconds each step of :class:`VaryingEnv` takes (the runs' services inherit it)."""


class VaryingEnv(ArithmeticEnv):
    """The tool demo's environment, done after ``1 + index % 4`` turns (``index``: the row's, else a hash of its
    prompt), each step taking ``$BENCH_EPISODES_STEP_S`` seconds; after a turn short of that, the user asks again."""

    def step(self, assistant: Dict[str, Any], tool_results: List[Dict[str, Any]]) -> Step:
        time.sleep(float(os.environ.get(STEP_ENV) or 0))
        self.turns = getattr(self, "turns", 0) + 1
        index = int(self.row["index"]) if "index" in self.row else zlib.crc32(str(self.row["prompt"]).encode())
        if self.turns >= 1 + index % 4:
            return super().step(assistant, []) if not tool_results else Step(done=True)
        return Step(messages=[] if tool_results else [{"role": "user", "content": "Check it once more."}])


class Timed:
    """An engine whose generate and stream-step calls are timed (the engine's busy seconds)."""

    def __init__(self, engine):
        self.engine, self.busy_s = engine, 0.0

    def __getattr__(self, name: str):
        attr = getattr(self.engine, name)
        if name not in ("generate", "stream_step"):
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - t0
        return timed


def demo_cache() -> str:
    return os.path.join(os.environ.get("RLHF_CACHE_DIR") or os.path.expanduser("~/.cache/flyte-rlhf"), "tool_demo")


def measure(args) -> List[Row]:
    from transformers import AutoTokenizer

    from models.demos.tool_demo import build
    from models.demos.tool_tasks import problems
    from models.engines.base import SamplingSpec
    from models.engines.vllm_engine import VLLMEngine
    from models.environments.episode_rollout import sample_episodes
    from models.environments.episodes import EpisodeLimits
    from models.environments.tools import HermesParser

    with tempfile.TemporaryDirectory() as out:
        actor = build(out, demo_cache())["actor"]
        prompts, samples = (4, 2) if args.quick else (16, 4)
        rows = [dict(r, index=i) for i, r in enumerate(problems(prompts, 0))]
        tok = AutoTokenizer.from_pretrained(actor)
        engine = Timed(VLLMEngine(actor, max_model_len=1024))
        os.environ[STEP_ENV] = str(args.step_s)
        env = VaryingEnv
        spec = SamplingSpec(temperature=1.0, max_new_tokens=48, n=samples, seed=0)
        results: Dict[str, Dict[str, float]] = {}
        try:
            for pace in ("lockstep", "episode") * args.repeats:
                engine.busy_s = 0.0
                t0 = time.perf_counter()
                _, _, stats = sample_episodes(engine, tok, env, rows, list(range(len(rows))), spec,
                                              EpisodeLimits(max_turns=4, max_episode_tokens=300, pace=pace),
                                              HermesParser())
                wall = time.perf_counter() - t0
                best = results.get(pace)
                if best is None or wall < best["wall"]:
                    results[pace] = {"wall": wall, "idle": 1 - engine.busy_s / wall,
                                     "turns": stats["episode/turns_mean"]}
        finally:
            engine.engine.close()
    lock, each = results["lockstep"], results["episode"]
    what = f"{prompts} prompts x {samples} samples, 1-4 turns, {args.step_s:g} s per environment step"
    return [
        row(SECTION, "lockstep s/rollout", lock["wall"], "s", f"{what}; mean turns {lock['turns']:.2f}"),
        row(SECTION, "per episode s/rollout", each["wall"], "s", f"mean turns {each['turns']:.2f}"),
        row(SECTION, "per episode / lockstep", each["wall"] / lock["wall"], "x", f"best of {args.repeats} each"),
        row(SECTION, "engine idle share, lockstep", lock["idle"], "", "wall time outside generate"),
        row(SECTION, "engine idle share, per episode", each["idle"], "", "wall time outside the step calls"),
    ]


RUNS = {"lockstep": ["rollout.episode_pace=lockstep"], "per episode": ["rollout.episode_pace=episode"],
        "per episode k=2": ["rollout.episode_pace=episode", "run.max_staleness=2", "actor.tis_cap=2"]}
"""The three runs, on top of the tool preset made resident (separate layout) with :class:`VaryingEnv`."""


def measure_runs(args, demo: Dict[str, str], root: str) -> List[Row]:
    """The three runs of the module's docstring, one after the other."""
    from mlflow.tracking import MlflowClient

    common = [f"run.storage_root={root}/runs", f"run.num_iterations={args.iterations}", "run.eval_interval=0",
              "run.eval_before_training=false", "run.save_interval=100", "run.resident=true",
              "run.registered_model_name=", "run.checkpoint_artifact_max_mb=0", f"model.actor_path={demo['actor']}",
              f"data.train_prompts={demo['train']}", f"data.eval_prompts={demo['eval']}", "rollout.max_turns=4",
              "rollout.environment=benchmarks.bench_episodes:VaryingEnv", "rollout.max_episode_tokens=300"]
    if args.quick:
        common += ["rollout.prompts_per_iteration=4", "rollout.n_samples_per_prompt=2", "actor.minibatch_size=8",
                   "actor.micro_batch_size=8"]
    db = f"sqlite:///{root}/mlflow.db"
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(os.environ, MLFLOW_TRACKING_URI=db, PYTHONUNBUFFERED="1", PYTHONPATH=path,  # VaryingEnv's module
               **{STEP_ENV: str(args.step_s)})
    pyflyte = os.path.join(os.path.dirname(sys.executable), "pyflyte")
    got: Dict[str, Dict[str, float]] = {}
    for i, (mode, extra) in enumerate(RUNS.items()):
        name = f"episodes-{i}"
        cmd = [pyflyte, "run", "workflows/reinforce.py", "reinforce_training", "--preset", "configs/tiny_tools.yaml",
               "--overrides", json.dumps(common + extra), "--run_name", name]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{mode}: pyflyte exited {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
        client = MlflowClient(db)
        run = client.search_runs([client.get_experiment_by_name("flyte-rlhf").experiment_id],
                                 f"attributes.run_name = '{name}'")[0]
        history = sorted(client.get_metric_history(run.info.run_id, "rollout/reward_mean"), key=lambda m: m.step)
        idle = client.get_metric_history(run.info.run_id, "async/engine_idle_fraction")
        got[mode] = {"s_per_iteration": (history[-1].timestamp - history[0].timestamp) / 1000 / (len(history) - 1),
                     "reward": sum(m.value for m in history[-2:]) / len(history[-2:]),
                     "wall": time.perf_counter() - t0,
                     "idle": sum(m.value for m in idle) / len(idle) if idle else float("nan")}
    lock, each, ahead = got["lockstep"], got["per episode"], got["per episode k=2"]
    what = f"{args.iterations} iterations, resident, {args.step_s:g} s per environment step"
    rows = [row(SECTION, f"run s/iteration, {mode}", g["s_per_iteration"], "s",
                f"{what}; sampled reward of the last two iterations {g['reward']:.3f}; launch {g['wall']:.0f} s"
                + (f"; engine idle {g['idle']:.2f}" if mode.endswith("k=2") else ""))
            for mode, g in got.items()]
    rows.append(row(SECTION, "run per episode / lockstep", each["s_per_iteration"] / lock["s_per_iteration"], "x",
                    "seconds per iteration"))
    rows.append(row(SECTION, "run per episode k=2 / lockstep", ahead["s_per_iteration"] / lock["s_per_iteration"],
                    "x", "seconds per iteration", at_most=0.6))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--step-s", type=float, default=0.2, help="seconds each environment step takes")
    parser.add_argument("--repeats", type=int, default=2, help="rollouts per pace (the best is kept)")
    parser.add_argument("--runs", action="store_true", help="also the three training runs through pyflyte run")
    parser.add_argument("--iterations", type=int, default=4, help="iterations of each run")
    args = parser.parse_args(argv)
    rows = measure(args)
    if args.runs:
        from models.demos.tool_demo import build

        with tempfile.TemporaryDirectory() as root:
            rows += measure_runs(args, build(os.path.join(root, "demo"), demo_cache()), root)
    print_rows(rows)
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
