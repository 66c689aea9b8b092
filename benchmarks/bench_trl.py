"""This project's pipeline against TRL on the same work: seconds per iteration and reward.

Both sides get the same warm-started checkpoint (models/demos/tiny.py + models/demos/warm_start.py), the same
reversal prompts in the same order, the reward `models.demos.reverse_task:reverse_reward`, the same samples per
prompt, token cap, optimiser, clip and KL settings, and the same CPU budget: one training process
and `threads` torch threads (OMP_NUM_THREADS in every process of the pyflyte run,
`torch.set_num_threads` in TRL's). Ours is the real pipeline, `pyflyte run workflows/{reinforce,ppo}.py`
with configs/bench_{grpo,ppo}.yaml; TRL (GRPOTrainer, the experimental PPOTrainer) runs in
benchmarks/trl_runner.py from a spec derived from the same TrainConfig (`trl_spec`).

Seconds per iteration are wall-clock gaps between iteration ends (our commit progress lines, TRL's
optimiser-step callback); the first iteration pays start-up on both sides and is reported apart.
Reward: both final policies sampled on the same held-out prompts (T=1, the training seed as sampling
seed on both sides). With one training seed (`--seeds 1`, the default) ours - TRL is judged paired per
prompt; with `--seeds N` the grpo and ppo sections train each side N times (run.seed / TRL's seed
0..N-1; the seed also draws each iteration's prompts, the same on both sides) and judge the mean over
seeds of the per-seed difference (each the mean over the prompts) with its standard error over seeds,
so a gap that is one seed's luck, in training or in the eval samples, does not count. "Within noise"
means above -2 standard errors. Their speed rows are the seed-0 runs.

Generation is HF `generate` on both sides unless `--engine vllm`, which switches our side alone to
vLLM (rollout.engine): TRL has no CPU vLLM path (benchmarks/trl_runner.py), so the rows name each
side's engine, "ours (vLLM) / TRL (HF generate)".

    python benchmarks/bench_trl.py [--quick] [--seeds N] [--engine hf|vllm] [--json rows.json]
                                   [--details details.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402
from models.demos.reverse_task import ReverseTaskConfig, read_prompts_jsonl, reverse_reward  # noqa: E402
from models.demos.tiny import TinyModelConfig  # noqa: E402
from models.demos.tokenizer import load_tokenizer  # noqa: E402
from models.demos.warm_start import WarmStartConfig, build_demo_models, generate_responses  # noqa: E402
from models.data.draws import iteration_indices  # noqa: E402
from models.config import TrainConfig  # noqa: E402
from models.config.io import load_config  # noqa: E402
from models.run.layout import RunLayout  # noqa: E402
from models.demos.builders import cache_dir  # noqa: E402

SECTION = "trl"
PROGRESS = re.compile(r"^\[(?:ppo|reinforce|rloo|grpo|reinforce_pp)\] iter (\d+)/(\d+)")
PHASES = ("rollout", "score", "advantages", "actor_update", "critic_update")
RUN_TIMEOUT_S = 3600
TRL_DIFFERENCES = {
    "grpo": "",
    "ppo": "; TRL's PPO trains policy and value with one AdamW at the actor lr (vf_coef 0.1), clips no gradients "
           "and takes the same prompts in its own shuffled order",
}
"""What TRL does not let the comparison hold equal (it changes learning, not the work per iteration)."""
ENGINES = {"hf": "HF generate", "vllm": "vLLM"}
"""Our rollout engines (rollout.engine) as the rows name them; TRL generates with HF generate."""


@dataclass(frozen=True)
class ModelSize:
    """A tiny Llama and its supervised warm start (cached by content under the demo cache)."""

    label: str
    tiny: TinyModelConfig
    warm_start_steps: int


COMPUTE_BOUND = ModelSize("8x512", TinyModelConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8,
                                                   intermediate_size=2048, max_position_embeddings=160), 80)
"""The issue's compute-bound size; 160 positions fit a reversal prompt plus 128 new tokens; 80 warm-start
steps leave it partly right (sampled eval reward about 0.48)."""
PEER = ModelSize("2x128", TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                                          intermediate_size=512), 300)
"""The peer's size (2 layers x 128); 300 warm-start steps as the demo."""


