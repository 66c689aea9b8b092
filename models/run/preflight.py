"""Checks a run makes before it spends any accelerator time, each failing with an error that
names what is wrong (the URL, the field, the numbers).

``prepare_run`` first runs :func:`check_remote_run` in a remote execution (local paths, the actor
topology, S3 credentials, the tracking server) and :func:`check_tracking` in any run. ``setup_run``
then calls the rest in this order: storage reachable and writable, then (new runs) the model
folders the config names, the prompts, the tokenizer against the model's vocabulary, the reward
source and the servers (a resumed run's checks: :mod:`models.run.resume`). Bad prompts and config values are
checked by :mod:`models.data.prompts` and :mod:`models.config`.
"""

from __future__ import annotations

import uuid

from models import storage
from models.checkpoint import PICKLE_SUFFIXES
from models.rewards import RewardError
from models.run import secrets
from models.config import ConfigError, TrainConfig
from models.environ import environment
from models.tracking.redact import redact


def check_storage(run_url: str) -> None:
    """Write and remove a small file under the run's folder: an unreachable store or a missing
    permission fails here (``StorageError`` / ``PermissionError`` naming the URL), not after
    models were built."""
    probe = storage.join(run_url, f".write-check-{uuid.uuid4().hex[:8]}")
    storage.write_bytes(probe, b"ok")
    storage.remove(probe)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""Files of which a checkpoint's tokenizer needs at least one."""
_MODEL_CLASS = {"model.actor_path": "AutoModelForCausalLM", "model.critic_path": "AutoModelForTokenClassification",
                "reward.model_path": "AutoModelForSequenceClassification"}


def check_model_dir(url: str, field: str, needs_tokenizer: bool = False) -> None:
    """The Hugging Face checkpoint folder ``url`` that config ``field`` names: it exists, has a
    ``config.json``, safetensors weights (pickled ones are refused, with the conversion), and with
    ``needs_tokenizer`` a tokenizer. Checked before anything reads it, so the error names the cause
    instead of the Hub's repo-id rules or a tokenizer converter's hint."""
    if not storage.exists(url):
        raise ConfigError(f"{field}={url}: no such folder. Give a local folder or an fsspec URL (s3://...) holding a "
                          f"Hugging Face checkpoint; Hub repo ids are not downloaded, so fetch one first, e.g. "
                          f"`huggingface-cli download <repo> --local-dir <folder>`")
    listed = storage.list_files(url)
    if set(listed) == {""}:  # fsspec lists a file as itself
        parent = url.rstrip("/").rsplit("/", 1)[0]
        hint = f" (its folder {parent} holds one)" if storage.exists(storage.join(parent, "config.json")) else ""
        raise ConfigError(f"{field}={url} is a file, not a checkpoint folder: give the folder that holds its "
                          f"config.json, *.safetensors weights{' and tokenizer' if needs_tokenizer else ''}{hint}")
    names = {rel for rel in listed if "/" not in rel}
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    pickled = sorted(n for n in names if n.lower().endswith(PICKLE_SUFFIXES))
    if pickled and not weights:
        cls = _MODEL_CLASS.get(field, "AutoModel")
        raise ConfigError(f"{field}={url} holds pickled weights ({', '.join(pickled)}) and no .safetensors: pickle "
                          f"files can run code when loaded, so they are refused. Convert them once, on a machine "
                          f"where you trust the file: python -c \"from transformers import {cls}; {cls}."
                          f"from_pretrained('{url}').save_pretrained('<out>', safe_serialization=True)\", copy the "
                          f"tokenizer files into <out> and set {field}=<out>")
    if "config.json" not in names:
        raise ConfigError(f"{field}={url} is not a Hugging Face checkpoint: no config.json (it holds "
                          f"{sorted(names) or 'no files'})")
    if not weights:
        raise ConfigError(f"{field}={url} holds no weights (*.safetensors)")
    if needs_tokenizer and not names & set(TOKENIZER_FILES):
        raise ConfigError(f"{field}={url} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the "
                          f"tokenizer the model was trained with into it (tokenizer.save_pretrained)")


def check_start_named(cfg: TrainConfig) -> None:
    """The config names the model a new run starts from: a checkpoint, or a builder that writes one."""
    if not (cfg.model.actor_path or cfg.model.builder):
        raise ConfigError("model.actor_path is empty and model.builder names no builder: set model.actor_path to "
                          "the HF checkpoint the actor starts from, or model.builder to a function that writes one "
                          "(the demo presets name theirs: docs/presets.md)")


