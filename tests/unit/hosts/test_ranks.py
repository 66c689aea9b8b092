"""A local trainer service's ranks (``python -m models.hosts ranks``, models/hosts/ranks.py): forked from one
forkserver that imported what they need once, each with torchrun's per-rank environment; a rank that fails ends the
launch with its error, as torchrun's did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LAUNCH = """
import sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from models.hosts.ranks import launch_ranks
from tests.unit.hosts._rank_probe import entry
try:
    launch_ranks(2, ["tests.unit.hosts._rank_probe"], entry, sys.argv[1:])
except ChildFailedError as err:
    print("FAILED " + err.format_msg())
"""


def _launch(tmp_path: Path, *argv: str) -> tuple:
    imports = tmp_path / f"imports-{'-'.join(argv)}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the launch sets torchrun's default
    env.update(RANK_PROBE_IMPORTS=str(imports), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", LAUNCH, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("RANK_PROBE ")]
    return ranks, imports.read_text().split(), out.stdout


@pytest.mark.slow  # a launcher importing torch, its forkserver, two ranks
def test_the_ranks_are_forked_from_one_process_that_imported_their_modules(tmp_path):
    ranks, imported_by, _ = _launch(tmp_path, "ok")
    assert sorted(r["rank"] for r in ranks) == [0, 1] and {r["world"] for r in ranks} == {2}
    # imported by the launching script (for ``entry``) and the forkserver, never by a rank: both forked by the latter
    forkserver = {r["ppid"] for r in ranks}
    assert len(imported_by) == 2 and len(forkserver) == 1 and forkserver < set(map(int, imported_by))
    assert not {r["pid"] for r in ranks} & set(map(int, imported_by))
    assert all(r["argv"] == ["ok"] and r["threads"] == "1" and r["torch_loaded"] for r in ranks)

    ranks, _, out = _launch(tmp_path, "fail")  # rank 1 raises: the launch fails naming it, as torchrun's did
    assert "FAILED " in out and "rank 1 was told to fail" in out and "rank: 1" in out, out[-3000:]
    assert [r["rank"] for r in ranks] in ([0], [])  # rank 0 may have reported before the launch stopped it
