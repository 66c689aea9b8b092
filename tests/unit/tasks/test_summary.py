"""The summary a finished run prints (``models/stages/finish.py:summary_text``): counted in the right
number, naming only the checkpoints and batches the run folder holds, with their sizes."""

from __future__ import annotations

import pytest

from models import storage
from models.config.io import load_config
from models.run.retention import usage
from models.stages.finish import summary_text
from models.stages.outputs import TrainingSummary
from models.run.types import RunHandle


def _files(run: RunHandle, files: dict) -> None:
    """``{relative path: size}`` under the run folder, each file of that many bytes."""
    for rel, size in files.items():
        storage.write_bytes(storage.join(run.layout.url, rel), b"x" * size)


@pytest.mark.parametrize("preset, iterations, head, checkpoints", [
    ("tiny_grpo", 1, "Run r finished: 1 iteration of grpo.",
     "  checkpoints:    1 checkpoint (iter-000000; 3 B), actor/ under each, "),
    ("tiny_ppo", 2, "Run r finished: 2 iterations of ppo.",
     "  checkpoints:    1 checkpoint (iter-000001; 6 B), actor/ and critic/ under each, "),
])
def test_the_summary_counts_iterations_and_names_only_checkpoints_that_exist(tmp_path, preset, iterations, head,
                                                                             checkpoints):
    cfg = load_config(preset, [f"run.num_iterations={iterations}", f"run.save_interval={iterations}"])
    run = RunHandle(str(tmp_path), "r", "abc", "ref", "train", "eval")
    last = f"iter-{iterations - 1:06d}"
    roles = ("actor", "critic") if cfg.uses_critic else ("actor",)
    _files(run, {f"{last}/{role}/COMMITTED.json": 2 for role in roles} | {f"{last}/{role}/x.json": 1 for role in roles})
    summary = TrainingSummary(f"{tmp_path}/r", "abc", iterations, 0.25, 0.5, f"{tmp_path}/r/final")
    lines = summary_text(cfg, run, summary, "", usage(run.layout)).splitlines()
    assert lines[0] == head
    saved = [line for line in lines if line.startswith("  checkpoints:")]
    assert saved == [f"{checkpoints}run.keep_checkpoints=-1; final actor {tmp_path}/r/final"]
    assert ("critic" in "\n".join(lines)) == cfg.uses_critic


def test_the_summary_says_what_retention_kept_and_its_size(tmp_path):
    """Checkpoints at 9 and 19 (an optimizer state beside 19's, a partial one at 18 that does not count as a
    checkpoint), batches of iterations 17-19, the run's own files: each line's count, names and bytes."""
    cfg = load_config("tiny_ppo", ["run.num_iterations=20", "run.save_interval=10", "run.keep_checkpoints=2",
                                   "run.keep_batches=3"])
    run = RunHandle(str(tmp_path), "r", "abc", "ref", "train", "eval")
    files = {"run.json": 100_000, "iter-000009/actor/COMMITTED.json": 200_000,
             "iter-000009/critic/w.safetensors": 300_000, "iter-000019/actor/COMMITTED.json": 500_000,
             "iter-000019/actor-optimizer/m.safetensors": 1_000_000, "iter-000018/actor/config.json": 7,
             "iter-000017/rollouts.arrow": 1_000, "iter-000017/rollouts.arrow.blake3": 64}
    files |= {f"iter-0000{j}/{stage}.arrow": 10_000 for j in (18, 19) for stage in ("rollouts", "score", "advantages")}
    _files(run, files)
    summary = TrainingSummary(f"{tmp_path}/r", "abc", 20, 0.25, 0.5, f"{tmp_path}/r/iter-000019/actor")
    lines = summary_text(cfg, run, summary, "", usage(run.layout)).splitlines()
    assert f"  run folder:     {tmp_path}/r  (run.json, state.json, data/, reference/; 2.2 MB in all)" in lines
    assert (f"  batches:        {tmp_path}/r/iter-*/{{rollouts,score,advantages}}.arrow: 3 iterations (17-19; "
            f"61.1 kB), run.keep_batches=3") in lines
    assert (f"  checkpoints:    2 checkpoints (iter-000009, iter-000019; 2.0 MB), actor/ and critic/ under each, "
            f"run.keep_checkpoints=2; final actor {tmp_path}/r/iter-000019/actor") in lines