def check_reward_named(cfg: TrainConfig) -> None:
    """A run scored by reward functions names at least one: there is no default reward (the demo presets
    name theirs)."""
    r = cfg.reward
    if r.source == "function" and not [spec for spec in r.specs if spec]:
        raise ConfigError("reward.function is empty: name the function that scores a response, "
                          "reward.function=package.module:function (or several in reward.functions; docs/rewards.md), "
                          "or score with a reward model (reward.source=model) or a reward server (reward.source=remote)")


def check_eval_prompts_exist(cfg: TrainConfig) -> None:
    """``data.eval_prompts`` names files that exist. A run on the demo's training prompts reads its
    held-out prompts only after the demo models are built; a missing file fails here instead."""
    from models.data.prompt_sources import PromptDataError, resolve_files

    url = cfg.data.eval_prompts
    if cfg.data.source != "files" or not url:
        return
    missing = [f for f in resolve_files(url) if not storage.exists(f)]
    if missing:
        raise PromptDataError(url, [f"{f}: file not found (data.eval_prompts)" for f in missing], len(missing))


def check_model_dirs(cfg: TrainConfig) -> None:
    """Every user checkpoint folder the config names (the actor's with its tokenizer)."""
    m = cfg.model
    if m.actor_path:
        check_model_dir(m.actor_path, "model.actor_path", needs_tokenizer=True)
    if m.critic_path and cfg.uses_critic:
        check_model_dir(m.critic_path, "model.critic_path")
    if cfg.reward.source == "model":
        check_model_dir(cfg.reward.model_path, "reward.model_path")


def model_vocab_size(model_url: str) -> int | None:
    """``vocab_size`` of the checkpoint's ``config.json`` (or of its ``text_config``); None if absent."""
    cfg = storage.read_json(storage.join(model_url, "config.json"))
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def check_vocab(tokenizer, model_url: str, what: str) -> None:
    """The tokenizer's ids must index the model's embedding: ``len(tokenizer) <= vocab_size``
    (a larger embedding, padded for speed, is fine)."""
    vocab = model_vocab_size(model_url)
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(f"{what} {model_url}: the tokenizer has {len(tokenizer)} tokens but the model's "
                          f"embedding has {vocab} rows (config.json vocab_size); token ids >= {vocab} would "
                          f"index past it — use the tokenizer the model was trained with")


def check_reward_functions(cfg: TrainConfig, probe) -> None:
    """Import every reward function in its worker and call it once on the ``probe`` rows (a few
    training prompts, with their data columns) with empty responses (a policy may stop at once, so
    every reward function must take them; TRL's keyword form gets the rows' conversations and empty
    ``completion_ids``): a missing function, one whose signature fits neither accepted form, one
    that hangs past ``reward.timeout_s``, raises, takes a column the data lacks, returns the wrong
    number of values, a string, NaN or inf fails now with a ``RewardError`` naming it."""
    from models.rewards.sources import FunctionRewards

    columns = dict(probe.columns)
    if cfg.rollout.environment:  # episodes add their reward and conversation (an episode that ended at once)
        columns.update(episode_reward=[0.0] * len(probe), episode=["[]"] * len(probe))
    try:
        FunctionRewards.from_config(cfg.reward)(probe.prompts, [""] * len(probe), columns=columns,
                                                messages=probe.messages, completion_ids=[[] for _ in range(len(probe))])
    except RewardError as err:
        raise type(err)(f"{err} (set-up check: the reward called on {len(probe)} training prompts with empty "
                        f"responses)") from err


def check_environment(cfg: TrainConfig, probe) -> None:
    """``rollout.environment`` before any model loads: its library installed, nothing it needs that this
    machine cannot give (a hub dataset, a container, a server that does not answer), one environment built
    and started on each of the ``probe`` rows (:func:`models.environments.adapters.check_environment`)."""
    if not cfg.rollout.environment:
        return
    from models.environments.adapters import EnvironmentUnavailable, check_environment as check_env

    rows = [{"prompt": p, **cols} for p, cols in zip(probe.prompts, probe.row_columns())]
    try:
        check_env(cfg.rollout.environment, rows)
    except EnvironmentUnavailable as err:
        raise ConfigError(str(err)) from None


