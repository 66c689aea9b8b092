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

With ``rollout.tensor_parallel_size`` = tp > 1 the ranks form engine groups of tp consecutive ranks (rank ``r`` in
group ``r // tp``, its lead rank ``tp * (r // tp)``), each group one vLLM engine sharded tp ways (vLLM's
``external_launcher``: its tensor-parallel groups are the same consecutive ranks, ``initialize_model_parallel``
laying the world out as ``[-1, dp, pp, pcp, tp]``: vllm 0.32, ``distributed/parallel_state.py``). The prompts are
dealt over the groups, and every rank of a group runs the group's share: vLLM's SPMD contract (every rank of a
tensor-parallel engine makes the same calls with the same requests, its scheduler deterministic). The lead answers
the generations; the others answer a digest of theirs, which rank 0 compares with the lead's (a group whose ranks
sampled different tokens fails the call naming it).

A rank whose share fails answers the error instead of generations, so no rank is left waiting in the gather; rank
0 raises it, naming the rank, and still ends the followers (:meth:`RankEngines.end` in a ``finally``). (Within a
tensor-parallel group a rank failing inside vLLM's own collectives leaves the others of its group waiting there, as
in any SPMD engine: that is vLLM's to end.)
"""

from __future__ import annotations

import hashlib
import heapq
import pickle
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


def engine_groups(world: int, tp: int) -> List[List[int]]:
    """The ranks of each engine group: ``world // tp`` groups of ``tp`` consecutive ranks (vLLM's tensor-parallel
    groups under ``external_launcher``); a :class:`ValueError` if ``tp`` does not divide ``world``."""
    if tp < 1 or world % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} must divide the actor's {world} ranks into engine groups")
    return [list(range(g * tp, (g + 1) * tp)) for g in range(world // tp)]


def digest(answer: Any) -> str:
    """A short fingerprint of a share's answers (a group's non-lead ranks send it instead of the answers)."""
    return hashlib.sha256(pickle.dumps(answer)).hexdigest()[:16]


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


def _answer(engine, message: tuple, rank: int, tp: int) -> Any:
    """What ``rank`` sends back for a dealt call: its group's share's answers (the lead), or their digest."""
    op, items, shares, args = message
    answer = _run(engine, op, items, shares[rank // tp], args)
    return answer if rank % tp == 0 or isinstance(answer, RankError) else Digest(digest(answer))


class RankError:
    """A rank's failed share, as the gather carries it."""

    def __init__(self, text: str):
        self.text = text


class Digest:
    """A non-lead rank's answers to its group's share, as their :func:`digest`."""

    def __init__(self, value: str):
        self.value = value


def _broadcast(message: Any, group) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _gather(answer: Any, rank: int, world: int, group) -> Optional[List[Any]]:
    answers = [None] * world if rank == 0 else None
    dist.gather_object(answer, answers, dst=0, group=group)
    return answers


def group_answers(answers: List[Any], tp: int, op: str) -> List[Any]:
    """Each engine group's answers from every rank's (``answers[r]``: rank ``r``'s): the lead's, once every rank of
    the group answered the same; a :class:`RuntimeError` naming the first rank that failed, or the first group whose
    ranks disagree."""
    failed = [(rank, a.text) for rank, a in enumerate(answers) if isinstance(a, RankError)]
    if failed:
        raise RuntimeError(f"the engine of actor rank {failed[0][0]} failed its share of a {op} call: "
                           f"{failed[0][1]}")
    leads = answers[::tp]
    for g, lead in enumerate(leads):
        others = [r for r in range(g * tp + 1, (g + 1) * tp) if answers[r].value != digest(lead)]
        if others:
            raise RuntimeError(f"the ranks of engine group {g} (actor ranks {g * tp}-{(g + 1) * tp - 1}) answered a "
                               f"{op} call differently: rank {others[0]} against its lead {g * tp} (a tensor-parallel "
                               f"engine's ranks must sample alike)")
    return leads


class RankEngines:
    """Rank 0's engine for a stage colocated on the trainer's ranks (see the module docstring); ``group``: a gloo
    group of all ranks (the requests are small Python objects); ``tp``: the ranks of an engine group."""

    def __init__(self, engine, world: int, group=None, tp: int = 1):
        self.engine, self.world, self.group, self.tp = engine, world, group, tp
        self.groups = len(engine_groups(world, tp))
        self.stats = engine.stats  # rank 0's; the probe's gap after a weight change is in its ``extra``

    def _call(self, op: str, items: List[Any], cost: Sequence[int], *args: Any) -> List[Any]:
        shares = deal_by_length(cost, self.groups)
        message = (op, items, shares, args)
        if self.world > 1:
            _broadcast(message, self.group)
        answers = [_answer(self.engine, message, 0, self.tp)]
        if self.world > 1:
            answers = _gather(answers[0], 0, self.world, self.group)
        out: List[Any] = [None] * len(items)
        for share, answer in zip(shares, group_answers(answers, self.tp, op)):
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


def follow(engine, rank: int, world: int, group=None, tp: int = 1) -> int:
    """A rank other than 0 during a colocated stage: its group's share of each call rank 0 deals, until rank 0 ends
    the stage; how many calls it served."""
    calls = 0
    while True:
        message = _broadcast(None, group)
        if message is None:
            return calls
        if message[0] not in OPS:
            raise ValueError(f"unknown engine call {message[0]!r} dealt to the ranks")
        _gather(_answer(engine, message, rank, tp), rank, world, group)
        calls += 1
