"""Episodes in lockstep against episodes at their own pace (``rollout.episode_pace``, docs/multi_turn.md): one
rollout of the tool demo's prompts on its warm-started chat model in vLLM, with an environment whose every step
takes ``--step-s`` seconds (as a remote environment, a sandbox or a judge does) and whose episodes last 1 to 4
turns by row (lengths varying 4x).

Per pace: seconds per rollout, the engine's idle share (the rollout's wall time outside vLLM's ``generate`` or
step calls: environments stepping, tools running, the loop itself) and the episodes' mean turns (the same
environments, so the same turn counts). The ratio per episode / lockstep is the figure; the issue's goal (0.6x)
is for per episode with ``run.max_staleness=2``, which multi-turn episodes do not support yet (its row says so).

    python benchmarks/bench_episodes.py [--quick] [--step-s 0.2] [--repeats 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

SECTION = "episodes"


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


def slow_env(step_s: float):
    """The tool demo's environment, done after ``1 + row["index"] % 4`` turns, each step taking ``step_s``."""
    from models.demos.tool_tasks import ArithmeticEnv
    from models.environments.episodes import Step

    class SlowVaryingEnv(ArithmeticEnv):
        def step(self, assistant: Dict[str, Any], tool_results: List[Dict[str, Any]]) -> Step:
            time.sleep(step_s)
            self.turns = getattr(self, "turns", 0) + 1
            if self.turns >= 1 + int(self.row["index"]) % 4:
                return super().step(assistant, []) if not tool_results else Step(done=True)
            return Step(messages=[] if tool_results else [{"role": "user", "content": "Check it once more."}])

    return SlowVaryingEnv


def measure(args) -> List[Row]:
    from transformers import AutoTokenizer

    from models.demos.tool_demo import build
    from models.demos.tool_tasks import problems
    from models.engines.base import SamplingSpec
    from models.engines.vllm_engine import VLLMEngine
    from models.environments.episode_rollout import sample_episodes
    from models.environments.episodes import EpisodeLimits
    from models.environments.tools import HermesParser

    cache = os.path.join(os.environ.get("RLHF_CACHE_DIR") or os.path.expanduser("~/.cache/flyte-rlhf"), "tool_demo")
    with tempfile.TemporaryDirectory() as out:
        actor = build(out, cache)["actor"]
        prompts, samples = (4, 2) if args.quick else (16, 4)
        rows = [dict(r, index=i) for i, r in enumerate(problems(prompts, 0))]
        tok = AutoTokenizer.from_pretrained(actor)
        engine = Timed(VLLMEngine(actor, max_model_len=1024))
        env = slow_env(args.step_s)
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
        Row(SECTION, "per episode k=2 / lockstep", None, "x", "<= 0.6", None,
            "not measured: run.max_staleness >= 2 refuses rollout.environment (#49 item 3)"),
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--step-s", type=float, default=0.2, help="seconds each environment step takes")
    parser.add_argument("--repeats", type=int, default=2, help="rollouts per pace (the best is kept)")
    args = parser.parse_args(argv)
    rows = measure(args)
    print_rows(rows)
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
