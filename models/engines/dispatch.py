"""How engine replicas share a request: the chunks they take as they free up, and what one call's
dispatch did (:class:`models.engines.replicas.EngineReplicas`).

A request's prompts are cut into contiguous chunks, all of a prompt's ``n`` samples in one (a GRPO
group stays on one replica), and each chunk goes to the first replica free, so a slow replica takes
fewer prompts instead of setting the call's time with a fixed share. A chunk is one engine call,
and a call ends by draining its batch (vLLM's continuous batching refills the batch inside a call,
not across calls), so chunks are few and large first, small last: factoring (Hummel, Schonberg &
Flynn, "Factoring: a method for scheduling parallel loops", CACM 35(8), 1992) hands out rounds of one
chunk per replica, each chunk half of what is left per replica, never under an eighth of a fixed
share: about four chunks per replica in all. A very slow replica holds the call for its first chunk,
half a fixed share, where fixed shares waited for its whole share; replicas of about the same speed
end within about one small chunk of each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

MIN_CHUNK_FRACTION = 8
"""The smallest chunk is a fixed share (``count / replicas`` prompts) over this, and at least one prompt."""


def request_chunks(count: int, replicas: int) -> List[Tuple[int, int]]:
    """``(start, end)`` of the chunks of ``range(count)`` in the order they are handed out: rounds of
    ``replicas`` chunks, each ``ceil(left / (2 · replicas))`` prompts, at least
    ``ceil(count / (MIN_CHUNK_FRACTION · replicas))``; contiguous, covering ``range(count)`` once."""
    smallest = max(1, -(-count // (MIN_CHUNK_FRACTION * replicas)))
    chunks: List[Tuple[int, int]] = []
    start = 0
    while start < count:
        size = max(smallest, -(-(count - start) // (2 * replicas)))
        for _ in range(replicas):
            end = min(count, start + size)
            if end > start:
                chunks.append((start, end))
            start = end
    return chunks


@dataclass
class Dispatch:
    """One call's dispatch, per replica: prompts (or sequences) done, chunks taken, seconds from a chunk's
    send to its answer (summed); and the call's wall seconds."""

    prompts: List[int]
    chunks: List[int]
    busy_s: List[float]
    wall_s: float = 0.0

    @classmethod
    def empty(cls, replicas: int) -> "Dispatch":
        return cls([0] * replicas, [0] * replicas, [0.0] * replicas)

    def add(self, replica: int, start: int, end: int, seconds: float) -> None:
        self.prompts[replica] += end - start
        self.chunks[replica] += 1
        self.busy_s[replica] += seconds

    def fixed_shares_s(self) -> float:
        """An estimate of what the fixed contiguous shares (``count / replicas`` each) would have taken at
        the speed each replica showed here (its seconds per prompt): the slowest share's time. 0 where a
        replica did nothing (no speed to go by)."""
        count, replicas = sum(self.prompts), len(self.prompts)
        if not all(self.prompts):
            return 0.0
        return max((count // replicas + (r < count % replicas)) * busy / done
                   for r, (done, busy) in enumerate(zip(self.prompts, self.busy_s)))
