"""Flyte workflows (wiring only). Importing them imports :mod:`tasks` first, which quiets the
libraries' console chatter (``models/console.py``; ``RLHF_VERBOSE=1`` keeps it)."""

import tasks  # noqa: F401
