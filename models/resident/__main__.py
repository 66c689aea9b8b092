"""A resident service process: ``python -m models.resident {engine,actor,critic} --launch FILE``.

``FILE`` (JSON, written by :mod:`models.resident.lifecycle`, mode 0600: it holds the token) names the
run, the state the service starts from, its token and idle timeout, and the process that launched the
run. The actor and critic services may run as every rank of a ``torchrun`` launch: each rank builds its
shard, rank 0 listens and publishes the address once all ranks are ready (:mod:`models.resident.service`).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.resident")
    parser.add_argument("service", choices=["engine", "actor", "critic"])
    parser.add_argument("--launch", required=True, help="the launch file written by models.resident.lifecycle")
    opts = parser.parse_args(argv)
    with open(opts.launch) as f:
        launch = json.load(f)
    from models.resident import protocol
    from models.resident.service import ServiceLaunch, serve_service

    cfg, run, state = protocol.read_args(launch)
    serve_service(ServiceLaunch(opts.service, launch["token"], launch["launch"], float(launch["idle_timeout_s"]),
                                int(launch.get("parent_pid", 0))), cfg, run, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