@dataclass(frozen=True)
class Case:
    """One comparison: an algorithm at a model size and batch with one training seed, the same on both
    sides but for our rollout engine."""

    algorithm: str
    size: ModelSize
    prompts: int
    samples: int
    max_new_tokens: int
    iterations: int
    threads: int
    seed: int = 0
    """run.seed on our side, TRL's seed: it also draws each iteration's prompts (`iteration_indices`)."""
    engine: str = "hf"
    """Our rollout engine, a key of ENGINES; TRL generates with HF generate either way."""
    resident: bool = False
    """Our side with ``run.resident=true`` (the trainer and the engine stay loaded as services)."""

    @property
    def label(self) -> str:
        return f"{self.size.label}, {self.prompts}x{self.samples}x{self.max_new_tokens}"

    @property
    def name(self) -> str:
        """What names this case's runs (ours adds the time, TRL's folder a random suffix)."""
        return f"{self.algorithm}-{self.size.label}-{self.prompts}x{self.samples}-seed{self.seed}"

    def sides(self, op: str) -> str:
        """The two sides and how each generates, e.g. ``ours (vLLM) / TRL (HF generate)``."""
        return f"ours ({ENGINES[self.engine]}) {op} TRL ({ENGINES['hf']})"

    @property
    def workflow(self) -> str:
        return "ppo" if self.algorithm == "ppo" else "reinforce"

    def overrides(self, assets: Dict[str, str], storage_root: Path) -> List[str]:
        """Overrides of configs/bench_<algorithm>.yaml; minibatches shrink with small batches (at least
        two per iteration, so the TRL mapping of minibatches is exercised at every size). Each minibatch
        is one forward (micro-batch = minibatch) on both sides, as TRL's PPOTrainer runs it."""
        mini = max(1, min(64, self.prompts * self.samples // 2))
        micro = mini
        out = [f"run.num_iterations={self.iterations}", f"run.seed={self.seed}", f"run.storage_root={storage_root}",
               f"model.actor_path={assets['actor']}", f"data.train_prompts={assets['train_prompts']}",
               f"data.eval_prompts={assets['eval_prompts']}", f"rollout.engine={self.engine}",
               f"rollout.prompts_per_iteration={self.prompts}", f"rollout.n_samples_per_prompt={self.samples}",
               f"rollout.max_new_tokens={self.max_new_tokens}", f"actor.minibatch_size={mini}",
               f"actor.micro_batch_size={micro}"]
        if self.algorithm == "ppo":
            out += [f"model.critic_path={assets['critic']}", f"critic.minibatch_size={mini}",
                    f"critic.micro_batch_size={micro}"]
        return out + (["run.resident=true"] if self.resident else [])


@dataclass
class Side:
    """What one side measured: iteration end times (wall clock) from its launch, rewards, final policy."""

    start: float
    iteration_ends: List[float]
    rewards: List[float]
    actor: str
    response_length: Optional[float]
    """Mean generated tokens per sample (None: not logged, TRL's PPO)."""
    breakdown: Dict[str, float] = field(default_factory=dict)
    extra: Dict[str, object] = field(default_factory=dict)

    @property
    def first_s(self) -> float:
        return self.iteration_ends[0] - self.start

    @property
    def steady_s(self) -> float:
        """Mean gap between iteration ends after the first (the first alone when there is one)."""
        gaps = np.diff(self.iteration_ends)
        return float(gaps.mean()) if gaps.size else self.first_s

    def phases(self) -> str:
        """Mean seconds per task (our runs), and the rest of an iteration: Flyte, storage, process launches."""
        tasks = {k: v for k, v in self.breakdown.items() if k in PHASES}
        return ", ".join(f"{k} {v:.1f}" for k, v in tasks.items()) + f", Flyte/storage/launch {self.overhead_s:.1f} s"

    @property
    def overhead_s(self) -> float:
        """Seconds of an iteration outside the tasks' own work: Flyte, storage, process launches, requests."""
        return self.steady_s - sum(v for k, v in self.breakdown.items() if k in PHASES)


def build_assets(size: ModelSize, work: Path, eval_prompts: int) -> Dict[str, str]:
    """Warm-started actor (cached), its critic, train and eval prompt files, via the demo builder."""
    paths = build_demo_models(work / f"assets-{size.label}", os.path.join(cache_dir(), "warm_start"), size.tiny,
                              ReverseTaskConfig(), WarmStartConfig(steps=size.warm_start_steps),
                              num_eval_prompts=eval_prompts)
    return {k: str(v) for k, v in paths.items()}


def private_env(threads: int, work: Path) -> Dict[str, str]:
    """Environment of a measured process: `threads` threads, a private HOME (Flyte's local cache)."""
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", HOME=str(home), RLHF_CACHE_DIR=cache_dir(),
                MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}", PYTHONUNBUFFERED="1", TQDM_DISABLE="1",
                TRANSFORMERS_VERBOSITY="error", VLLM_LOGGING_LEVEL="WARNING",
                MPLCONFIGDIR=os.environ.get("MPLCONFIGDIR") or os.path.expanduser("~/.cache/matplotlib"))


