"""Checkpoints and policies in MLflow: checkpoint artifacts, the final policy in the ``transformers``
flavour, the Model Registry and its aliases (``candidate``, ``champion``).

Every call is idempotent, so a retried or resumed task never logs a checkpoint, a model or a
model version twice.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Iterable, NamedTuple, Optional

from models.checkpoint import check_finite, download_checkpoint, is_committed, read_marker, save_checkpoint
from models.console import mlflow_events_off
from models.training.files import ADAPTER_CONFIG, is_adapter
from models import tracking
from models.tracking.redact import redact

log = logging.getLogger(__name__)

CANDIDATE = "candidate"
"""Alias of the newest trained policy (set by every finished run that registers its policy)."""
CHAMPION = "champion"
"""Alias of the policy in production; moved only by a retraining run whose candidate wins."""
POLICY_NAME = "policy"
"""Name of the final policy among the run's logged models."""
ADAPTER_ARTIFACTS = "policy-adapter"
"""Artifact folder of the final LoRA adapter (peft format) when the actor trains one."""


class PolicyVersion(NamedTuple):
    model_uri: str
    """``models:/m-...`` of the logged policy."""
    version: str
    """Model Registry version ("" when not registered)."""


def checkpoint_bytes(url: str) -> int:
    """Size of a committed checkpoint, from its marker."""
    return sum(int(f["size"]) for f in read_marker(url)["files"].values())


def log_checkpoint(run_id: str, name: str, url: str, max_mb: float) -> bool:
    """Tag ``checkpoint.{name}`` with ``url``; copy the checkpoint into ``checkpoints/{name}/`` when
    it is at most ``max_mb`` MiB. Returns whether it is (now) an artifact of the run."""
    tracking.set_tags(run_id, {f"checkpoint.{name}": url})
    if checkpoint_bytes(url) > max_mb * 2 ** 20:
        return False
    dest = f"checkpoints/{name}"
    c = tracking.client()
    if any(a.path in (f"{dest}/config.json", f"{dest}/{ADAPTER_CONFIG}") for a in c.list_artifacts(run_id, dest)):
        return True
    c.log_artifacts(run_id, download_checkpoint(url), dest)
    return True


def forget_checkpoints(run_id: str, iterations: Iterable[str]) -> None:
    """Delete the MLflow copies :func:`log_checkpoint` made of the checkpoints of ``iterations``
    (``iter-000009``: the artifacts ``checkpoints/iter-000009/``), then their ``checkpoint.iter-000009/*``
    tags, which say a copy may exist: a call again after a crash finds the tags and finishes. A store that
    cannot delete keeps the copy and its tag, with a warning: retention does not stop the run for it."""
    from mlflow.exceptions import MlflowException
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    c = tracking.client()
    run = c.get_run(run_id)
    for name in iterations:
        tags = [t for t in run.data.tags if t.startswith(f"checkpoint.{name}/")]
        if not tags:
            continue
        try:
            get_artifact_repository(run.info.artifact_uri).delete_artifacts(f"checkpoints/{name}")
        except (MlflowException, OSError, NotImplementedError) as err:
            log.warning("MLflow run %s: cannot delete the artifacts checkpoints/%s (kept): %s", run_id, name, err)
            continue
        for tag in tags:
            c.delete_tag(run_id, tag)


def _logged_policy(run_id: str, actor_url: str):
    """The run's logged ``policy`` made from the checkpoint ``actor_url`` (None: not logged yet). A run
    extended after it finished logs a new one for its new final checkpoint."""
    import mlflow

    exp = tracking.client().get_run(run_id).info.experiment_id
    found = mlflow.search_logged_models(experiment_ids=[exp], output_format="list",
                                        filter_string=f"source_run_id = '{run_id}' AND name = '{POLICY_NAME}'")
    ready = [m for m in found if str(m.status).endswith("READY") and m.tags.get(CHECKPOINT_TAG) == redact(actor_url)]
    return ready[0] if ready else None


CHECKPOINT_TAG = "checkpoint_url"
"""Tag of a logged policy and of its model version: the committed checkpoint it was made from."""


