"""Keep credentials out of MLflow params, tags and printed summaries.

Three kinds of secret are replaced by ``***`` in any text:

- the user-info part of a URL (``https://user:pass@host`` → ``https://***@host``);
- the value of a query parameter whose name looks secret (``?token=...``, ``X-Amz-Signature=...``,
  ``X-Amz-Credential=...``, ``api_key=...``);
- the value of any environment variable whose name looks secret (``AWS_SECRET_ACCESS_KEY``,
  ``MLFLOW_TRACKING_TOKEN``, ``RLHF_SERVER_TOKEN``, ...), wherever it appears (values shorter
  than 8 characters are left alone: they would match ordinary words).

Example::

    redact("http://bob:hunter2@10.0.0.1:8000/?token=abc")   # 'http://***@10.0.0.1:8000/?token=***'
"""

from __future__ import annotations

import os
import re
from typing import List, Mapping, Optional

MASK = "***"
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|ACCESS_KEY|API_KEY|PRIVATE_KEY|SIGNATURE|AUTH",
                         re.IGNORECASE)
"""Environment variable or query parameter names whose values are secrets."""
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\s]+@")
_QUERY = re.compile(r"(?P<key>[?&;][^=&#\s]+=)(?P<value>[^&#\s]*)")
_MIN_ENV_SECRET_LEN = 8


def secret_env_values(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Values of secret-looking environment variables, longest first (so overlaps mask fully)."""
    if env is None:  # a snapshot: MLflow's telemetry thread sets/unsets variables while we read
        env = dict(os.environ._data) if hasattr(os.environ, "_data") else dict(os.environ)
        env = {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}
    values = {v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= _MIN_ENV_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def redact(text: str, env: Optional[Mapping[str, str]] = None) -> str:
    """``text`` with URL user-info, secret query values and secret environment values masked."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _QUERY.sub(lambda m: m["key"] + (MASK if SECRET_NAME.search(m["key"]) else m["value"]), text)
    for value in secret_env_values(env):
        text = text.replace(value, MASK)
    return text
