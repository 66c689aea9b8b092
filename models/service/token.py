"""The bearer token of a run's own services (``run.resident``), derived from one secret and never stored: every
service and every task that calls one computes it from the secret in :data:`SECRET_ENV` (on a cluster the Flyte
secret ``flyte-rlhf/service-secret``, ``models/run/secrets.py``), the run's folder, the launch and the service's
name (HMAC-SHA256). The address book under the run's folder holds addresses only, so reading the bucket gives no
way in; each launch, and each service, has a token of its own. Locally the run's process makes a fresh secret
for the launch when none is set and hands it to its services in their environment (:func:`ensure_local_secret`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Mapping, Optional

SECRET_ENV = "RLHF_SERVICE_SECRET"
SECRET_KEY = "service-secret"
"""The key of the Flyte secret group ``flyte-rlhf`` it is mounted from on a cluster."""


class MissingSecret(RuntimeError):
    """No secret to derive the services' token from."""


def service_token(run_url: str, launch: str, name: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """The token service ``name`` of the run at ``run_url``, started by ``launch``, accepts."""
    secret = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    if not secret:
        raise MissingSecret(f"a resident run's services accept only callers holding their token, derived from the "
                            f"secret in {SECRET_ENV}, which this process does not have: on a cluster create the "
                            f"Flyte secret flyte-rlhf/{SECRET_KEY} (docs/cluster.md#running-the-resident-mode)")
    message = "\n".join(("flyte-rlhf resident service", run_url.rstrip("/"), launch, name)).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def ensure_local_secret() -> None:
    """A fresh secret for this process and its children (a local run's services) unless one is set."""
    if not os.environ.get(SECRET_ENV):
        os.environ[SECRET_ENV] = secrets.token_urlsafe(32)
