"""Flyte tasks and what they share. Importing any of them quiets the libraries' console chatter
(``models/console.py``; ``RLHF_VERBOSE=1`` keeps it): this runs first in every process that runs a
task (``pyflyte run``, a pod's ``pyflyte-execute``, an elastic worker), before torch, transformers
or vLLM load."""

from models.console import quiet_libraries

quiet_libraries()
