"""Scheduled retraining: ``retrain`` (one retraining) and the launch plan ``retrain_nightly`` (cron).

    champion@registry ──► PPO on {prompts_root}/{date}/ ──► candidate ──► held-out eval vs champion
                                                                         └─► move `champion` if better

    pyflyte run workflows/retrain.py retrain --prompts_root prompts --overrides '["run.num_iterations=2"]'

Wiring only: the training is ``ppo_training``'s own tasks and executions (``prepare_run``,
``ppo_execution``, ``finish_run``); the retraining tasks are in ``tasks/retrain.py``.
"""

from __future__ import annotations

import datetime as dt
from typing import List

from flytekit import CronSchedule, LaunchPlan, workflow

from models.stages.retrain import UNSET_DATE, RetrainResult
from tasks.retrain import plan_retrain, promote_if_better
from workflows.common import train
from workflows.ppo import ppo_execution_plan


@workflow
def retrain(prompts_root: str = "prompts", run_date: dt.datetime = UNSET_DATE,
            registered_model_name: str = "flyte-rlhf-policy", preset: str = "configs/tiny_ppo.yaml",
            overrides: List[str] = [], base_checkpoint: str = "", heldout_prompts: str = "",
            min_improvement: float = 0.0) -> RetrainResult:
    """Continue training the registry's champion on the day's prompts; promote it only if it is better.

    :param prompts_root: folder/prefix holding one folder of prompts per day ({prompts_root}/YYYY-MM-DD/) and heldout/
    :param run_date: the day to train on (the schedule passes its kickoff time); 1970-01-01 means today (UTC)
    :param registered_model_name: Model Registry entry whose `champion` alias is trained and maybe moved
    :param preset: PPO preset of the training run, e.g. configs/tiny_ppo.yaml
    :param overrides: config overrides as section.field=value, e.g. ["run.num_iterations=50"]
    :param base_checkpoint: HF checkpoint to start from while the registry has no champion (empty: the preset's model)
    :param heldout_prompts: held-out prompts for the comparison (empty: {prompts_root}/heldout/)
    :param min_improvement: the candidate's mean held-out reward must beat the champion's by more than this
    """
    p = plan_retrain(prompts_root=prompts_root, run_date=run_date, registered_model_name=registered_model_name,
                     preset=preset, overrides=overrides, base_checkpoint=base_checkpoint,
                     heldout_prompts=heldout_prompts)
    setup, summary = train(ppo_execution_plan, "ppo", preset, p.overrides, p.run_name)
    return promote_if_better(cfg=setup.cfg, run=setup.run, summary=summary, champion_version=p.champion_version,
                             min_improvement=min_improvement)


NIGHTLY_DEFAULTS = {
    # Edit these for your cluster before `pyflyte register`; any of them can also be given per
    # execution (`pyflyte run --remote ... retrain_nightly --min_improvement 0.02`).
    "prompts_root": "s3://my-bucket/rlhf/prompts",
    "registered_model_name": "llama-3-8b-rlhf",
    "preset": "configs/llama8b_ppo_gpu.yaml",
    "overrides": ["run.num_iterations=100", "run.storage_root=s3://my-bucket/rlhf-runs"],
    "base_checkpoint": "",
    "heldout_prompts": "",
    "min_improvement": 0.01,
}
"""Defaults of the scheduled launch plan (the workflow's own defaults are the tiny local ones)."""

retrain_nightly = LaunchPlan.get_or_create(
    workflow=retrain,
    name="retrain_nightly",
    default_inputs=NIGHTLY_DEFAULTS,
    schedule=CronSchedule(schedule="0 3 * * *", kickoff_time_input_arg="run_date"),
)
"""Every day at 03:00 UTC: retrain on ``{prompts_root}/{that day}/``."""
