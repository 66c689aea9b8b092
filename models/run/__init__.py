"""A run's lifecycle, outside any one Flyte task: ``setup`` (the launch: check, resolve, write the
run's files), ``preflight`` (the checks before any model loads), ``resume`` (what a relaunch may
change), ``data`` (the run's prompt split), ``layout`` (where a run's files live on storage and what
they say), ``lock`` (one writer per run), ``end`` (closing the MLflow run however the process ends)
and ``errors`` (the innermost error of a failure; one line for a config error).
docs/concepts/run_layout.md names each run concept's class."""
