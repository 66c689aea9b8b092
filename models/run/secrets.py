"""The credentials a run reads, by Flyte secret key and environment variable (no Flyte here: the
requests and the loading are ``tasks/secrets.py``'s).

Each secret is a key of the Flyte secret group :data:`GROUP` (a Kubernetes secret of that name in
the execution namespace), exported to the environment variable the libraries read.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

from models.service.token import SECRET_ENV, SECRET_KEY

GROUP = "flyte-rlhf"
"""Flyte secret group (Kubernetes secret name)."""


class SecretSpec(NamedTuple):
    key: str
    """Key inside :data:`GROUP`."""
    env: str
    """Environment variable it is exported to."""


S3: Tuple[SecretSpec, ...] = (SecretSpec("aws-access-key-id", "AWS_ACCESS_KEY_ID"),
                              SecretSpec("aws-secret-access-key", "AWS_SECRET_ACCESS_KEY"))
MLFLOW: Tuple[SecretSpec, ...] = (SecretSpec("mlflow-tracking-token", "MLFLOW_TRACKING_TOKEN"),)
SERVER: Tuple[SecretSpec, ...] = (SecretSpec("server-token", "RLHF_SERVER_TOKEN"),)
SERVICE: Tuple[SecretSpec, ...] = (SecretSpec(SECRET_KEY, SECRET_ENV),)
"""The secret a resident run's services and their callers derive the services' token from (``run.resident``)."""
