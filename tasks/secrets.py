"""Credentials through Flyte secrets, never as task inputs, config values or MLflow params.

Each secret is a key of the Flyte secret group :data:`GROUP` (a Kubernetes secret of that name in
the execution namespace). A task requests the ones it needs in its decorator
(``secret_requests=requests(S3, MLFLOW)``) and calls :func:`load` first: every secret found
and not empty is exported to the environment variable the libraries read (boto/s3fs, MLflow,
the reward/critic client). A variable already set wins, so local runs simply use their own
environment, and an empty secret leaves the variable unset (e.g. S3 access from an IAM role).
"""

from __future__ import annotations

import os
from typing import Iterable, List

from flytekit import Secret

from models.run.secrets import GROUP, MLFLOW, S3, SERVER, SERVICE, SecretSpec  # noqa: F401  (the keys, Flyte-free)


def requests(*groups: Iterable[SecretSpec]) -> List[Secret]:
    """Flyte secret requests for a task decorator."""
    return [Secret(group=GROUP, key=s.key) for g in groups for s in g]


def load(*groups: Iterable[SecretSpec]) -> List[str]:
    """Export the requested secrets to their environment variables; returns the names exported."""
    import flytekit

    done = []
    for spec in (s for g in groups for s in g):
        if os.environ.get(spec.env):
            continue
        try:
            value = flytekit.current_context().secrets.get(GROUP, spec.key)
        except Exception:  # not mounted (local run, or a cluster that does not provide it)
            continue
        if value and value.strip():
            os.environ[spec.env] = value.strip()
            done.append(spec.env)
    return done
