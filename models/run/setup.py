"""Creating a run: config, prompt checks (before any model loads), the starting model (a checkpoint the
config names, or what ``model.builder`` builds), initial checkpoints, the MLflow run; or resuming one
(:mod:`models.run.resume`)."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import tempfile
from typing import Dict, List, NamedTuple, Optional

from models import storage
from models.checkpoint import download_checkpoint, is_committed, save_checkpoint
from models.run import lock as run_lock
from models import tracking
from models.algorithms import WORKFLOWS
from models.config import ConfigError, TrainConfig
from models.config.io import flatten, given_keys, load_config, to_dict
from models.rewards import RewardError, parse_spec
from models.run.preflight import (check_eval_prompts_exist, check_model_dirs, check_reward_named, check_rollout_setup,
                                  check_sources, check_start_named, check_storage, check_vocab)
from models.run.context import check_engine_memory, check_first_prompts, generation_budget, prompt_room
from models.run.resume import resume_run, resumes, run_layout, where_tracked
from models.run.data import load_run_data, write_run_prompts
from models.run.layout import RunInfo, RunLayout
from models.run.types import PolicyState, RunHandle

log = logging.getLogger(__name__)

_TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
"""The files of a remote checkpoint :func:`load_tokenizer_only` fetches (top level only): its configs, vocabularies,
merges, sentencepiece and tiktoken models, chat templates; never its weights."""


class RunSetup(NamedTuple):
    """What :func:`setup_run` returns (``prepare_run``'s three outputs): the config in force, the run's
    handle and the state its next iteration starts from. A bundle of the three, no concept of its own."""

    cfg: TrainConfig
    run: RunHandle
    state: PolicyState


GIT_COMMIT_ENV = "RLHF_GIT_COMMIT"
"""The commit an image was built from (``make image`` passes ``git rev-parse HEAD``; an image has no ``.git``)."""


def git_commit() -> str:
    """The code's commit: :data:`GIT_COMMIT_ENV` if set (an image), else ``git rev-parse HEAD`` of this checkout."""
    if os.environ.get(GIT_COMMIT_ENV, "unknown") != "unknown":
        return os.environ[GIT_COMMIT_ENV]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def load_tokenizer_only(url: str):
    """The tokenizer of a checkpoint, fetching only its small files (no weights)."""
    from transformers import AutoTokenizer

    from models.checkpoint.local import cached_tokenizer

    if storage.is_local(url):
        return cached_tokenizer(storage.local_path(url))
    tmp = tempfile.mkdtemp(prefix="tokenizer-")
    for rel in storage.list_files(url):
        if rel.endswith(_TOKENIZER_SUFFIXES) and "/" not in rel:
            storage.get_file(storage.join(url, rel), os.path.join(tmp, rel))
    return AutoTokenizer.from_pretrained(tmp)


def build_start(cfg: TrainConfig, out_dir: str) -> Dict[str, str]:
    """The run's starting model and data, written under ``out_dir`` by the function ``model.builder`` names
    (``module:function(key=value, ...)``, called as ``fn(out_dir, **kwargs)``; a config without
    ``model.actor_path`` needs one): ``actor`` and, if it builds them, ``critic``, ``train_prompts`` and
    ``eval_prompts``. A :class:`ConfigError` naming ``model.builder`` if it cannot run or wrote no actor
    (:func:`~models.run.preflight.check_start_named` checked first that the config names one)."""
    spec = cfg.model.builder
    try:
        parsed = parse_spec(spec)
        fn = importlib.import_module(parsed.module)
        for name in parsed.attr.split("."):
            fn = getattr(fn, name)
    except (RewardError, ImportError, AttributeError) as err:
        raise ConfigError(f"model.builder={spec!r}: {err}") from None
    try:
        built = dict(fn(out_dir, *parsed.args, **parsed.kwargs))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model.builder={spec!r}: {err}") from None
    unknown = sorted(set(built) - set(BUILT_PARTS))
    if "actor" not in built or unknown:
        raise ConfigError(f"model.builder={spec!r} returned {sorted(built)}: it must return the paths it wrote, "
                          f"'actor' and any of {list(BUILT_PARTS[1:])}")
    return {k: str(v) for k, v in built.items()}


BUILT_PARTS = ("actor", "critic", "train_prompts", "eval_prompts")
"""What a builder (``model.builder``) may return, ``actor`` always."""


def _checked_data(cfg: TrainConfig, tokenizer, train_url: str = "", eval_url: str = "", actor: str = ""):
    """The run's training and held-out prompts, validated against the context of the ``actor`` checkpoint
    (default ``model.actor_path``), and the reward source tried on four of them."""
    actor_config = storage.read_json(storage.join(actor or cfg.model.actor_path, "config.json"))
    room = prompt_room(cfg, actor_config)
    name, budget = generation_budget(cfg)
    train, held_out = load_run_data(cfg.data, tokenizer, train_url, eval_url,
                                    context=(room, budget, name) if room else None)
    if cfg.rollout.environment and (train.chat or held_out.chat):  # a prompt column of conversations (TRL's)
        raise ConfigError(f"rollout.environment gets each row's plain text 'prompt' and writes the conversation "
                          f"itself, but data.prompt_column={cfg.data.prompt_column!r} holds conversations; give "
                          f"text prompts")
    for data in (train, held_out) if held_out is not train else (train,):
        check_first_prompts(cfg, data, tokenizer, room)
    check_engine_memory(cfg, actor_config)
    check_sources(cfg, train.take(range(min(4, len(train)))), len(tokenizer))
    return train, held_out


def _commit_copy(src: str, dst: str) -> str:
    """A committed copy of checkpoint ``src`` at ``dst`` (adds the marker and checksums)."""
    local = download_checkpoint(src) if is_committed(src) else storage.local_path(src) if storage.is_local(src) \
        else _fetch_uncommitted(src)
    save_checkpoint(local, dst, overwrite=True)
    return dst


def _fetch_uncommitted(url: str) -> str:
    tmp = tempfile.mkdtemp(prefix="ckpt-")
    storage.get_dir(url, tmp)
    return tmp


def new_run(cfg: TrainConfig, layout: RunLayout, preset: str) -> RunSetup:
    """Validate data, lay out the run's initial checkpoints and prompts, start MLflow."""
    check_start_named(cfg)
    check_reward_named(cfg)
    work = tempfile.mkdtemp(prefix="run-setup-")
    data_dir = storage.join(layout.url, "data")
    built_data = cfg.data.source == "files" and not cfg.data.train_prompts  # the builder's prompts
    if built_data:  # before the model is built
        check_eval_prompts_exist(cfg)
    built = {} if cfg.model.actor_path else build_start(cfg, work)
    actor = built.get("actor") or cfg.model.actor_path
    if not built:  # a user's checkpoints: every folder and vocabulary checked before any model loads
        check_model_dirs(cfg)
    tokenizer = load_tokenizer_only(actor)
    if not built:
        _check_vocabularies(cfg, tokenizer)
        check_rollout_setup(cfg, storage.read_json(storage.join(actor, "config.json")))
    train, held_out = _built_data(cfg, tokenizer, actor, built) if built_data else \
        _checked_data(cfg, tokenizer, actor=actor)
    run_train = storage.join(data_dir, "train_prompts.jsonl")
    run_eval = storage.join(data_dir, "eval_prompts.jsonl")
    write_run_prompts(train, run_train)
    write_run_prompts(held_out, run_eval)

    ref = _commit_copy(actor, layout.reference_url())
    critic_url = ""
    if cfg.uses_critic:
        src = cfg.model.critic_path or built.get("critic") or _critic_from(ref, work)
        critic_url = _commit_copy(src, storage.join(layout.url, "critic-init"))
    rm_url = ""
    if cfg.reward.source == "model":
        rm_url = _commit_copy(cfg.reward.model_path, storage.join(layout.url, "reward-model"))

    commit = git_commit()
    tags = {"algorithm": cfg.run.algorithm, "preset": preset or "(none)", "git_commit": commit,
            "mlflow.source.git.commit": commit, "storage": layout.url, "flyte_execution_id": run_lock.execution_name(),
            "registered_model_name": cfg.run.registered_model_name or "(not registered)"}
    run_id = tracking.start_run(cfg.run.mlflow_experiment, layout.run_name, flatten(cfg), tags)
    layout.write_run_info(RunInfo(run_name=layout.run_name, algorithm=cfg.run.algorithm, config=to_dict(cfg),
                                  mlflow_run_id=run_id, mlflow_tracking_uri=where_tracked()))
    handle = RunHandle(layout.root, layout.run_name, run_id, ref, run_train, run_eval, rm_url)
    return RunSetup(cfg, handle, PolicyState(0, ref, critic_url, cfg.kl.coef))


def _built_data(cfg: TrainConfig, tokenizer, actor: str, built: Dict[str, str]):
    """The builder's prompts (``data.train_prompts`` empty), checked like a user's; the user's held-out
    prompts instead of the builder's when ``data.eval_prompts`` names them."""
    if not built.get("train_prompts"):
        raise ConfigError("data.train_prompts is empty and no builder wrote training prompts: name your prompts "
                          "in data.train_prompts")
    eval_url = "" if cfg.data.eval_prompts else built.get("eval_prompts", "")
    return _checked_data(cfg, tokenizer, built["train_prompts"], eval_url, actor)


def _check_vocabularies(cfg: TrainConfig, tokenizer) -> None:
    """The actor's tokenizer against every user checkpoint that reads its token ids."""
    m = cfg.model
    check_vocab(tokenizer, m.actor_path, "model.actor_path")
    if m.critic_path and cfg.uses_critic:
        check_vocab(tokenizer, m.critic_path, "model.critic_path")
    if cfg.reward.source == "model":
        check_vocab(tokenizer, cfg.reward.model_path, "reward.model_path")


def _critic_from(actor_url: str, work: str) -> str:
    from models.training.critic_init import critic_from_actor  # transformers: only where a critic is made

    return str(critic_from_actor(download_checkpoint(actor_url), os.path.join(work, "critic")))


def check_workflow(cfg: TrainConfig, workflow: str) -> None:
    """``workflow`` must be the one ``run.algorithm`` declares (``models/algorithms/``): ``ppo`` trains
    a critic, ``reinforce`` does not. Empty: no workflow to check (in-process callers)."""
    if workflow and workflow not in WORKFLOWS:
        raise ConfigError(f"unknown workflow {workflow!r}: use one of {list(WORKFLOWS)}")
    want = cfg.spec.workflow
    if workflow and workflow != want:
        why = "trains a critic" if cfg.uses_critic else "is critic-free"
        raise ConfigError(f"run.algorithm={cfg.run.algorithm} {why}: use workflows/{want}.py {want}_training")


DEFAULT_PRESETS = {"ppo": "configs/tiny_ppo.yaml", "reinforce": "configs/tiny_grpo.yaml"}
"""The preset of a new run launched without ``--preset`` (a resumed run keeps its stored config)."""


def setup_run(preset: str, overrides: List[str], run_name: str = "", workflow: str = "") -> RunSetup:
    """Entry point of a training workflow: a new run, or the resumption of ``run_name``, under the run's
    lock (:mod:`models.run.lock`; released again if set-up fails)."""
    overrides = list(overrides)
    cfg = load_config(preset or DEFAULT_PRESETS.get(workflow, DEFAULT_PRESETS["ppo"]), overrides)
    layout = run_layout(cfg, run_name)
    check_storage(layout.url)
    if workflow not in ("", "ppo", "reinforce") or not resumes(layout):
        check_workflow(cfg, workflow)  # a new run: its own config must suit the workflow
    run_lock.acquire(layout.lock_url, cfg.run.lock_ttl_s)
    try:
        if resumes(layout):
            log.info("resuming run %s", layout.url)
            return RunSetup(*resume_run(layout, cfg, given_keys(preset, overrides), workflow))
        return new_run(cfg, layout, preset or DEFAULT_PRESETS.get(workflow, ""))
    except BaseException:
        run_lock.release(layout.lock_url)
        raise