def run_process(cmd: List[str], env: Dict[str, str], log: Path, on_line: Callable[[str], None]) -> None:
    """Run `cmd` in its own session, passing each output line to `on_line` and to `log` (with seconds
    since launch); raise with the tail on failure."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    tail: List[str] = []
    t0 = time.monotonic()
    deadline = t0 + RUN_TIMEOUT_S
    try:
        with open(log, "w", buffering=1) as f:  # line-buffered: readable while the run goes on
            for line in proc.stdout:
                on_line(line)
                f.write(f"{time.monotonic() - t0:8.1f} {line}")
                tail = (tail + [line])[-60:]
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{cmd[0]} ran past {RUN_TIMEOUT_S} s")
        if proc.wait() != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} exited with {proc.returncode}:\n{''.join(tail)}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # the group this call started (pyflyte and its elastic workers)
            proc.wait()


def mlflow_series(uri: str, run_id: str, keys: List[str]) -> Dict[str, List[float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return {k: [m.value for m in sorted(client.get_metric_history(run_id, k), key=lambda m: m.step)] for k in keys}


def run_ours(case: Case, overrides: List[str], work: Path) -> Side:
    """`pyflyte run` of the case; iteration ends are the arrival times of its commit progress lines."""
    name = f"bench-{case.name}-{time.strftime('%H%M%S')}"
    cmd = [str(Path(sys.executable).parent / "pyflyte"), "run", f"workflows/{case.workflow}.py",
           f"{case.workflow}_training", "--preset", f"configs/bench_{case.algorithm}.yaml",
           "--overrides", json.dumps(overrides), "--run_name", name]
    env = private_env(case.threads, work)
    ends: List[float] = []
    start = time.time()
    run_process(cmd, env, work / f"{name}.log", lambda line: ends.append(time.time()) if PROGRESS.match(line) else None)
    layout = RunLayout(str(work / "runs"), name)
    keys = [f"time/{p}_s" for p in PHASES] + ["time/generate_s", "rollout/reward_mean",
                                              "rollout/response_length_mean", "actor/optimizer_steps_total"]
    series = mlflow_series(env["MLFLOW_TRACKING_URI"], layout.read_run_info().mlflow_run_id, keys)
    steady = slice(1, None) if len(ends) > 1 else slice(None)
    breakdown = {k.split("/")[1][:-2]: float(np.mean(v[steady])) for k, v in series.items()
                 if k.startswith("time/") and v}
    return Side(start, ends, series["rollout/reward_mean"], layout.read_state().actor_url,
                float(np.mean(series["rollout/response_length_mean"])), breakdown,
                extra={"optimizer_steps": int(series["actor/optimizer_steps_total"][-1])})


def trl_spec(cfg: TrainConfig, prompts: List[str], threads: int) -> Dict[str, object]:
    """TRL's settings from our config; the prompts in the order our rollouts take them."""
    a, r, k = cfg.actor, cfg.rollout, cfg.kl
    trl_kl = {"grpo": ("loss", ("k3",)), "ppo": ("reward", ("k1", "k3"))}[cfg.run.algorithm]
    if k.placement != trl_kl[0] or k.estimator not in trl_kl[1]:
        raise ValueError(f"TRL's {cfg.run.algorithm} has KL {trl_kl}, the config kl.placement={k.placement}, "
                         f"kl.estimator={k.estimator}")
    order = [prompts[i] for it in range(cfg.run.num_iterations)
             for i in iteration_indices(len(prompts), r.prompts_per_iteration, it, cfg.run.seed)]
    return dict(algorithm=cfg.run.algorithm, actor=cfg.model.actor_path, critic=cfg.model.critic_path, prompts=order,
                prompts_per_iteration=r.prompts_per_iteration, n_samples=r.n_samples_per_prompt,
                iterations=cfg.run.num_iterations, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                top_p=r.top_p, lr=a.lr, weight_decay=a.weight_decay, epochs=a.ppo_epochs,
                minibatch_size=a.minibatch_size, micro_batch_size=a.micro_batch_size, clip_eps=a.clip_eps,
                grad_clip=a.grad_clip, kl_coef=k.coef, kl_estimator=k.estimator, value_clip=cfg.critic.value_clip,
                gamma=cfg.advantage.gamma, lam=cfg.advantage.lam, seed=cfg.run.seed, threads=threads)


