"""Creating or resuming a run: config, prompt checks (before any model loads), initial
checkpoints, the MLflow run, and the state an iteration starts from."""

from __future__ import annotations

import datetime as dt
import logging
import os
import subprocess
import tempfile
from typing import List, NamedTuple, Optional

from models import storage
from models.checkpoint import download_checkpoint, is_committed, save_checkpoint
from tasks import tracking
from tasks.config import ConfigError, TrainConfig
from tasks.config_io import config_from_json_dict, flatten, load_config, to_dict
from tasks.preflight import check_resume_point, check_sources, check_storage, check_vocab
from tasks.prompts import PromptDataConfig, load_prompts
from tasks.run_layout import RunInfo, RunLayout
from tasks.types import PolicyState, RunHandle

log = logging.getLogger(__name__)

_TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".jinja")


class RunSetup(NamedTuple):
    cfg: TrainConfig
    run: RunHandle
    state: PolicyState


def cache_dir() -> str:
    """Content-keyed cache for the demo models (``RLHF_CACHE_DIR``, default ``~/.cache/flyte-rlhf``)."""
    return os.environ.get("RLHF_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "flyte-rlhf"))


def default_run_name(algorithm: str) -> str:
    return f"{algorithm}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def git_commit() -> str:
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


def _demo_assets(cfg: TrainConfig, workdir: str) -> dict:
    from models.tiny import TinyModelConfig
    from models.warm_start import WarmStartConfig, build_demo_models

    m = cfg.model
    tiny = TinyModelConfig(hidden_size=m.tiny_hidden_size, num_layers=m.tiny_num_layers,
                           num_heads=m.tiny_num_heads, num_kv_heads=m.tiny_num_heads,
                           intermediate_size=4 * m.tiny_hidden_size)
    return {k: str(v) for k, v in build_demo_models(
        workdir, os.path.join(cache_dir(), "warm_start"), tiny, cfg=WarmStartConfig(steps=m.warm_start_steps),
        num_train_prompts=cfg.data.num_demo_train_prompts, num_eval_prompts=cfg.data.num_demo_eval_prompts).items()}


def _check_prompts(cfg: TrainConfig, url: str, tokenizer) -> List[str]:
    d = cfg.data
    return load_prompts(PromptDataConfig(url=url, prompt_column=d.prompt_column, max_prompt_chars=d.max_prompt_chars,
                                         max_prompt_tokens=d.max_prompt_tokens), tokenizer).prompts


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
    train_url, eval_url = cfg.data.train_prompts, cfg.data.eval_prompts
    demo = not cfg.model.actor_path
    if demo:
        from models.tokenizer import build_char_tokenizer

        tokenizer = build_char_tokenizer()
    else:
        tokenizer = load_tokenizer_only(cfg.model.actor_path)
        _check_vocabularies(cfg, tokenizer)
        from tasks.rollout import check_rollout_setup

        check_rollout_setup(cfg, storage.read_json(storage.join(cfg.model.actor_path, "config.json")))
    if train_url:  # user data: every row is checked before any model is loaded
        probe = _check_prompts(cfg, train_url, tokenizer)[:4]
        if eval_url:
            _check_prompts(cfg, eval_url, tokenizer)
        check_sources(cfg, probe, len(tokenizer))
    assets = _demo_assets(cfg, work) if demo else {}
    train_url = train_url or assets.get("train_prompts", "")
    eval_url = eval_url or assets.get("eval_prompts", "") or train_url
    if not train_url:
        raise ValueError("data.train_prompts is empty and no demo prompts were built")
    if demo and not cfg.data.train_prompts:  # the demo's own prompts, checked like user data
        check_sources(cfg, _check_prompts(cfg, train_url, tokenizer)[:4], len(tokenizer))
    run_train = storage.join(data_dir, "train_prompts.jsonl")
    run_eval = storage.join(data_dir, "eval_prompts.jsonl")
    _copy_data(train_url, run_train)
    _copy_data(eval_url, run_eval)

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
                                  mlflow_run_id=run_id))
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


