"""Runs on the Hub-shaped checkpoints (``models/demos/hub_models.py``) as a user starts them: their own
``model.actor_path`` and ``data.train_prompts`` (the reversal task's prompts, written as JSONL), the
reversal reward, whole iterations in-process (rollout, score, advantages, a one-process actor
update, the critic update, the commit)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Dict, Iterator, List, Sequence

import torch

from models.training.distributed import DistInfo
from models.demos.reverse_task import REWARD_SPEC, PromptGenerator, ReverseTaskConfig, write_prompts_jsonl
from tests.stages import tiny_run, to_advantages

SMALL = ["run.num_iterations=3", "rollout.prompts_per_iteration=4", "rollout.n_samples_per_prompt=4",
         "rollout.max_new_tokens=6", "actor.minibatch_size=8", "actor.micro_batch_size=4", "actor.nproc_per_node=1",
         "actor.ppo_epochs=1", "actor.lr=1e-3", "data.max_prompt_tokens=64"]
"""Three iterations of 4 prompts × 4 samples at lr 1e-3, one update process."""
CRITIC_SMALL = ["critic.minibatch_size=8", "critic.micro_batch_size=8", "critic.epochs=1"]
"""The critic's share of :data:`SMALL`, for algorithms with a critic (others refuse critic options)."""


def prompt_files(root: Path, n_train: int = 32, n_eval: int = 4) -> List[str]:
    """``data.*`` overrides pointing at reversal-task prompt files written under ``root``."""
    task = ReverseTaskConfig()
    train = write_prompts_jsonl(root / "train.jsonl", PromptGenerator(task, "train", seed=0).prompts(n_train))
    evals = write_prompts_jsonl(root / "eval.jsonl", PromptGenerator(task, "eval", seed=0).prompts(n_eval))
    return [f"data.train_prompts={train}", f"data.eval_prompts={evals}", f"reward.function={REWARD_SPEC}"]


@contextlib.contextmanager
def hub_run(root: Path, model_dir: Path | str, preset: str, overrides: Sequence[str], name: str) -> Iterator:
    """``tiny_run`` of ``preset`` on the checkpoint ``model_dir`` with prompt files under ``root``."""
    from models.config.io import load_config

    critic = CRITIC_SMALL if load_config(preset).uses_critic else []
    extra = [f"model.actor_path={model_dir}", *prompt_files(root), *SMALL, *critic, *overrides]
    with tiny_run(root, preset, extra, name, local_cache=False) as setup:
        yield setup


def iterate(cfg, run, state, iterations: int) -> List[Dict[str, float]]:
    """``iterations`` whole iterations from ``state``; each one's merged stats (as MLflow logs them)."""
    from models.stages.commit import run_commit
    from models.stages.actor import train_actor
    from models.stages.critic import train_critic

    cpu = DistInfo(0, 1, 0, torch.device("cpu"))
    out = []
    for _ in range(iterations):
        ro, sc, ad = to_advantages(cfg, run, state)
        actor = train_actor(cfg, run, state, ad.batch, cpu)
        critic = train_critic(cfg, run, state, ad.batch) if cfg.uses_critic else None
        stats = [ro.stats, sc.stats, ad.stats, actor.stats] + ([critic.stats] if critic else [])
        state = run_commit(cfg, run, state, stats, sc.batch, actor.checkpoint_url,
                           critic.checkpoint_url if critic else "")
        out.append({k: v for s in stats for k, v in s.items()})
    return out