def run_trl(cfg: TrainConfig, case: Case, prompts: List[str], work: Path) -> Side:
    """benchmarks/trl_runner.py in its own process with the case's thread count."""
    out = Path(tempfile.mkdtemp(prefix=f"trl-{case.name}-", dir=work))  # cases of one name differ elsewhere
    (out / "spec.json").write_text(json.dumps(trl_spec(cfg, prompts, case.threads)))
    start = time.time()
    run_process([sys.executable, str(ROOT / "benchmarks" / "trl_runner.py"), "--spec", str(out / "spec.json"),
                 "--out", str(out / "result.json")], private_env(case.threads, work), out / "trl.log",
                lambda line: None)
    res = json.loads((out / "result.json").read_text())
    extra = {k: res[k] for k in ("trl_version", "trainer", "threads", "losses", "max_weight_change", "train_start",
                                 "optimizer_steps")}
    return Side(start, res["iteration_ends"], res["rewards"], res["actor"], res["response_length_mean"], extra=extra)


def eval_rewards(actor_dir: str, prompts: List[str], threads: int, seed: int = 0) -> np.ndarray:
    """Per-prompt `reverse_reward` of one sample (T=1, `seed`) from the policy in `actor_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(actor_dir).eval()
    responses = generate_responses(model, load_tokenizer(actor_dir), prompts, ReverseTaskConfig().max_new_tokens,
                                   temperature=1.0, seed=seed, threads=threads)
    return np.asarray(reverse_reward(prompts, responses))


@dataclass
class Comparison:
    case: Case
    ours: Side
    trl: Side

    @property
    def ratio(self) -> float:
        return self.ours.steady_s / self.trl.steady_s


def compare(case: Case, work: Path, eval_n: int, assets_cache: Dict[str, Dict[str, str]]) -> Comparison:
    """Build (or reuse) the case's assets, run our pipeline, then TRL, on the same config."""
    assets = assets_cache.get(case.size.label) or assets_cache.setdefault(
        case.size.label, build_assets(case.size, work, eval_n))
    overrides = case.overrides(assets, work / "runs")
    cfg = load_config(f"configs/bench_{case.algorithm}.yaml", overrides)
    ours = run_ours(case, overrides, work)
    trl = run_trl(cfg, case, read_prompts_jsonl(assets["train_prompts"]), work)
    check_same_steps(cfg, ours, trl)
    return Comparison(case, ours, trl)