def _copy_data(src: str, dst: str) -> None:
    files = _data_files(src)
    if len(files) == 1 and files[0].endswith(".jsonl"):
        storage.write_bytes(dst, storage.read_bytes(files[0]))
        return
    # Parquet or several files: re-write as one JSONL of the validated rows.
    import json

    data = load_prompts(PromptDataConfig(url=src, max_prompt_chars=10**9))
    lines = [json.dumps({"prompt": p, "prompt_id": int(i)}) for p, i in zip(data.prompts, data.prompt_ids)]
    storage.write_bytes(dst, ("\n".join(lines) + "\n").encode())


def _data_files(url: str) -> List[str]:
    from tasks.prompts import resolve_files

    return resolve_files(url)


def _critic_from(actor_url: str, work: str) -> str:
    from models.tiny import critic_from_actor

    return str(critic_from_actor(download_checkpoint(actor_url), os.path.join(work, "critic")))


def _flyte_execution_id() -> str:
    try:
        import flytekit

        return str(flytekit.current_context().execution_id.name)
    except Exception:  # outside a Flyte task
        return "local"


def resume_run(layout: RunLayout, cfg_now: Optional[TrainConfig]) -> RunSetup:
    """Continue a run from ``state.json``: its stored config (``num_iterations`` may grow).

    The next iteration starts from the committed checkpoints ``state.json`` names (refused if
    not committed). With fixed seeds on the same CPU machine the resumed run is bit-identical
    to an uninterrupted one (every seed depends on ``run.seed`` and the iteration only;
    ``tests/integration/test_resume.py``, README "Reliability")."""
    info = layout.read_run_info()
    cfg = config_from_json_dict(info.config)
    if cfg_now is not None and cfg_now.run.num_iterations != cfg.run.num_iterations:
        data = to_dict(cfg)
        data["run"]["num_iterations"] = cfg_now.run.num_iterations
        cfg = config_from_json_dict(data)
    base = storage.join(layout.url, "data")
    rm = storage.join(layout.url, "reward-model") if cfg.reward.source == "model" else ""
    handle = RunHandle(layout.root, layout.run_name, info.mlflow_run_id or "", layout.reference_url(),
                       storage.join(base, "train_prompts.jsonl"), storage.join(base, "eval_prompts.jsonl"), rm)
    if info.mlflow_run_id:  # the same MLflow run goes on (a finished run shows as running again)
        tracking.client().update_run(info.mlflow_run_id, status="RUNNING")
    state = layout.read_state()
    if state is None:
        critic = storage.join(layout.url, "critic-init") if cfg.uses_critic else ""
        return RunSetup(cfg, handle, PolicyState(0, layout.reference_url(), critic, cfg.kl.coef))
    check_resume_point(layout.url, state.actor_url, state.critic_url or "")
    kl = float(state.extras.get("kl_coef", cfg.kl.coef))
    return RunSetup(cfg, handle, PolicyState(state.iteration + 1, state.actor_url, state.critic_url or "", kl))


def check_workflow(cfg: TrainConfig, workflow: str) -> None:
    """The PPO workflow trains a critic; the critic-free one must not be given PPO."""
    if workflow and workflow not in ("ppo", "reinforce"):
        raise ConfigError(f"unknown workflow {workflow!r}: use 'ppo' or 'reinforce'")
    if workflow == "ppo" and not cfg.uses_critic:
        raise ConfigError(f"run.algorithm={cfg.run.algorithm} is critic-free: use workflows/reinforce.py "
                          f"reinforce_training")
    if workflow == "reinforce" and cfg.uses_critic:
        raise ConfigError(f"run.algorithm={cfg.run.algorithm} trains a critic: use workflows/ppo.py ppo_training")


def setup_run(preset: str, overrides: List[str], run_name: str = "", workflow: str = "") -> RunSetup:
    """Entry point of a training workflow: a new run, or the resumption of ``run_name``."""
    cfg = load_config(preset, list(overrides))
    check_workflow(cfg, workflow)
    name = run_name or cfg.run.name or default_run_name(cfg.run.algorithm)
    layout = RunLayout(cfg.run.storage_root, name)
    check_storage(layout.url)
    if storage.exists(layout.run_info_url):
        log.info("resuming run %s", layout.url)
        return resume_run(layout, cfg)
    return new_run(cfg, layout, preset)
