"""The summary a finished run prints (``models/stages/finish.py:summary_text``): counted in the right
number, and naming only the checkpoints the algorithm writes."""

from __future__ import annotations

import pytest

from models.config.io import load_config
from models.stages.finish import summary_text
from models.stages.outputs import TrainingSummary
from models.run.types import RunHandle


@pytest.mark.parametrize("preset, iterations, head, checkpoints", [
    ("tiny_grpo", 1, "Run r finished: 1 iteration of grpo.", "  checkpoints:    iter-000000 (actor/ under each); "),
    ("tiny_ppo", 2, "Run r finished: 2 iterations of ppo.",
     "  checkpoints:    iter-000001 (actor/ and critic/ under each); "),
])
def test_the_summary_counts_iterations_and_names_only_checkpoints_that_exist(tmp_path, preset, iterations, head,
                                                                             checkpoints):
    cfg = load_config(preset, [f"run.num_iterations={iterations}", f"run.save_interval={iterations}"])
    run = RunHandle(str(tmp_path), "r", "abc", "ref", "train", "eval")
    summary = TrainingSummary(f"{tmp_path}/r", "abc", iterations, 0.25, 0.5, f"{tmp_path}/r/final")
    lines = summary_text(cfg, run, summary, "").splitlines()
    assert lines[0] == head
    saved = [line for line in lines if line.startswith("  checkpoints:")]
    assert saved == [f"{checkpoints}final actor {tmp_path}/r/final"]
    assert ("critic" in "\n".join(lines)) == cfg.uses_critic
