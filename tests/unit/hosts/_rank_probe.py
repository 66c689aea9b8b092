"""Imported by the forkserver of :mod:`models.hosts.ranks` in tests/unit/hosts/test_ranks.py: each import of this
module appends its process's pid to the file ``RANK_PROBE_IMPORTS`` names; :func:`entry` reports a rank's view."""

import json
import os
import sys

with open(os.environ["RANK_PROBE_IMPORTS"], "a") as _f:
    _f.write(f"{os.getpid()}\n")


def entry(argv):
    """Rank 1 fails when ``argv`` says so; every rank prints its pid, parent, rank, world and the argv it got."""
    if argv == ["fail"] and os.environ["RANK"] == "1":
        raise ValueError("rank 1 was told to fail")
    print("RANK_PROBE " + json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "rank": int(os.environ["RANK"]),
                                      "world": int(os.environ["WORLD_SIZE"]), "argv": argv,
                                      "threads": os.environ.get("OMP_NUM_THREADS"),
                                      "torch_loaded": "torch" in sys.modules}), flush=True)