def check_server(url: str, what: str, timeout_s: float, num_tokens: int) -> None:
    """The reward/critic server's ``health`` op answers in time with the configured token
    (``ServiceError`` naming the URL: unreachable, timed out, 401, 5xx after retries), serves
    the needed model, and that model's vocabulary holds the tokenizer's ``num_tokens`` ids."""
    from models.service.client import ServiceClient, server_token

    health = ServiceClient(url, server_token(), "reward server", timeout_s=timeout_s, retries=3).call("health")
    need = {"reward": "reward_model", "critic": "critic"}[what]
    if need not in health["parts"]:
        raise ConfigError(f"{what} server {url} serves {health['parts']}, not a {need}")
    if health["vocab_size"] < num_tokens:
        raise ConfigError(f"{what} server {url}: its model's vocabulary has {health['vocab_size']} tokens, the "
                          f"run's tokenizer {num_tokens}; token ids >= {health['vocab_size']} would index past it")


def check_sources(cfg: TrainConfig, probe, num_tokens: int) -> None:
    """The environment, the reward source and the remote servers the config names (``probe``: a few training rows,
    a :class:`models.data.prompts.PromptDataset`; ``num_tokens``: the size of the run's tokenizer)."""
    r = cfg.reward
    check_environment(cfg, probe)
    if r.source == "function":
        check_reward_functions(cfg, probe)
    elif r.source == "remote":
        check_server(r.remote_url, "reward", r.remote_timeout_s, num_tokens)
    if cfg.uses_critic and cfg.critic.remote_url:
        check_server(cfg.critic.remote_url, "critic", r.remote_timeout_s, num_tokens)


# --- remote executions: what each pod must reach, checked before prepare_run creates anything ----

LOCAL_PATH_FIELDS = ("run.storage_root", "model.actor_path", "model.critic_path", "reward.model_path",
                     "data.train_prompts", "data.eval_prompts")
"""Config fields that name storage every pod of a run must see (empty ones are not used)."""


def _field(cfg: TrainConfig, dotted: str) -> str:
    section, name = dotted.split(".")
    return str(getattr(getattr(cfg, section), name) or "")


def check_remote_paths(cfg: TrainConfig) -> None:
    """A remote execution runs every task in its own pod: a path on the launching machine's (or one pod's)
    disk is an empty folder everywhere else. Refuse each such field, naming it."""
    bad = [f"{f}={_field(cfg, f)!r}" for f in LOCAL_PATH_FIELDS if _field(cfg, f) and storage.is_local(_field(cfg, f))]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: a local path in a remote execution, where every task runs in its own "
                          f"pod and sees its own empty folder; use object storage every pod reaches (s3://...)")


def check_tracking(uri: str, remote: bool, timeout_s: float = 10.0) -> None:
    """The MLflow tracking server answers (a search of one experiment, with the configured token), so no
    run is created against a server the later tasks cannot reach. In a remote execution a local URI
    (``sqlite:``, ``file:``, a path, or unset) is refused: each pod would track into its own database."""
    from models import tracking

    how = ("set MLFLOW_TRACKING_URI at registration: `make package MLFLOW_TRACKING_URI=https://mlflow.example.com`, "
           "or `pyflyte register|run --remote --env MLFLOW_TRACKING_URI=...` (docs/cluster.md)")
    if tracking.is_local_uri(uri):
        if remote:
            raise ConfigError(f"MLflow tracking URI {uri!r} is local to one pod in a remote execution (every task "
                              f"would track into its own database and the run would be lost): {how}")
        return
    location = tracking.artifact_location()
    if remote and location and tracking.is_local_uri(location):
        raise ConfigError(f"{tracking.ARTIFACT_LOCATION_ENV}={location!r} is local to one pod in a remote "
                          f"execution: use object storage (s3://...) or leave it empty (the server's default)")
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    try:
        from mlflow.tracking import MlflowClient

        with environment({MLFLOW_HTTP_REQUEST_MAX_RETRIES.name: "0",  # one try: answers now or never
                          MLFLOW_HTTP_REQUEST_TIMEOUT.name: str(int(timeout_s))}):
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as err:  # connection refused, DNS, 401/403, 5xx: all mean no run can be tracked
        raise ConfigError(f"MLflow tracking server {redact(uri)} is not reachable from this pod "
                          f"({type(err).__name__}: {redact(str(err))[:300]}); check the URI and the Flyte secret "
                          f"{secrets.GROUP}/mlflow-tracking-token, or {how}") from err


