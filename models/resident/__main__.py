"""A resident service process: ``python -m models.resident {engine,actor,critic} --launch FILE``.

``FILE`` (JSON, written by :mod:`models.resident.lifecycle`, mode 0600: it holds the token) names the
run, the state the service starts from, its token and idle timeout, and the process that launched the
run. The actor and critic services may run as every rank of a ``torchrun`` launch: each rank builds its
shard, rank 0 listens and publishes the address once all ranks are ready.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.resident")
    parser.add_argument("service", choices=["engine", "actor", "critic"])
    parser.add_argument("--launch", required=True, help="the launch file written by models.resident.lifecycle")
    opts = parser.parse_args(argv)
    with open(opts.launch) as f:
        launch = json.load(f)
    from models.resident import protocol
    from models.resident.hosts import HOSTS
    from models.resident.server import RankFanout, ServiceServer, serve
    from models.training.distributed import init_distributed, shutdown_distributed

    def log(line: str) -> None:
        print(f"[{opts.service} service] {line}", file=sys.stderr, flush=True)

    info = init_distributed()
    fanout = RankFanout()
    cfg, run, state = protocol.read_args(launch)
    host = HOSTS[opts.service](cfg, run, state, info)
    server = None
    if info.is_main:
        server = ServiceServer(launch["token"], idle_timeout_s=float(launch["idle_timeout_s"]),
                               parent_pid=int(launch.get("parent_pid", 0)))
        protocol.publish(run.layout, protocol.ServiceAddress(
            opts.service, server.url, launch["token"], os.getpid(), launch["launch"],
            dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")))
        log(f"ready on {server.url} at iteration {state.iteration}")
    reason = serve(server, fanout, host.handle, log)
    log(f"stopping: {reason}")
    if server is not None:
        server.close()
    close = getattr(getattr(host, "engine", None), "close", None)
    if close is not None:
        close()
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
