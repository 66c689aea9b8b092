"""A Qwen3-0.6B-shaped run in each mode against TRL's GRPOTrainer: peak memory of the whole process tree,
seconds per iteration, and the engine/trainer log-prob gap.

The work (issue 46): a checkpoint of Qwen3-0.6B's exact shape (28 layers, 1,024 wide, tied 151,936-row
embedding, bf16 safetensors, random weights; ``models/demos/real_shapes.py``) with Qwen3's real tokenizer
and chat template, conversational prompts in TRL's format and a reward in TRL's keyword form
(``models/demos/chat_prompts.py``); GRPO, 4 prompts x 4 samples, 32 new tokens, 2 actor ranks
(``configs/qwen3_grpo.yaml``). Ours runs through the public CLI, ``pyflyte run workflows/reinforce.py
reinforce_training``, once per mode: stateless, resident with separate services (``run.resident=true``)
and resident colocated (``run.resident_layout=colocated``). TRL (``benchmarks/trl_runner.py``, fp32, HF
generate: no CPU vLLM path) trains the same model on the same rows with the same reward.

Memory: the RSS of the launched process and all its descendants, summed every 0.2 s
(``benchmarks/tree_memory.py``), its peak and the processes at the peak (the goal's figure: RSS counts a page
forked ranks share with their forkserver in each of them); and the tree's PSS summed every second, what the
tree takes from the machine's memory (each shared page once). Seconds per iteration: gaps
between our commit progress lines (TRL's optimiser-step callback), the first iteration apart. The gap:
``rollout/logprob_gap_mean`` / ``_max`` (sampler vs π_old) and ``rollout/probe_gap_max`` from MLflow.

    python benchmarks/bench_real_shape.py [--layers 28] [--iterations 3] [--modes stateless,separate,colocated,trl]

At 28 layers each side needs up to ~16 GiB: on a shared machine run it under ``flock /tmp/heavy.lock``. Exit
status 1 when a side did not finish or a ratio to TRL is over its goal (1.0x), as ``run_all.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_trl import PROGRESS, mlflow_series  # noqa: E402
from benchmarks.rows import Row, add_bench_args, exit_status, print_rows, row, write_rows  # noqa: E402
from benchmarks.tree_memory import GIB, TreeSampler  # noqa: E402
from models.config.io import load_config  # noqa: E402
from models.data.draws import iteration_indices  # noqa: E402
from models.demos.chat_prompts import write_chat_prompts  # noqa: E402
from models.demos.real_shapes import QWEN3_0_6B, BuildOptions, real_checkpoint  # noqa: E402
from models.environ import cache_dir  # noqa: E402
from models.run.layout import RunLayout  # noqa: E402

SECTION = "real_shape"
PRESET = "configs/qwen3_grpo.yaml"
MODES = {"stateless": [], "separate": ["run.resident=true"],
         "colocated": ["run.resident=true", "run.resident_layout=colocated", "rollout.tensor_parallel_size=2"]}
"""Our modes and their overrides of the preset. Colocated: one engine sharded over the two ranks of the host
(each holds half its weights and KV cache) rather than a whole engine in each (docs/real_checkpoints.md)."""
GAPS = ("rollout/logprob_gap_mean", "rollout/logprob_gap_max", "rollout/probe_gap_max")
RUN_TIMEOUT_S = 3 * 3600


@dataclass
class Measured:
    """One side's run: its iteration ends (wall clock), peak memory, gaps, and how it ended."""

    name: str
    start: float
    ends: List[float] = field(default_factory=list)
    peak_gib: float = 0.0
    peak_parts: str = ""
    pss_gib: float = 0.0
    """The peak of the tree's PSS (shared pages counted once), sampled every second."""
    pss_parts: str = ""
    gaps: Dict[str, float] = field(default_factory=dict)
    error: str = ""

    @property
    def steady_s(self) -> Optional[float]:
        """Mean gap between iteration ends after the first (None with fewer than two)."""
        e = self.ends
        return (e[-1] - e[0]) / (len(e) - 1) if len(e) > 1 else None

    @property
    def first_s(self) -> Optional[float]:
        return self.ends[0] - self.start if self.ends else None


