"""Flyte workflows (wiring only). Importing them quiets the libraries' console chatter first
(``models/console.py``; ``RLHF_VERBOSE=1`` keeps it)."""

from models.console import quiet_libraries

quiet_libraries()
