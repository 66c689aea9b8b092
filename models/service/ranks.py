"""A trainer service's ranks (every rank of its torchrun launch runs each op, rank 0 answering): rank 0's requests
handed to the others (:class:`RankFanout`), and the ranks' agreement on each op's outcome, so that an op failing on
one rank fails the request on every rank and never leaves a rank waiting for ever in a collective the failed rank
will not enter.

After an op each rank records its outcome in the process group's store (``{n}/done/{rank}``; a failure also as
``{n}/failed``) and waits for the others'; rank 0 answers the first failure, naming its rank, else its own result,
and every rank serves the next request: a check every rank makes alike (a request for another iteration, a batch
sampled at another temperature) leaves the service serving. A rank that failed before a collective the others
are in leaves them blocked there: once a failure is recorded, a watchdog on every rank gives the others
``grace_s`` to record theirs, and a rank still inside the op then is stuck for good (no backend can take a rank
out of a collective), so the service stops: rank 0 answers the failure and the reason, each rank logs it and its
process exits (torchrun then ends the launch: services run with ``max_restarts=0``). Either way the caller has its
answer within seconds of the failure (``tests/unit/hosts/test_actor_ranks.py``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
from typing import Callable, List, Optional, Tuple

GRACE_S = 10.0
"""How long after one rank's failure the other ranks may still be inside the op before the service stops (a run's
services: ``run.resident_rank_grace_s``)."""
POLL_S = 0.05


def _group_store():
    """The store every rank of the default process group shares (its rendezvous)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class RankFanout:
    """Hands rank 0's requests to the other ranks (a gloo group: the requests are small Python objects), so every
    rank runs the same op in the same order, and settles each op's outcome across the ranks (:meth:`settle`)."""

    def __init__(self, grace_s: float = GRACE_S, log: Callable[[str], None] = print,
                 exit: Callable[[int], None] = os._exit) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.grace_s, self.log, self.exit = grace_s, log, exit
        self.count, self.server = 0, None
        self.current: Optional[int] = None  # the request this rank is running an op for
        self._stopping = threading.Lock()
        self.group = self.store = None
        if self.world > 1:  # between requests a rank waits as long as the service idles
            self.group = dist.new_group(backend="gloo", timeout=dt.timedelta(days=7))
            self.store = dist.PrefixStore("service-ranks/", _group_store())
            threading.Thread(target=self._watch, daemon=True, name="rank-watchdog").start()

    def __call__(self, request):
        if self.world == 1:
            return request
        box = [request]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def settle(self, execute: Callable[[], Tuple[int, dict]], server=None) -> Tuple[int, dict]:
        """``execute()`` (this rank's part of the op: its ``(status, reply)``), then the outcome every rank agrees
        on: rank 0's reply, or the first failure of any rank (see the module docstring)."""
        if self.world == 1:
            return execute()
        n, self.server = self.count, server
        self.count += 1
        self.current = n
        try:
            status, body = execute()
        finally:
            self.current = None
        mine = json.dumps({"rank": self.rank, "status": status, "error": body.get("error", ""),
                           "kind": body.get("kind", "")})
        if status >= 400:
            self.store.compare_set(f"{n}/failed", "", mine)  # the first failure recorded
        self.store.set(f"{n}/done/{self.rank}", mine)
        outcomes = self._wait_all(n)
        self._forget(n - 1)
        failed = [o for o in outcomes if o["status"] >= 400]
        if self.rank != 0 or status >= 400 or not failed:
            return status, body
        first = failed[0]
        return first["status"], {"error": f"rank {first['rank']}: {first['error']}", "kind": first["kind"]}

    def _wait_all(self, n: int) -> List[dict]:
        keys = [f"{n}/done/{r}" for r in range(self.world)]
        since = None
        while not self.store.check(keys):
            if since is None and self.store.check([f"{n}/failed"]):
                since = time.monotonic()
            if since is not None and time.monotonic() - since > self.grace_s:
                self._stuck(n, [r for r, key in enumerate(keys) if not self.store.check([key])])
            time.sleep(POLL_S)
        return [json.loads(self.store.get(key)) for key in keys]

    def _forget(self, n: int) -> None:
        if n >= 0:
            self.store.delete_key(f"{n}/done/{self.rank}")
            if self.rank == 0:
                self.store.delete_key(f"{n}/failed")

    def _watch(self) -> None:
        """A rank inside the op ``grace_s`` after another rank's failure is stuck in a collective."""
        seen: Tuple[int, float] = (-1, 0.0)
        while True:
            time.sleep(POLL_S * 4)
            n = self.current
            if n is None or not self.store.check([f"{n}/failed"]):
                continue
            if seen[0] != n:
                seen = (n, time.monotonic())
            elif time.monotonic() - seen[1] > self.grace_s and self.current == n:
                self._stuck(n, [self.rank])

    def _stuck(self, n: int, ranks: List[int]) -> None:
        """The service cannot go on: rank 0 answers the failure and why, every rank's process ends."""
        if not self._stopping.acquire(blocking=False):
            return
        failure = json.loads(self.store.get(f"{n}/failed"))
        reason = (f"rank {failure['rank']} failed ({failure['kind']}: {failure['error']}) while rank(s) "
                  f"{', '.join(map(str, ranks))} stayed inside the op {self.grace_s:g} s later (in a collective the "
                  f"failed rank never entered): the service stops")
        self.log(reason)
        if self.rank == 0 and self.server is not None:
            self.server.stopping = reason
            self.server.reply(500, {"error": reason, "kind": "ServiceStopped"})
            self.server.flush()
        else:
            time.sleep(2.0)  # rank 0 answers first
        self.exit(1)
