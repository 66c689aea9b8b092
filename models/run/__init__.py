"""A run's lifecycle, outside any one Flyte task: ``setup`` (the launch: check, resolve, build or copy
the starting model, write the run's files), ``preflight`` (the checks before any model loads),
``resume`` (every decision of a relaunch: whether it resumes, with which config, from which state),
``data`` (the run's prompt split), ``layout`` (where a run's files live on storage and what they say),
``retention`` (which old checkpoints and batches a commit deletes),
``lock`` (one writer per run; the Flyte execution read from the task pod's environment), ``end``
(closing the MLflow run however the process ends) and ``errors`` (the innermost error of a failure; one
line for a config error). docs/concepts/run_layout.md names each run concept's class."""