def _requirements() -> list:
    import safetensors
    import tokenizers
    import torch
    import transformers

    return [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}",
            f"tokenizers=={tokenizers.__version__}", f"safetensors=={safetensors.__version__}"]


def log_policy(run_id: str, actor_url: str, registered_name: str) -> PolicyVersion:
    """Log the committed checkpoint ``actor_url`` as the run's ``policy`` (``transformers`` flavour);
    register it under ``registered_name`` (if not empty) with alias ``candidate``.

    Idempotent per checkpoint: a retried call reuses what it logged and registered, while a run that
    was extended and finished again logs and registers its new final policy. Weights that are not
    finite are refused (:func:`models.checkpoint.check_finite`). A LoRA adapter is logged as is under
    the artifacts ``policy-adapter/``, and the ``policy`` model is the adapter merged into its base: a
    full model that serves and registers like any."""
    model = _logged_policy(run_id, actor_url)
    model_uri = model.model_uri if model is not None else _log_new_policy(run_id, actor_url)
    if not registered_name:
        return PolicyVersion(model_uri, "")
    import mlflow

    c = tracking.client()
    versions = [v for v in c.search_model_versions(f"name = '{registered_name}' AND run_id = '{run_id}'")
                if model_uri in (v.source, f"models:/{v.model_id}")]
    if not versions:
        with mlflow_events_off():
            versions = [mlflow.register_model(model_uri, registered_name, tags={CHECKPOINT_TAG: redact(actor_url)})]
    version = str(versions[0].version)
    c.set_registered_model_alias(registered_name, CANDIDATE, version)
    return PolicyVersion(model_uri, version)


def _log_new_policy(run_id: str, actor_url: str) -> str:
    """Log the checkpoint as a new ``policy`` of the run; its model URI."""
    import mlflow

    from models.training.merge import merge_adapter  # torch and peft, for an adapter's policy only

    local = download_checkpoint(actor_url)
    for rel in sorted(read_marker(actor_url)["files"]):
        if rel.endswith(".safetensors"):
            check_finite(os.path.join(local, rel), rel, actor_url)
    with tempfile.TemporaryDirectory(prefix="policy-") as tmp, mlflow.start_run(run_id=run_id):
        metadata = {"checkpoint_url": redact(actor_url)}
        if is_adapter(local):
            tracking.client().log_artifacts(run_id, local, ADAPTER_ARTIFACTS)
            local = merge_adapter(local, tmp)
            metadata["lora_adapter"] = f"runs:/{run_id}/{ADAPTER_ARTIFACTS}"
        info = mlflow.transformers.log_model(local, name=POLICY_NAME, task="text-generation",
                                             pip_requirements=_requirements(), metadata=metadata,
                                             tags={CHECKPOINT_TAG: redact(actor_url)})
    return info.model_uri


def version_by_alias(name: str, alias: str) -> Optional[str]:
    """The version ``name@alias`` points at, or None (no such model or alias)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(tracking.client().get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def set_alias(name: str, alias: str, version: str) -> None:
    tracking.client().set_registered_model_alias(name, alias, version)


def tag_version(name: str, version: str, tags: dict) -> None:
    c = tracking.client()
    for k, v in tags.items():
        c.set_model_version_tag(name, version, k, str(v))


def checkpoint_from_registry(name: str, version: str, url: str) -> str:
    """A committed HF checkpoint at ``url`` of ``models:/{name}/{version}`` (weights and tokenizer
    files of the ``transformers`` flavour); reused when already there."""
    import mlflow

    if is_committed(url):
        return url
    tracking.client()
    tmp = tempfile.mkdtemp(prefix="registry-")
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=tmp)
        hf = os.path.join(tmp, "hf")
        for part in ("model", os.path.join("components", "tokenizer")):  # weights + config, tokenizer
            if os.path.isdir(os.path.join(local, part)):
                shutil.copytree(os.path.join(local, part), hf, dirs_exist_ok=True)
        if not os.path.isfile(os.path.join(hf, "config.json")):
            raise ValueError(f"models:/{name}/{version} is not a transformers-flavour model (no model/config.json)")
        save_checkpoint(hf, url, overwrite=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return url