def check_same_steps(cfg: TrainConfig, ours: Side, trl: Side) -> None:
    """Both sides took the optimiser steps the config asks for (``epochs × ⌈rows / minibatch⌉`` per
    iteration), counted from AdamW's state: a mapping onto TRL's batch settings that did other work
    fails here instead of giving a ratio of different things."""
    a, r = cfg.actor, cfg.rollout
    want = cfg.run.num_iterations * a.ppo_epochs * -(-r.prompts_per_iteration * r.n_samples_per_prompt
                                                     // a.minibatch_size)
    got = {"ours": ours.extra["optimizer_steps"], "TRL": trl.extra["optimizer_steps"]}
    if any(v != want for v in got.values()):
        raise RuntimeError(f"optimizer steps ours {got['ours']}, TRL {got['TRL']}; the config asks for {want} "
                           f"({cfg.run.num_iterations} iterations x {a.ppo_epochs} epochs x minibatches of "
                           f"{a.minibatch_size} rows)")


def speed_row(runs: List[Comparison]) -> Row:
    """Seconds per iteration ours / TRL of the seed-0 runs; with more seeds their ratios in the detail."""
    c = runs[0]
    o, t, n = c.ours, c.trl, c.case.iterations
    which = f"iterations 2-{n} of {n}" if n > 1 else "1 iteration, incl. start-up"
    seeds = "" if len(runs) == 1 else (f"; seed 0 of {len(runs)}, ours / TRL by seed: "
                                       + ", ".join(f"{r.ratio:.2f}x" for r in runs))
    trl_len = "n/a" if t.response_length is None else f"{t.response_length:.1f}"
    return row(SECTION, f"{c.case.algorithm.upper()} s/iter {c.case.sides('/')} ({c.case.label})", c.ratio, "x",
               f"ours {o.steady_s:.1f} s, TRL {t.steady_s:.1f} s ({which}, {c.case.threads} thread(s), 1 process "
               f"each){seeds}; first iteration incl. start-up: ours {o.first_s:.1f} s, TRL {t.first_s:.1f} s; ours "
               f"per iteration: {o.phases()}; mean response tokens ours "
               f"{o.response_length:.1f}, TRL {trl_len}; TRL {t.extra['trl_version']} {t.extra['trainer']}",
               at_most=1.0)


def reward_gap(ours: List[np.ndarray], trl: List[np.ndarray]) -> Tuple[float, float]:
    """Mean eval reward ours - TRL and its standard error, from each seed's per-prompt rewards (the same
    prompts in every array): one seed is judged paired per prompt; more over seeds, each seed's difference
    the mean over the prompts, so that seed-to-seed variance counts."""
    d = np.stack(ours) - np.stack(trl)  # [seeds, prompts]
    per = d[0] if len(d) == 1 else d.mean(axis=1)
    return float(per.mean()), float(per.std(ddof=1) / np.sqrt(per.size))


def reward_row(runs: List[Comparison], eval_prompts: List[str], start_reward: np.ndarray) -> Row:
    """Eval reward ours - TRL after training, judged by `reward_gap`: >= -2 standard errors."""
    c = runs[0].case
    # Each seed's samples with its own sampling seed, so the seeds' differences are independent draws.
    ours = [eval_rewards(r.ours.actor, eval_prompts, c.threads, r.case.seed) for r in runs]
    trl = [eval_rewards(r.trl.actor, eval_prompts, c.threads, r.case.seed) for r in runs]
    gap, se = reward_gap(ours, trl)
    if len(runs) == 1:
        seeds, sampled, where, spread = "", "same seed", "", f"paired SE {se:.3f}"
        last = f"ours {runs[0].ours.rewards[-1]:.3f}, TRL {runs[0].trl.rewards[-1]:.3f}"
    else:
        seeds, sampled = f", {len(runs)} seeds", "sampling seed = training seed, both sides; warm start seed 0"
        where = ("; ours / TRL by seed: "
                 + ", ".join(f"{r.case.seed}: {o.mean():.3f} / {t.mean():.3f}" for r, o, t in zip(runs, ours, trl)))
        spread = f"SE over seeds {se:.3f}"
        last = (f"(mean over seeds) ours {np.mean([r.ours.rewards[-1] for r in runs]):.3f}, "
                f"TRL {np.mean([r.trl.rewards[-1] for r in runs]):.3f}")
    return Row(SECTION, f"{c.algorithm.upper()} eval reward {c.sides('-')} after {c.iterations} iterations "
               f"({c.label}{seeds})", gap, "reward", ">= 0 within noise (-2 SE)", bool(gap >= -2 * se),
               f"ours {np.mean(ours):.3f}, TRL {np.mean(trl):.3f}, warm start {start_reward.mean():.3f} on "
               f"{len(eval_prompts)} held-out prompts (T=1, {sampled}){where}; {spread}; last training batch "
               f"{last}{TRL_DIFFERENCES[c.algorithm]}")


@dataclass(frozen=True)
class Plan:
    """What a run measures: the main case (GRPO; PPO is the same with a critic), the sweep, the peer case."""

    main: Case
    sweep: Tuple[int, ...]
    """Prompts per iteration of the crossover sweep (besides the main case's, when it ran)."""
    sweep_iterations: int
    peer: Case
    eval_prompts: int
    seeds: int = 1
    """Training seeds (0..seeds-1) of the main case in the grpo and ppo sections."""


def plan_for(quick: bool, threads: int, iterations: Optional[int], seeds: int = 1, engine: str = "hf") -> Plan:
    """Full: the issue's compute-bound GRPO/PPO, a sweep of the batch, the peer case (one thread).
    Quick: everything at the peer size, 2 iterations. `engine` is our rollout engine in every case."""
    peer = Case("grpo", PEER, 8, 4, 16, iterations=2 if quick else 5, threads=1, engine=engine)
    if quick:
        plan = Plan(main=replace(peer, threads=threads), sweep=(2, 16), sweep_iterations=2, peer=peer,
                    eval_prompts=64, seeds=seeds)
    else:
        plan = Plan(main=Case("grpo", COMPUTE_BOUND, 64, 4, 128, iterations=3, threads=threads, engine=engine),
                    sweep=(8, 32), sweep_iterations=2, peer=peer, eval_prompts=256, seeds=seeds)
    if iterations:
        plan = replace(plan, main=replace(plan.main, iterations=iterations),
                       peer=replace(plan.peer, iterations=iterations), sweep_iterations=iterations)
    return plan


SECTIONS = ("grpo", "ppo", "sweep", "peer")


class Bench:
    """Runs the plan's sections; a comparison measured once serves every section that needs it."""

    def __init__(self, plan: Plan, work: Path) -> None:
        self.plan, self.work = plan, work
        self.assets: Dict[str, Dict[str, str]] = {}
        self.done: Dict[Case, Comparison] = {}

    def compare(self, case: Case) -> Comparison:
        if case not in self.done:
            self.done[case] = compare(case, self.work, self.plan.eval_prompts, self.assets)
        return self.done[case]

    def algorithm(self, name: str) -> List[Row]:
        """The main case with `name`, once per training seed: its speed row and its reward row."""
        runs = [self.compare(replace(self.plan.main, algorithm=name, seed=s)) for s in range(self.plan.seeds)]
        case = runs[0].case
        assets = self.assets[case.size.label]
        prompts = read_prompts_jsonl(assets["eval_prompts"])
        return [speed_row(runs), reward_row(runs, prompts, eval_rewards(assets["actor"], prompts, case.threads))]

    def sweep(self) -> List[Row]:
        main = self.plan.main
        cases = [replace(main, prompts=p, iterations=self.plan.sweep_iterations) for p in self.plan.sweep]
        found = sorted([self.compare(c) for c in cases] + [c for c in self.done.values() if c.case == main],
                       key=lambda c: c.case.prompts)
        rows = [row(SECTION, f"GRPO s/iter {c.case.sides('/')} at {c.case.prompts}x{c.case.samples} "
                    f"({c.case.size.label})", c.ratio, "x", f"ours {c.ours.steady_s:.1f} s, TRL "
                    f"{c.trl.steady_s:.1f} s ({c.case.iterations} iterations, {c.case.threads} thread(s))")
                for c in found]
        faster = [c.case.prompts for c in found if c.ratio <= 1.0]
        ratios = ", ".join(f"{c.case.prompts}: {c.ratio:.2f}x" for c in found)
        rows.append(row(SECTION, f"GRPO crossover: fewest prompts/iter (x{main.samples}) where ours is faster",
                        faster[0] if faster else None, "prompts", f"{main.sides('/')} by prompts per iteration: "
                        f"{ratios}" + ("" if faster else f"; ours not faster up to {found[-1].case.prompts}")))
        return rows

    def peer(self) -> List[Row]:
        """The peer case against TRL, ours stateless and resident (``run.resident=true``; TRL run once)."""
        c = self.compare(self.plan.peer)
        o, t = c.ours, c.trl
        where = f"({c.case.label}, {c.case.threads} thread)"
        resident = replace(c.case, resident=True)
        r = run_ours(resident, resident.overrides(self.assets[c.case.size.label], self.work / "runs"), self.work)
        return [row(SECTION, f"Peer GRPO s/iter TRL {where}", t.steady_s, "s",
                    f"TRL {t.extra['trl_version']} {t.extra['trainer']}; first iteration incl. start-up "
                    f"{t.first_s:.1f} s"),
                row(SECTION, f"Peer GRPO s/iter ours {where}", o.steady_s, "s",
                    f"{o.phases()}; first iteration incl. start-up {o.first_s:.1f} s; rollouts with "
                    f"{ENGINES[c.case.engine]}"),
                row(SECTION, f"Peer GRPO s/iter {c.case.sides('/')} {where}", c.ratio, "x",
                    "fixed per-iteration cost dominates at this size (its <= 10 s target: bench_iteration.py)"),
                row(SECTION, f"Peer GRPO s/iter ours resident {where}", r.steady_s, "s",
                    f"{r.phases()}; first iteration incl. the services' start {r.first_s:.1f} s"),
                row(SECTION, f"Peer GRPO Flyte/storage/requests s/iter, ours resident {where}", r.overhead_s, "s",
                    f"of {r.steady_s:.2f} s: the iteration outside its stages' own time (stateless: "
                    f"{o.overhead_s:.2f} s of {o.steady_s:.2f} s)"),
                row(SECTION, f"Peer GRPO s/iter ours resident / TRL {where}", r.steady_s / t.steady_s, "x",
                    f"stateless {c.ratio:.2f}x; the rewards of both our modes: {r.rewards == o.rewards}",
                    at_most=3.0)]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--details", metavar="PATH", help="also write every measurement (iteration ends, rewards, "
                        "losses, phase times) as JSON")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--iterations", type=int, help="iterations per side in every case (default: the plan's)")
    parser.add_argument("--seeds", type=int, default=1, help="training seeds 0..N-1 per side in the grpo and ppo "
                        "sections; with 2 or more the eval reward is judged over seeds, not per prompt")
    parser.add_argument("--engine", choices=sorted(ENGINES), default="hf", help="our rollout engine "
                        "(rollout.engine); TRL generates with HF generate either way (no CPU vLLM path)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (runs, checkpoints, logs)")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    if set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(set(sections) - set(SECTIONS))}; choose from {SECTIONS}")
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    work = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    bench = Bench(plan_for(args.quick, args.threads, args.iterations, args.seeds, args.engine), work)
    rows: List[Row] = []
    for name in sections:
        try:
            rows += bench.algorithm(name) if name in ("grpo", "ppo") else getattr(bench, name)()
        except Exception as e:  # one failed section must not hide the others
            rows.append(Row(SECTION, f"{name} comparison", None, "", "runs", False,
                            f"{type(e).__name__}: {e}"[-3000:] + f" (logs: {work})"))
            args.keep = True
    print_rows(rows)
    write_rows(args.json, rows)
    if args.details:
        Path(args.details).write_text(json.dumps([{"case": asdict(c.case), "ours": asdict(c.ours),
                                                   "trl": asdict(c.trl)} for c in bench.done.values()], indent=2))
    if args.keep:
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
