"""Flyte tasks (one module per stage) and what only they use: ``config/``, ``algorithms/``, ``run/`` (a
run's lifecycle), ``tracking/`` (MLflow) and the Flyte support beside the task modules (the floor plan:
docs/development.md). Importing any of them quiets the libraries' console chatter
(``models/console.py``; ``RLHF_VERBOSE=1`` keeps it): this runs first in every process that runs a
task (``pyflyte run``, a pod's ``pyflyte-execute``, an elastic worker), before torch, transformers
or vLLM load. Under ``pyflyte`` it also makes a config error print its one-line reason
(``models/run/errors.py``)."""

from models.console import quiet_libraries
from models.run.errors import short_config_errors

quiet_libraries()
short_config_errors()
