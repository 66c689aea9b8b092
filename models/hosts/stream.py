"""The asynchronous sampler's units as requests of one vLLM step loop (continuous batching): the engine's batch
kept full instead of one synchronous ``generate`` per unit of :data:`~models.hosts.producer.UNIT_PROMPTS` prompts,
whose sequences (16-32) wait for the unit's longest while vLLM could run hundreds at once.

:class:`Streamer` admits the producer's next unit whenever fewer than vLLM's ``max_num_seqs`` requests are under
way (``rollout.vllm_max_num_seqs``) and the unit may start (its draw at most k versions ahead of the weights
served, :meth:`~models.hosts.producer.Producer.may_start_at`), steps the engine once, and hands every unit whose
samples are all done to the buffer as it finishes; the staleness accounting stays the unit's, exact:

- without partial rollouts a unit's tokens are all the version served when it was admitted: an op waiting for the
  engine (a push) stops admissions, the units under way finish, then the op runs (the longest a push waits is the
  units under way, as it waited for one unit before);
- with partial rollouts the op runs between two steps: the requests under way are suspended and submitted again
  afterwards (:mod:`models.engines.vllm_steps`), each token tagged with the version whose weights computed it.

A unit given up (a push failed half-way, the engine restarted or replaced under it) goes back to the front of the
queue and is sampled again; one admitted before the run moved to another iteration (``Producer.epoch``) is
dropped when it finishes.

With an environment (``rollout.environment``), :class:`EpisodeStreamer` does the same with units of multi-turn
episodes: each unit a group of an :class:`~models.environments.episode_loop.EpisodeLoop`, admitted while fewer than
``max_num_seqs`` episodes are under way, so the episodes of several units overlap (their turns, tool calls and
environment steps) instead of a unit waiting for the one before. A unit's episodes are all sampled under the version
served when it was admitted: an op waiting for the engine stops admissions and runs once the units under way end.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, List, Tuple

from models.engines.rollout import encode_prompts, rollout_columns
from models.engines.vllm_steps import Sample, generations
from models.faults import slow_engine


class Flight:
    """A unit under way: prompts ``start`` … ``end − 1`` of draw ``draw``, admitted at ``version``."""

    def __init__(self, draw: int, start: int, end: int, version: int, epoch: int, d: Any, tokens, samples):
        self.draw, self.start, self.end, self.version, self.epoch = draw, start, end, version, epoch
        self.d, self.tokens, self.samples = d, tokens, samples
        self.t0 = time.perf_counter()

    def done(self) -> bool:
        return all(s.done for s in self.samples)


class Streamer:
    """The producer's (``producer``) units on ``engine`` (a :class:`~models.engines.VLLMEngine`), one step loop."""

    def __init__(self, producer, engine):
        self.p, self.engine = producer, engine
        self.loop = engine.stream()
        self.target = engine.max_num_seqs()
        self.flights: List[Flight] = []

    def run(self) -> None:
        """Until the producer stops or the engine it serves is another (the units under way queued again)."""
        p = self.p
        try:
            while True:
                with p.cond:
                    t0 = time.monotonic()
                    ready = p.cond.wait_for(lambda: p.stopped or bool(self.flights) or p.may_start(), timeout=1.0)
                    p.idle_s += time.monotonic() - t0
                    if p.stopped:
                        return
                if ready and not self._turn():
                    return
        finally:
            self._requeue()
            self._close()

    def _close(self) -> None:
        self.engine.close_stream(self.loop)

    def _turn(self) -> bool:
        """The engine held: admit units and step while any is under way; without partial rollouts an op waiting ends
        the turn once the units under way are done. False: the engine is no longer this streamer's."""
        p = self.p
        with p.turns.unit():
            engine, version = p.current()
            if engine is not self.engine or not engine.stream_open(self.loop):
                return False
            self.loop.resume()  # an op used the engine since the last turn (nothing under way then)
            while True:
                if not (p.turns.waiting and not p.partial):
                    self._admit(version)
                if not self.flights:
                    return True
                p.count_step(self.loop.in_flight, self.target)
                self._finish(engine.stream_step(self.loop, version))
                if p.stopped:
                    return True
                if p.turns.waiting and p.partial:
                    p.turns.give_way()  # the op runs; the engine suspends the requests under way first
                    engine, version = p.current()
                    if version < 0 or engine is not self.engine or not engine.stream_open(self.loop):
                        self._requeue()  # a push failed half-way, or another engine: sampled again
                        return engine is self.engine and engine.stream_open(self.loop)
                    self.loop.resume()

    def _claims(self, version: int) -> Iterator[Tuple[int, int, int, int, Any]]:
        """Units ``(draw, start, end, epoch, the draw)`` taken off the producer's queue while fewer than ``target``
        requests (:meth:`_in_flight`) are under way and the next may start at ``version``."""
        p = self.p
        while self._in_flight() < self.target:
            with p.cond:
                if p.stopped or not p.may_start_at(version):
                    return
                draw, start, end = p.claim()
                epoch = p.epoch
            yield draw, start, end, epoch, p.draw(draw)

    def _in_flight(self) -> int:
        return self.loop.in_flight

    def _admit(self, version: int) -> None:
        """Units while fewer than ``target`` requests are under way and the next may start at ``version``."""
        p = self.p
        for draw, start, end, epoch, d in self._claims(version):
            tokens = encode_prompts(p.tokenizer, d.data.prompts[start:end], add_special_tokens=not d.data.chat)
            samples: List[Sample] = self.engine.stream_samples(tokens, d.spec, start)
            self.loop.add(samples)
            self.flights.append(Flight(draw, start, end, version, epoch, d, tokens, samples))

    def _finish(self, finished: List[Sample]) -> None:
        """The units whose samples are all done, to the producer's buffer."""
        if not finished:
            return
        done = [f for f in self.flights if f.done()]
        self.flights = [f for f in self.flights if not f.done()]
        for f in done:
            n, prompts = f.d.spec.n, f.d.data.prompts[f.start:f.end]
            gens = generations(f.samples, self.p.tokenizer, f.d.spec)
            per_prompt = [gens[i * n:(i + 1) * n] for i in range(f.end - f.start)]
            slow_engine(f.end - f.start)  # a benchmark's slower engine, as :func:`sample` has it (models/faults.py)
            cols = rollout_columns(self.p.tokenizer, prompts, f.d.prompt_ids[f.start:f.end], f.tokens, per_prompt, n,
                                   f.t0)
            versions = [s.versions for s in f.samples] if self.p.partial else None
            self.loop.forget(f.samples)
            self.p.finished(f.draw, f.start, f.end, f.version, f.epoch, cols, versions)

    def _requeue(self) -> None:
        """The units under way given up (their requests out of the engine), to be sampled again first."""
        flights, self.flights = self.flights, []
        for f in flights:
            with contextlib.suppress(Exception):  # an engine restarted under them has none of their requests
                self.loop.forget(f.samples)
        self.p.requeue([(f.draw, f.start, f.epoch) for f in flights])


