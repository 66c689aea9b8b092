"""Generation data-parallel over a trainer's ranks (``run.resident_layout=colocated``): every rank of the actor
trainer service holds its own engine, and one engine call on rank 0 runs on all of them.

Rank 0 runs the stage (the rollout, the evaluation, a multi-turn episode's turns) with a :class:`RankEngines` in
place of its engine; each ``generate`` / ``prompt_logprobs`` call deals the call's prompts over the ranks
(:func:`deal_by_length`), hands every rank its share over a gloo group, runs its own share, and puts the answers
back in prompt order. Meanwhile every other rank is in :func:`follow`, serving the shares it is handed until rank 0
says the stage is over (:meth:`RankEngines.end`). A prompt's ``n`` samples stay on one rank (a GRPO group is never
split), and each prompt is generated with its index in the whole call (``indices``), so sample ``j`` of prompt ``i``
is seeded ``sample_seed(seed, i, j)`` on whichever rank it lands: the batch is the one a single engine samples (the
same tokens where the engine's sampling is batch-invariant: the HF engine in float32).

A rank whose share fails answers the error instead of generations, so no rank is left waiting in the gather; rank
0 raises it, naming the rank, and still ends the followers (:meth:`RankEngines.end` in a ``finally``).
"""

from __future__ import annotations

import heapq
from typing import Any, List, Optional, Sequence

import torch.distributed as dist

from models.engines.base import SamplingSpec

OPS = ("generate", "prompt_logprobs")
"""The engine calls dealt over the ranks."""


def deal_by_length(costs: Sequence[int], ranks: int) -> List[List[int]]:
    """Each rank's item indices (ascending): items taken longest first, each to the rank with the least work dealt
    so far (ties: the lowest rank), so the ranks finish together: the LPT rule (Graham, "Bounds on multiprocessing
    timing anomalies", SIAM J. Appl. Math. 17(2), 1969), within 4/3 of the best split. ``costs``: an item's work,
    e.g. its prompt's tokens plus ``max_new_tokens``."""
    if ranks < 1:
        raise ValueError(f"need >= 1 rank, got {ranks}")
    load = [(0, rank) for rank in range(ranks)]  # (work dealt, rank): a heap
    shares: List[List[int]] = [[] for _ in range(ranks)]
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        work, rank = heapq.heappop(load)
        shares[rank].append(item)
        heapq.heappush(load, (work + int(costs[item]), rank))
    return [sorted(share) for share in shares]


def _run(engine, op: str, items: List[Any], share: List[int], args: tuple) -> Any:
    """This rank's part of a call: its share's answers, or the error's text (every rank joins the gather)."""
    try:
        mine = [items[i] for i in share]
        if not mine:
            return []
        if op == "generate":
            return engine.generate(mine, *args, indices=share)
        return engine.prompt_logprobs(mine)
    except Exception as err:  # noqa: BLE001 -- rank 0 raises it
        return RankError(f"{type(err).__name__}: {err}")


class RankError:
    """A rank's failed share, as the gather carries it."""

    def __init__(self, text: str):
        self.text = text


def _broadcast(message: Any, group) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _gather(answer: Any, rank: int, world: int, group) -> Optional[List[Any]]:
    answers = [None] * world if rank == 0 else None
    dist.gather_object(answer, answers, dst=0, group=group)
    return answers


class RankEngines:
    """Rank 0's engine for a stage colocated on the trainer's ranks (see the module docstring); ``group``: a gloo
    group of all ranks (the requests are small Python objects)."""

    def __init__(self, engine, world: int, group=None):
        self.engine, self.world, self.group = engine, world, group
        self.stats = engine.stats  # rank 0's; the probe's gap after a weight change is in its ``extra``

    def _call(self, op: str, items: List[Any], cost: Sequence[int], *args: Any) -> List[Any]:
        shares = deal_by_length(cost, self.world)
        if self.world > 1:
            _broadcast((op, items, shares, args), self.group)
        answers = [_run(self.engine, op, items, shares[0], args)]
        if self.world > 1:
            answers = _gather(answers[0], 0, self.world, self.group)
        failed = [(rank, a.text) for rank, a in enumerate(answers) if isinstance(a, RankError)]
        if failed:
            raise RuntimeError(f"the engine of actor rank {failed[0][0]} failed its share of a {op} call: "
                               f"{failed[0][1]}")
        out: List[Any] = [None] * len(items)
        for share, answer in zip(shares, answers):
            for i, value in zip(share, answer):
                out[i] = value
        return out

    def generate(self, prompts: List[List[int]], spec: SamplingSpec) -> List[List[Any]]:
        """``spec.n`` generations per prompt, the prompts dealt by their length plus ``max_new_tokens``."""
        return self._call("generate", prompts, [len(p) + spec.max_new_tokens for p in prompts], spec)

    def prompt_logprobs(self, sequences: List[List[int]]) -> List[List[float]]:
        return self._call("prompt_logprobs", sequences, [len(s) for s in sequences])

    def end(self) -> None:
        """The stage is over: the followers return (rank 0, once per stage, failed or not)."""
        if self.world > 1:
            _broadcast(None, self.group)


def follow(engine, rank: int, world: int, group=None) -> int:
    """A rank other than 0 during a colocated stage: its share of each call rank 0 deals, until rank 0 ends the
    stage; how many calls it served."""
    calls = 0
    while True:
        message = _broadcast(None, group)
        if message is None:
            return calls
        op, items, shares, args = message
        if op not in OPS:
            raise ValueError(f"unknown engine call {op!r} dealt to the ranks")
        _gather(_run(engine, op, items, shares[rank], args), rank, world, group)
        calls += 1