def check_s3_credentials(cfg: TrainConfig) -> None:
    """Runs on S3 need credentials in every pod: the Flyte secrets (exported by ``secrets.load``) or the
    pod's own (IAM role, environment)."""
    urls = [_field(cfg, f) for f in LOCAL_PATH_FIELDS]
    if not any(u.startswith(("s3://", "s3a://")) for u in urls):
        return
    import botocore.session

    if botocore.session.get_session().get_credentials() is None:
        keys = ", ".join(f"{secrets.GROUP}/{s.key}" for s in secrets.S3)
        raise ConfigError(f"no S3 credentials in this pod for {cfg.run.storage_root}: create the Flyte secret keys "
                          f"{keys} (kubectl create secret generic {secrets.GROUP} -n <project>-<domain> "
                          f"--from-literal=aws-access-key-id=... --from-literal=aws-secret-access-key=...) or give "
                          f"the pods an IAM role")


def check_local_resident(cfg: TrainConfig) -> None:
    """A local resident run's services are child processes of ``pyflyte run`` on this machine: each trainer
    on one node."""
    if not cfg.run.resident:
        return
    for section in ("actor", "critic"):
        nnodes = getattr(cfg, section).nnodes
        if nnodes > 1 and (section == "actor" or cfg.uses_critic):
            raise ConfigError(f"{section}.nnodes={nnodes}: a local run.resident=true run starts its services on this "
                              f"machine, one node; set {section}.nnodes=1 (and {section}.nproc_per_node to the ranks), "
                              f"or run it on a cluster (pyflyte run --remote)")


def check_remote_run(cfg: TrainConfig, registered: TrainConfig) -> None:
    """What a remote run needs from the cluster, in the order a user fixes them: no local paths, the
    registered actor topology, S3 credentials, the tracking server (storage itself is probed next, by
    ``setup_run``'s :func:`check_storage`, before it writes anything)."""
    from models import tracking

    check_remote_paths(cfg)
    check_topology(cfg, registered)
    check_s3_credentials(cfg)
    check_tracking(tracking.tracking_uri(), remote=True)


DEPLOY_PRESET_ENV = "RLHF_DEPLOY_PRESET"
DEPLOY_OVERRIDES_ENV = "RLHF_DEPLOY_OVERRIDES"
"""The preset and overrides the registered tasks were compiled with (``tasks/deploy.py``)."""

def check_topology(cfg: TrainConfig, registered: TrainConfig) -> None:
    """On a cluster each update's topology (the actor's; the critic's where the run trains one) is the
    registered one; say how to change it if the run asks for another."""
    for section in ("actor", "critic") if cfg.uses_critic else ("actor",):
        a, b = getattr(cfg, section), getattr(registered, section)
        if (a.nnodes, a.nproc_per_node) != (b.nnodes, b.nproc_per_node):
            raise ConfigError(
                f"{section}.nnodes × {section}.nproc_per_node = {a.nnodes} × {a.nproc_per_node}, but the registered "
                f"{section}_update runs {b.nnodes} × {b.nproc_per_node}: register the workflows (and build the image) "
                f"with {DEPLOY_PRESET_ENV}/{DEPLOY_OVERRIDES_ENV} naming this topology (docs/howto/cluster.md)")

def check_rollout_setup(cfg: TrainConfig, actor_config: Dict) -> None:
    """Set-up check (before any model loads) of the rollout settings against the actor checkpoint's
    ``config.json``: a LoRA target vLLM cannot serve as an adapter is refused with what to do."""
    r, lora = cfg.rollout, cfg.actor.lora
    if not (lora.enabled and r.engine == "vllm" and r.lora_mode == "adapter" and not r.remote_url):
        return
    from models.engines.vllm_setup import unsupported_lora_targets  # here: the thin tasks' pods import no torch

    bad = unsupported_lora_targets(actor_config, lora.target_modules)
    if bad:
        tied = " (its embeddings are tied: the merge unties lm_head, so the merged model is the trained one)" \
            if actor_config.get("tie_word_embeddings") else ""
        raise ConfigError(
            f"actor.lora.target_modules has {bad}, which vLLM cannot serve as a LoRA adapter for "
            f"{actor_config.get('architectures')}: use rollout.lora_mode=merged{tied}, or rollout.engine=hf, "
            f"or drop {bad} from actor.lora.target_modules")
