"""Creating or resuming a run: config, prompt checks (before any model loads), initial
checkpoints, the MLflow run, and the state an iteration starts from."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import subprocess
import tempfile
from typing import Iterable, List, NamedTuple, Optional

from models import storage
from models.checkpoint import download_checkpoint, is_committed, save_checkpoint
from models.run import lock as run_lock
from models import tracking
from models.algorithms import WORKFLOWS
from models.config import ConfigError, TrainConfig
from models.config.io import config_from_json_dict, flatten, given_keys, load_config, to_dict
from models.run.preflight import (check_eval_prompts_exist, check_finished_intact, check_model_dirs,
                             check_resume_point, check_reward_functions, check_sources, check_storage, check_vocab,
                             model_context)
from models.run.resume import ConfigChange, change_records, check_resume_workflow, plan_resume
from models.run.data import load_run_data, read_run_prompts, write_run_prompts
from models.run.layout import RunInfo, RunLayout
from models.tracking.redact import redact
from models.run.types import PolicyState, RunHandle

log = logging.getLogger(__name__)

_TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".jinja")


class RunSetup(NamedTuple):
    """What :func:`setup_run` returns (``prepare_run``'s three outputs): the config in force, the run's
    handle and the state its next iteration starts from. A bundle of the three, no concept of its own."""

    cfg: TrainConfig
    run: RunHandle
    state: PolicyState


def cache_dir() -> str:
    """Content-keyed cache for the demo models (``RLHF_CACHE_DIR``, default ``~/.cache/flyte-rlhf``)."""
    return os.environ.get("RLHF_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "flyte-rlhf"))


def default_run_name(algorithm: str) -> str:
    return f"{algorithm}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


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

    if storage.is_local(url):
        return AutoTokenizer.from_pretrained(storage.local_path(url))
    tmp = tempfile.mkdtemp(prefix="tokenizer-")
    for rel in storage.list_files(url):
        if rel.endswith(_TOKENIZER_SUFFIXES) and "/" not in rel:
            storage.get_file(storage.join(url, rel), os.path.join(tmp, rel))
    return AutoTokenizer.from_pretrained(tmp)


def _demo_model_config(cfg: TrainConfig):
    from models.demos.tiny import TinyModelConfig

    m = cfg.model
    return TinyModelConfig(hidden_size=m.tiny_hidden_size, num_layers=m.tiny_num_layers, num_heads=m.tiny_num_heads,
                           num_kv_heads=m.tiny_num_heads, intermediate_size=4 * m.tiny_hidden_size)


def _demo_assets(cfg: TrainConfig, workdir: str) -> dict:
    """The demo models and prompts of ``model.demo_task``, built under ``workdir`` (warm starts cached)."""
    cache = os.path.join(cache_dir(), "warm_start")
    counts = {"num_train_prompts": cfg.data.num_demo_train_prompts, "num_eval_prompts": cfg.data.num_demo_eval_prompts}
    if cfg.model.demo_task == "math":
        from models.demos.math_demo import DEMO_WARM_START, build_math_demo

        built = build_math_demo(workdir, cache, cfg=dataclasses.replace(DEMO_WARM_START,
                                                                         steps=cfg.model.warm_start_steps), **counts)
    else:
        from models.demos.warm_start import WarmStartConfig, build_demo_models

        built = build_demo_models(workdir, cache, _demo_model_config(cfg),
                                  cfg=WarmStartConfig(steps=cfg.model.warm_start_steps), **counts)
    return {k: str(v) for k, v in built.items()}


def _demo_context(cfg: TrainConfig) -> int:
    if cfg.model.demo_task == "math":
        from models.demos.math_demo import DEMO_MODEL

        return DEMO_MODEL.max_position_embeddings
    return _demo_model_config(cfg).max_position_embeddings


def _prompt_room(cfg: TrainConfig) -> Optional[int]:
    """Tokens a prompt may take: the actor's context (``max_position_embeddings``) less
    ``rollout.max_new_tokens``; None when the checkpoint does not say."""
    context = model_context(cfg.model.actor_path) if cfg.model.actor_path else _demo_context(cfg)
    if context is None:
        return None
    if context <= cfg.rollout.max_new_tokens:
        raise ConfigError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for a prompt in the "
                          f"actor's context of {context} tokens (max_position_embeddings)")
    return context - cfg.rollout.max_new_tokens


def _checked_data(cfg: TrainConfig, tokenizer, train_url: str = "", eval_url: str = ""):
    """The run's training and held-out prompts, validated, and the reward source tried on four of them."""
    room = _prompt_room(cfg)
    train, held_out = load_run_data(cfg.data, tokenizer, train_url, eval_url,
                                    context=(room, cfg.rollout.max_new_tokens) if room else None)
    if cfg.rollout.environment and (train.chat or held_out.chat):  # a prompt column of conversations (TRL's)
        raise ConfigError(f"rollout.environment gets each row's plain text 'prompt' and writes the conversation "
                          f"itself, but data.prompt_column={cfg.data.prompt_column!r} holds conversations; give "
                          f"text prompts")
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
    work = tempfile.mkdtemp(prefix="run-setup-")
    data_dir = storage.join(layout.url, "data")
    demo = not cfg.model.actor_path
    demo_data = cfg.data.source == "files" and not cfg.data.train_prompts
    if demo_data:  # before the demo models are built
        check_eval_prompts_exist(cfg)
    assets = {}
    if demo and cfg.model.demo_task == "math":  # the tokenizer is the warm-started checkpoint's (cached)
        assets = _demo_assets(cfg, work)
        tokenizer = load_tokenizer_only(assets["actor"])
    elif demo:
        from models.demos.tokenizer import build_char_tokenizer

        tokenizer = build_char_tokenizer()
    else:
        check_model_dirs(cfg)
        tokenizer = load_tokenizer_only(cfg.model.actor_path)
        _check_vocabularies(cfg, tokenizer)
        from models.run.preflight import check_rollout_setup

        check_rollout_setup(cfg, storage.read_json(storage.join(cfg.model.actor_path, "config.json")))
    if not demo_data:  # user data: every row is checked before any model is loaded
        train, held_out = _checked_data(cfg, tokenizer)
    if demo and not assets:
        assets = _demo_assets(cfg, work)
    if demo_data:  # the demo's own prompts, checked like user data
        if not assets.get("train_prompts"):
            raise ValueError("data.train_prompts is empty and no demo prompts were built")
        demo_eval = "" if cfg.data.eval_prompts else assets.get("eval_prompts", "")  # the user's, if named
        train, held_out = _checked_data(cfg, tokenizer, assets["train_prompts"], demo_eval)
    run_train = storage.join(data_dir, "train_prompts.jsonl")
    run_eval = storage.join(data_dir, "eval_prompts.jsonl")
    write_run_prompts(train, run_train)
    write_run_prompts(held_out, run_eval)

    ref = _commit_copy(assets.get("actor") or cfg.model.actor_path, layout.reference_url())
    critic_url = ""
    if cfg.uses_critic:
        src = cfg.model.critic_path or assets.get("critic") or _critic_from(ref, work)
        critic_url = _commit_copy(src, storage.join(layout.url, "critic-init"))
    rm_url = ""
    if cfg.reward.source == "model":
        rm_url = _commit_copy(cfg.reward.model_path, storage.join(layout.url, "reward-model"))

    commit = git_commit()
    tags = {"algorithm": cfg.run.algorithm, "preset": preset or "(none)", "git_commit": commit,
            "mlflow.source.git.commit": commit, "storage": layout.url, "flyte_execution_id": _flyte_execution_id(),
            "registered_model_name": cfg.run.registered_model_name or "(not registered)"}
    run_id = tracking.start_run(cfg.run.mlflow_experiment, layout.run_name, flatten(cfg), tags)
    layout.write_run_info(RunInfo(run_name=layout.run_name, algorithm=cfg.run.algorithm, config=to_dict(cfg),
                                  mlflow_run_id=run_id, mlflow_tracking_uri=_where_tracked()))
    handle = RunHandle(layout.root, layout.run_name, run_id, ref, run_train, run_eval, rm_url)
    return RunSetup(cfg, handle, PolicyState(0, ref, critic_url, cfg.kl.coef))


def _check_vocabularies(cfg: TrainConfig, tokenizer) -> None:
    """The actor's tokenizer against every user checkpoint that reads its token ids."""
    m = cfg.model
    check_vocab(tokenizer, m.actor_path, "model.actor_path")
    if m.critic_path and cfg.uses_critic:
        check_vocab(tokenizer, m.critic_path, "model.critic_path")
    if cfg.reward.source == "model":
        check_vocab(tokenizer, cfg.reward.model_path, "reward.model_path")


def _critic_from(actor_url: str, work: str) -> str:
    from models.demos.tiny import critic_from_actor

    return str(critic_from_actor(download_checkpoint(actor_url), os.path.join(work, "critic")))


def _flyte_execution_id() -> str:
    """The Flyte execution's name on a cluster (what the failure handler finds the run by), else ``local``."""
    ex = run_lock.current_execution()
    return ex.name if run_lock.on_cluster(ex) else "local"


def resume_run(layout: RunLayout, cfg_now: TrainConfig, keys: Iterable[str] = (), workflow: str = "") -> RunSetup:
    """Continue a run from ``state.json`` with its stored config, plus the changes among ``keys`` (the
    fields the user's preset and overrides set) that may change on resume (:mod:`models.run.resume`).

    Everything is checked before anything is touched: the workflow, the config changes, the resume
    point's checkpoints (a finished run's: every file against its checksum, so a relaunch that cannot go
    on leaves the finished MLflow run FINISHED), a changed reward function. The next iteration starts from
    the committed checkpoints ``state.json`` names. With fixed seeds on the same CPU machine the resumed run is
    bit-identical to an uninterrupted one (every seed depends on ``run.seed`` and the iteration only;
    ``tests/integration/test_resume.py``, docs/reliability_faults.md)."""
    info = layout.read_run_info()
    stored = config_from_json_dict(info.config)
    check_resume_workflow(stored, workflow, layout.url)
    status = check_tracked_here(layout, info)
    state = layout.read_state()
    done = 0 if state is None else state.iteration + 1
    cfg, changes = plan_resume(stored, cfg_now, keys, done, layout.url, layout.root)
    if state is not None:
        check_resume_point(layout.url, state.actor_url, state.critic_url or "")
        if status == "FINISHED":  # its end state stands unless the run can really go on
            check_finished_intact(layout.url, info.mlflow_run_id or "", (
                state.actor_url, state.critic_url or "", state.extras.get("behaviour_url", "")))
    base = storage.join(layout.url, "data")
    rm = storage.join(layout.url, "reward-model") if cfg.reward.source == "model" else ""
    handle = RunHandle(layout.root, layout.run_name, info.mlflow_run_id or "", layout.reference_url(),
                       storage.join(base, "train_prompts.jsonl"), storage.join(base, "eval_prompts.jsonl"), rm)
    if cfg.reward.source == "function" and any(c.key in ("reward.function", "reward.functions") for c in changes):
        train = read_run_prompts(handle.train_prompts_url)
        check_reward_functions(cfg, train.take(range(min(4, len(train)))))
    _record_changes(layout, info, cfg, changes)
    if info.mlflow_run_id:  # the same MLflow run goes on (a finished run shows as running again)
        tracking.client().update_run(info.mlflow_run_id, status="RUNNING")
        tracking.set_tags(info.mlflow_run_id, {"flyte_execution_id": _flyte_execution_id(),
                                               **{c.tag: f"{c.old!r} -> {c.new!r}" for c in changes}})
    if state is None:
        critic = storage.join(layout.url, "critic-init") if cfg.uses_critic else ""
        return RunSetup(cfg, handle, PolicyState(0, layout.reference_url(), critic, cfg.kl.coef))
    start = PolicyState.resumed(state, cfg.kl.coef, off_policy=bool(cfg.run.off_policy_steps))
    if start.behaviour_url:
        check_resume_point(layout.url, start.behaviour_url, "")
    return RunSetup(cfg, handle, start)


def _where_tracked() -> str:
    """This process's tracking URI, credentials masked, a relative SQLite path made absolute (the same
    ``sqlite:///mlflow.db`` is another database in another folder)."""
    uri = tracking.tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    return redact(uri)


def check_tracked_here(layout: RunLayout, info: RunInfo) -> str:
    """The run's MLflow run is at this tracking URI: a resume against another server or database is
    refused naming the URI the run started with, before anything is touched. Its status
    (``FINISHED``, ``FAILED``, ...; "" without an MLflow run)."""
    from mlflow.exceptions import MlflowException

    if not info.mlflow_run_id:
        return ""
    try:
        return tracking.client().get_run(info.mlflow_run_id).info.status
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        now = _where_tracked()
        started = info.mlflow_tracking_uri or "the tracking URI it was started with"
        raise ConfigError(f"run {layout.url} is tracked as MLflow run {info.mlflow_run_id} at {started}, and "
                          f"MLFLOW_TRACKING_URI={now} has no such run: set MLFLOW_TRACKING_URI to {started} to "
                          f"resume it (run.json)") from None


def _record_changes(layout: RunLayout, info: RunInfo, cfg: TrainConfig, changes: List[ConfigChange]) -> None:
    """Keep the resumed run's config and its changes in ``run.json``, and say what changed."""
    if not changes:
        return
    layout.write_run_info(dataclasses.replace(info, config=to_dict(cfg),
                                              config_changes=change_records(info.config_changes, changes)))
    for c in changes:
        print(f"resuming {layout.run_name}: {c.describe()}", flush=True)


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
    name = run_name or cfg.run.name or default_run_name(cfg.run.algorithm)
    layout = RunLayout(cfg.run.storage_root, name)
    check_storage(layout.url)
    if workflow not in ("", "ppo", "reinforce") or not storage.exists(layout.run_info_url):
        check_workflow(cfg, workflow)  # a new run: its own config must suit the workflow
    run_lock.acquire(layout.lock_url, cfg.run.lock_ttl_s)
    try:
        if storage.exists(layout.run_info_url):
            log.info("resuming run %s", layout.url)
            return resume_run(layout, cfg, given_keys(preset, overrides), workflow)
        return new_run(cfg, layout, preset or DEFAULT_PRESETS.get(workflow, ""))
    except BaseException:
        run_lock.release(layout.lock_url)
        raise