def run_measured(cmd: List[str], env: Dict[str, str], log: Path, m: Measured, progress=PROGRESS) -> None:
    """Run ``cmd`` in its own session, sampling its tree's memory; the arrival times of progress lines
    into ``m.ends``; a failure (exit status and the log's tail) into ``m.error``."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    tail: List[str] = []
    try:
        with TreeSampler(proc.pid) as sampler, open(log, "w", buffering=1) as f:
            for line in proc.stdout:
                if progress.match(line):
                    m.ends.append(time.time())
                f.write(f"{time.time() - m.start:8.1f} {line}")
                tail = (tail + [line])[-40:]
                if time.time() - m.start > RUN_TIMEOUT_S:
                    raise TimeoutError(f"ran past {RUN_TIMEOUT_S} s")
            proc.wait()
        if proc.returncode:
            m.error = f"exit {proc.returncode}: " + "".join(tail)[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # the group this call started
            proc.wait()
    m.peak_gib, m.peak_parts = sampler.peak.rss / GIB, sampler.peak.describe()
    m.pss_gib, m.pss_parts = sampler.peak_pss.rss / GIB, sampler.peak_pss.describe()
    with open(log.with_suffix(".rss.jsonl"), "w") as f:  # the tree's memory over time, for finding where it goes
        f.writelines(json.dumps({"t": round(t, 1), "total": total, "parts": parts}) + "\n"
                     for t, total, parts in sampler.series)


def env_for(work: Path, threads: Optional[int]) -> Dict[str, str]:
    """A measured process's environment: its own HOME (Flyte's local cache) and MLflow store; torch
    threads left to the launcher (ranks share the cores) unless ``threads`` is given."""
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HOME=str(home), RLHF_CACHE_DIR=cache_dir(), PYTHONPATH=str(ROOT),
               MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}", PYTHONUNBUFFERED="1", TQDM_DISABLE="1",
               TRANSFORMERS_VERBOSITY="error", VLLM_LOGGING_LEVEL="WARNING")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def assets(work: Path, layers: int) -> Dict[str, str]:
    """The real-shaped checkpoint (cached) and the prompt files."""
    ckpt = real_checkpoint(QWEN3_0_6B, BuildOptions(num_layers=layers))
    return {"actor": str(ckpt), **write_chat_prompts(work / "prompts")}


def overrides(a: Dict[str, str], work: Path, iterations: int, mode: str, extra: List[str]) -> List[str]:
    return [f"model.actor_path={a['actor']}", f"data.train_prompts={a['train_prompts']}",
            f"data.eval_prompts={a['eval_prompts']}", f"run.num_iterations={iterations}",
            f"run.storage_root={work / 'runs'}", *MODES[mode], *extra]


def run_ours(mode: str, a: Dict[str, str], work: Path, iterations: int, extra: List[str]) -> Measured:
    name = f"real-{mode}-{time.strftime('%H%M%S')}"
    ov = overrides(a, work, iterations, mode, extra)
    cmd = [str(Path(sys.executable).parent / "pyflyte"), "run", "workflows/reinforce.py", "reinforce_training",
           "--preset", PRESET, "--overrides", json.dumps(ov), "--run_name", name]
    env = env_for(work, None)
    m = Measured(mode, time.time())
    run_measured(cmd, env, work / f"{name}.log", m)
    try:
        run_id = RunLayout(str(work / "runs"), name).read_run_info().mlflow_run_id
        series = mlflow_series(env["MLFLOW_TRACKING_URI"], run_id, list(GAPS))
        m.gaps = {k: max(v) for k, v in series.items() if v}
    except Exception as e:  # a run that died early has no MLflow run to read
        m.gaps = {"unread": float("nan")}
        m.error = m.error or f"metrics: {e}"
    return m


def run_trl(a: Dict[str, str], work: Path, iterations: int, extra: List[str], threads: int) -> Measured:
    """TRL's GRPOTrainer on the rows our run takes, in its order, with the same reward and settings."""
    cfg = load_config(PRESET, overrides(a, work, iterations, "stateless", extra))
    rows = [json.loads(line) for line in Path(a["train_prompts"]).read_text().splitlines()]
    r, k, act = cfg.rollout, cfg.kl, cfg.actor
    order = [rows[i] for it in range(iterations)
             for i in iteration_indices(len(rows), r.prompts_per_iteration, it, cfg.run.seed)]
    spec = dict(algorithm="grpo", actor=a["actor"], rows=order, prompts=[], reward=cfg.reward.function,
                prompts_per_iteration=r.prompts_per_iteration, n_samples=r.n_samples_per_prompt, iterations=iterations,
                max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p or 1.0, lr=act.lr,
                weight_decay=act.weight_decay, epochs=act.ppo_epochs, minibatch_size=act.minibatch_size,
                micro_batch_size=act.micro_batch_size, clip_eps=act.clip_eps, grad_clip=act.grad_clip,
                kl_coef=k.coef, kl_estimator=k.estimator, seed=cfg.run.seed, threads=threads, save=False)
    out = work / "trl"
    out.mkdir(exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    m = Measured("trl", time.time())
    cmd = [sys.executable, str(ROOT / "benchmarks" / "trl_runner.py"), "--spec", str(out / "spec.json"),
           "--out", str(out / "result.json")]
    run_measured(cmd, env_for(work, threads), out / "trl.log", m, progress=_NEVER)
    if not m.error:
        m.ends = json.loads((out / "result.json").read_text())["iteration_ends"]
    return m


class _Never:
    @staticmethod
    def match(line: str) -> bool:
        return False


_NEVER = _Never()


def rows_for(results: Dict[str, Measured], layers: int, ranks: int = 2) -> List[Row]:
    trl = results.get("trl")
    shape = f"Qwen3-0.6B shape, {layers} layers, GRPO 4x4x32, {ranks} rank{'s' * (ranks != 1)}"
    out: List[Row] = []
    for name, m in results.items():
        where = f"{name} ({shape})"
        if m.error:
            out.append(Row(SECTION, f"{where} ran", None, "", "runs", False, m.error[-1500:]))
        out.append(row(SECTION, f"peak RSS of the process tree, {where}", m.peak_gib, "GiB", m.peak_parts))
        out.append(row(SECTION, f"peak PSS of the process tree, {where}", m.pss_gib, "GiB", m.pss_parts))
        steady = m.steady_s
        out.append(row(SECTION, f"s/iteration, {where}", steady, "s",
                       f"first iteration incl. start-up {m.first_s or float('nan'):.1f} s; {len(m.ends)} iteration(s)"))
        if m.gaps:
            out.append(row(SECTION, f"log-prob gap engine/trainer, {where}", m.gaps.get(GAPS[1]), "nats",
                           ", ".join(f"{k.split('/')[1]} {v:.2e}" for k, v in m.gaps.items())))
        if trl and name != "trl" and not trl.error:
            out.append(row(SECTION, f"peak RSS ours / TRL, {where}", m.peak_gib / trl.peak_gib, "x",
                           f"ours {m.peak_gib:.2f} GiB, TRL {trl.peak_gib:.2f} GiB", at_most=1.0))
            out.append(row(SECTION, f"peak PSS ours / TRL, {where}", m.pss_gib / trl.pss_gib if trl.pss_gib else None,
                           "x", f"ours {m.pss_gib:.2f} GiB, TRL {trl.pss_gib:.2f} GiB (shared pages counted once)"))
            ratio = steady / trl.steady_s if steady and trl.steady_s else None
            out.append(row(SECTION, f"s/iteration ours / TRL, {where}", ratio, "x",
                           f"ours {steady or float('nan'):.1f} s, TRL {trl.steady_s or float('nan'):.1f} s",
                           at_most=1.0))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)  # --json, --quick (2 layers, 2 iterations), --threads (TRL's; ours share the cores)
    parser.add_argument("--layers", type=int, help=f"decoder layers (default {QWEN3_0_6B.depth}: the real 0.6B)")
    parser.add_argument("--iterations", type=int, help="iterations per side (default 3)")
    parser.add_argument("--modes", default="stateless,separate,colocated,trl")
    parser.add_argument("--override", action="append", default=[], help="one more override of our runs' preset")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (runs, logs)")
    args = parser.parse_args(argv)
    args.layers = args.layers or (2 if args.quick else QWEN3_0_6B.depth)
    args.iterations = args.iterations or (2 if args.quick else 3)
    args.threads = max(args.threads, os.cpu_count() or 1) if "OMP_NUM_THREADS" not in os.environ else args.threads
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES) - {"trl"}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {[*MODES, 'trl']}")
    work = Path(tempfile.mkdtemp(prefix="bench-real-shape-"))
    a = assets(work, args.layers)
    results: Dict[str, Measured] = {}
    for mode in (["trl"] if "trl" in modes else []) + [m for m in modes if m != "trl"]:
        results[mode] = (run_trl(a, work, args.iterations, args.override, args.threads) if mode == "trl"
                         else run_ours(mode, a, work, args.iterations, args.override))
        print(f"{mode}: peak {results[mode].peak_gib:.2f} GiB ({results[mode].peak_parts}), PSS "
              f"{results[mode].pss_gib:.2f} GiB ({results[mode].pss_parts}); "
              f"iteration ends {len(results[mode].ends)}; {results[mode].error[-300:]}", flush=True)
    ranks = [o.split("=", 1)[1] for o in args.override if o.startswith("actor.nproc_per_node=")]
    rows = rows_for(results, args.layers, int(ranks[-1]) if ranks else load_config(PRESET).actor.nproc_per_node)
    print_rows(rows)
    write_rows(args.json, rows)
    if args.keep or any(m.error for m in results.values()):
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return exit_status(rows)  # a side that did not finish, or a ratio over its goal


if __name__ == "__main__":
    sys.exit(main())