class EpisodeStreamer(Streamer):
    """The producer's (``producer``, whose ``episodes`` is a :class:`~models.environments.episode_rollout.UnitEpisodes`)
    units as groups of episodes on ``engine``, one :class:`~models.environments.episode_loop.EpisodeLoop`."""

    def __init__(self, producer, engine):
        self.p, self.engine = producer, engine
        self.runner = producer.episodes.loop(engine)
        self.loop = self.runner.loop
        self.target = engine.max_num_seqs() if hasattr(engine, "max_num_seqs") else 256
        self.flights: dict = {}  # id(group) -> its Flight

    def _close(self) -> None:
        self.runner.close()

    def _turn(self) -> bool:
        """The engine held: admit units and step while any is under way; an op waiting ends the turn once the units
        under way are done. False: the engine is no longer this streamer's."""
        p = self.p
        with p.turns.unit():
            engine, version = p.current()
            if engine is not self.engine or not engine.stream_open(self.runner.loop):
                return False
            while True:
                if not p.turns.waiting:
                    self._admit(version)
                if not self.flights:
                    return True
                p.count_step(len(self.runner.in_engine), self.target)
                for group in self.runner.step(version):
                    self._finish(group)
                if p.stopped:
                    return True

    def _in_flight(self) -> int:
        return self.runner.in_flight  # episodes: in the engine, or their environments stepping

    def _admit(self, version: int) -> None:
        for draw, start, end, epoch, d in self._claims(version):
            group = self.p.episodes.group(d, start, end)
            self.flights[id(group)] = Flight(draw, start, end, version, epoch, d, None, [])
            self.runner.add(group)

    def _finish(self, group) -> None:
        f = self.flights.pop(id(group))
        cols, extra, stats = self.p.episodes.columns(group, f.d, f.start, f.end)
        self.p.finished(f.draw, f.start, f.end, f.version, f.epoch, cols, None, (extra, stats))

    def _requeue(self) -> None:
        flights, self.flights = list(self.flights.values()), {}
        with contextlib.suppress(Exception):  # an engine restarted under them has none of their requests
            self.runner.forget()
        self.p.requeue([(f.draw, f.start, f.epoch) for f in flights])
