"""Exact bytes one small PPO iteration moves through storage, per task, beside the projection's byte formula
(:func:`benchmarks.project_iteration.state_bytes`) evaluated at that run's shape.

    python benchmarks/project_iteration.py --check-small

The run is ``configs/tiny_ppo.yaml`` (char-level Llama, full critic, reward function) stored on S3 (the moto
server): on a local folder checkpoints are used in place and hard-linked, so no byte moves and nothing
would be measured. Iteration 0 is run unmeasured (its actor is the reference, one download); iteration 1 is
measured task by task with :func:`models.storage.count_bytes`, each task with an empty checkpoint cache
(a fresh pod) and its input batch reopened from its URL (what Flyte hands a task). Every transfer is one
whole file, classified by name: ``weights`` (a checkpoint's ``*.safetensors``), ``optimizer``
(``*-optimizer/optimizer.safetensors``), ``batch`` (``*.arrow``) and ``other`` (JSON, tokenizer, prompts,
checksums).

The formula counts tensor payloads only (``params × 4`` or ``× 8`` bytes); each measured file also holds
a safetensors header (8 bytes + its JSON), and the optimizer file one float32 ``step`` per tensor. Both are
read from the moved files' own headers, so weights and optimizer state reconcile exactly. Batches are an
estimate in the formula (24 B per token) and are shown beside the measured Arrow files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

KINDS = ("weights", "optimizer", "batch", "other")
SMALL = ["run.num_iterations=2", "rollout.prompts_per_iteration=4", "rollout.n_samples_per_prompt=2",
         "actor.minibatch_size=8", "actor.micro_batch_size=8", "actor.nproc_per_node=1", "actor.ppo_epochs=1",
         "critic.minibatch_size=8", "critic.micro_batch_size=8", "critic.epochs=1"]
"""One iteration of 4 prompts × 2 samples, one update process."""
TASKS = ("rollout", "score", "advantages", "actor_update", "critic_update", "commit")


def kind(url: str) -> str:
    """The class of a moved file, by its name."""
    name = url.rsplit("/", 1)[-1]
    if name.endswith(".arrow"):
        return "batch"
    if name.endswith(".safetensors"):
        return "optimizer" if "-optimizer" in url.rsplit("/", 2)[-2] else "weights"
    return "other"


@dataclass
class Measured:
    """What one measured iteration moved: ``{task: [Transfer]}`` and the shapes read off its checkpoints."""

    transfers: Dict[str, list]
    overheads: Dict[str, int]
    """``{url: bytes}`` the formula leaves out of each moved safetensors file (:func:`overhead`)."""
    actor_params: int
    critic_params: int
    samples: int
    prompt_tokens: float
    response_tokens: float


def header(url: str) -> Tuple[int, Dict]:
    """``(8 + JSON length, JSON)`` of the safetensors file at ``url`` (first bytes only, not counted)."""
    from models.storage import fs_and_path

    fs, path = fs_and_path(url)
    with fs.open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        meta = json.loads(f.read(n))
    return 8 + n, meta


def numel(url: str) -> int:
    """Parameters stored in the safetensors file at ``url``."""
    total = 0
    for key, v in header(url)[1].items():
        if key != "__metadata__":
            n = 1
            for d in v["shape"]:
                n *= d
            total += n
    return total


def overhead(url: str) -> int:
    """Bytes of the safetensors file moved as ``url`` the formula leaves out: its header, and 4 per ``step``
    scalar of an optimizer state. A file written to a staging folder (``x.tmp-…/``) is read where it was
    committed (``x/``)."""
    size, meta = header(re.sub(r"\.tmp-[0-9a-f]+/", "/", url))
    steps = sum(k.endswith(".step") for k in meta) if kind(url) == "optimizer" else 0
    return size + 4 * steps


def by_kind(transfers: Sequence) -> Dict[Tuple[str, str], int]:
    """``{(op, kind): bytes}`` of ``transfers``."""
    out: Dict[Tuple[str, str], int] = defaultdict(int)
    for t in transfers:
        out[(t.op, kind(t.url))] += t.nbytes
    return dict(out)


@contextlib.contextmanager
def _pod() -> Iterator[list]:
    """One task as a fresh pod: an empty checkpoint cache, its transfers counted."""
    from models import storage

    old = os.environ.get("RLHF_CHECKPOINT_CACHE")
    with tempfile.TemporaryDirectory(prefix="pod-cache-") as cache:
        os.environ["RLHF_CHECKPOINT_CACHE"] = cache
        try:
            with storage.count_bytes() as records:
                yield records
        finally:
            if old is None:
                del os.environ["RLHF_CHECKPOINT_CACHE"]
            else:
                os.environ["RLHF_CHECKPOINT_CACHE"] = old


def measure(root_url: str, workdir: Path, overrides: Sequence[str] = ()) -> Measured:
    """Run iteration 0 of the tiny PPO preset on ``root_url`` unmeasured, iteration 1 measured per task."""
    import torch

    from models import storage
    from models.training.distributed import DistInfo
    from models.stages.advantages import run_advantages
    from models.data.batch import RolloutBatch
    from models.stages.commit import run_commit
    from models.stages.rollout import run_rollout
    from models.stages.score import run_score
    from models.stages.actor import train_actor
    from models.stages.critic import train_critic
    from tests.stages import tiny_run

    cpu = DistInfo(0, 1, 0, torch.device("cpu"))
    reopen = lambda b: RolloutBatch.open(b.uri)  # noqa: E731  (as Flyte hands a task its input)
    with tiny_run(workdir, "configs/tiny_ppo.yaml", [f"run.storage_root={root_url}", *SMALL, *overrides],
                  "bytes") as (cfg, run, state):
        for measured in (False, True):
            moved: Dict[str, List] = {}
            overheads: Dict[str, int] = {}

            def task(name, fn):
                with _pod() as records:
                    out = fn()
                moved[name] = list(records)
                # before the commit prunes the iteration's inputs
                overheads.update({t.url: overhead(t.url) for t in records if kind(t.url) != "batch"
                                  and t.url.endswith(".safetensors") and t.url not in overheads})
                return out

            ro = task("rollout", lambda: run_rollout(cfg, run, state))
            sc = task("score", lambda: run_score(cfg, run, state, reopen(ro.batch)))
            ad = task("advantages", lambda: run_advantages(cfg, run, state, reopen(sc.batch)))
            ac = task("actor_update", lambda: train_actor(cfg, run, state, reopen(ad.batch), cpu))
            cr = task("critic_update", lambda: train_critic(cfg, run, state, reopen(ad.batch)))
            stats = [ro.stats, sc.stats, ad.stats, ac.stats, cr.stats]
            state = task("commit", lambda: run_commit(cfg, run, state, stats, sc.batch, ac.checkpoint_url,
                                                      cr.checkpoint_url))
        table = RolloutBatch.read(ro.batch.uri).table
        params = [numel(storage.join(url, "model.safetensors")) for url in (ac.checkpoint_url, cr.checkpoint_url)]
    n = table.num_rows
    return Measured(moved, overheads, *params,
                    n, sum(len(x) for x in table.column("prompt_tokens").to_pylist()) / n,
                    sum(len(x) for x in table.column("response_tokens").to_pylist()) / n)


def small_shape(m: Measured):
    """The projection's :class:`~benchmarks.project_iteration.Shape` of the measured run: one GPU (process)
    per task, a full critic, a reward function."""
    from benchmarks.project_iteration import Shape

    return Shape("tiny_ppo (measured)", params=m.actor_params, critic_params=m.critic_params, samples=m.samples,
                 prompt_tokens=m.prompt_tokens, response_tokens=m.response_tokens, actor_nodes=1, gpus_per_node=1,
                 critic_lora=False, reward_model=False)


NOTES = {"weights": "safetensors headers", "optimizer": "safetensors header + a float32 step per tensor",
         "batch": "Arrow files; the formula's 24 B/token is an estimate",
         "other": "markers, config, tokenizer, prompts, checksums, run state: not in the formula"}


def compare(m: Measured) -> List[Dict]:
    """One row per task, op and kind: the formula's bytes, the measured ones, the part of the difference
    the files themselves account for (:func:`overhead`) and what is left (0 for weights and optimizer)."""
    from benchmarks.project_iteration import state_terms

    terms = state_terms(small_shape(m))
    out = []
    for task in TASKS:
        got, want = by_kind(m.transfers[task]), terms.get(task, {})
        for op, k in sorted(set(got) | set(want), key=lambda x: (x[0], KINDS.index(x[1]))):
            measured, formula = got.get((op, k), 0), float(want.get((op, k), 0.0))
            moved = [t for t in m.transfers[task] if t.op == op and kind(t.url) == k]
            note = NOTES[k]
            if task == "commit" and k == "weights":
                note, explained = "MLflow copies checkpoints up to run.checkpoint_artifact_max_mb", measured
            elif k in ("weights", "optimizer"):
                explained = sum(m.overheads[t.url] for t in moved)
            else:
                explained = measured - formula
            out.append({"task": task, "op": op, "kind": k, "files": len(moved), "formula": formula,
                        "measured": measured, "explained": explained, "residual": measured - formula - explained,
                        "note": note})
    return out


def report(m: Measured) -> str:
    """:func:`compare` as a table."""
    lines = [f"one measured iteration of configs/tiny_ppo.yaml on S3 (moto): actor {m.actor_params} params, "
             f"critic {m.critic_params}, {m.samples} samples × {m.prompt_tokens:.1f} + {m.response_tokens:.1f} tokens",
             f"  {'task':14s} {'op':5s} {'kind':9s} {'files':>5s} {'formula B':>11s} {'measured B':>11s} "
             f"{'explained':>10s} {'residual':>8s}  why"]
    for r in compare(m):
        lines.append(f"  {r['task']:14s} {r['op']:5s} {r['kind']:9s} {r['files']:5d} {r['formula']:11.0f} "
                     f"{r['measured']:11d} {r['explained']:10.0f} {r['residual']:8.0f}  {r['note']}")
    return "\n".join(lines)


def measure_on_moto(overrides: Sequence[str] = ()) -> Measured:
    """:func:`measure` on a moto S3 server of its own (for the script; tests use the session's server)."""
    from tests.processes import S3_ENV_TO_UNSET, moto_s3_server, s3_client_env

    saved = dict(os.environ)
    try:
        with moto_s3_server("iteration-bytes") as endpoint, tempfile.TemporaryDirectory() as tmp:
            for key in S3_ENV_TO_UNSET:
                os.environ.pop(key, None)
            os.environ.update(s3_client_env(endpoint))
            return measure("s3://iteration-bytes/run", Path(tmp), overrides)
    finally:
        os.environ.clear()
        os.environ.update(saved)
