"""Asynchronous sampling in the engine service (``run.max_staleness`` k ≥ 2, docs/off_policy.md): a background
thread that keeps the engine generating the data order's prompts into a buffer of finished samples, ahead of the
trainer by at most k policy versions; an iteration's rollout takes its batch from there.

The data order is the run's (:func:`models.stages.rollout.draw_for`): iteration i trains exactly the prompts of
draw i, so every prompt of an epoch is trained once whichever finished first. The thread samples draw j in units
of :data:`UNIT_PROMPTS` prompts (GRPO groups whole: a prompt's n samples are one unit's), each with the engine's
policy version v at its start, and starts one only while ``j − v ≤ k``: draw j is trained by the actor of version
j, so each of its tokens is then at most k updates old (AReaL's ``max_head_offpolicyness``, Fu et al. 2025,
arXiv:2505.24298). A unit staler than k when taken (its oldest token: a version moved back, a restarted or reloaded
engine pushed older weights mid-unit) is dropped, counted, and its prompts sampled again; or, with
``run.stale_samples=reweight``, kept and counted, trained with the truncated importance weight like every token. Each sample is seeded by its position in its draw
(:func:`models.engines.sample_seed`), as the synchronous rollout seeds it.

New weights come between units (:class:`EngineTurns`: an op waiting for the engine goes before the next unit), so a
unit's tokens share one version; with partial rollouts (``run.partial_rollouts``) they come between two tokens
instead: the generations under way go on under the new policy (the HF engine keeps the KV cache of their earlier
tokens; vLLM recomputes it with the new weights, :mod:`models.engines.vllm_steps`), each token tagged with the
version whose weights computed its logits.

What survives a crash: nothing of the buffer needs to. A resumed run's engine starts producing at the resume point
with the resumed actor; the samples that were finished but not taken, or in flight, were never trained, and their
prompts are sampled again for the iterations that train them (no prompt lost, none trained twice). Results after a
resume are not bit-identical to an uninterrupted run: which version drew a unit depends on timing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from models.engines.base import engine_thread
from models.engines.rollout import RolloutColumns, encode_prompts, rollout_columns, sample
from models.faults import slow_engine

log = logging.getLogger(__name__)

UNIT_PROMPTS = 4
"""Prompts per unit of generation: the longest a weight push waits for the engine is one unit's sampling."""


class _NoWeights(Exception):
    """The engine serves no actor (a push failed half-way through a unit)."""


class EngineTurns:
    """The engine, one user at a time: an op of the service (weights, evaluate, load) waits for the unit under
    way and goes before the producer's next one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._waiting = 0

    @contextlib.contextmanager
    def op(self):
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._busy)
            self._waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            self._release()

    @contextlib.contextmanager
    def unit(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._busy and not self._waiting)
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def give_way(self) -> None:
        """Inside a unit (partial rollouts, between two tokens): let the ops waiting for the engine run now."""
        with self._cond:
            if not self._waiting:
                return
            self._busy = False
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._busy and not self._waiting)
            self._busy = True

    @property
    def waiting(self) -> bool:
        """Whether an op waits for the engine (the continuous sampler stops admitting, or gives way)."""
        return self._waiting > 0

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


class Unit:
    """Prompts ``start`` … ``end − 1`` of draw ``draw``, sampled by the actor of version ``version``."""

    def __init__(self, draw: int, start: int, end: int, version: int, columns: RolloutColumns,
                 versions: Optional[List[List[int]]] = None, episodes: Optional[Tuple[Dict[str, Any], Dict]] = None):
        self.draw, self.start, self.end, self.version, self.columns = draw, start, end, version, columns
        self.versions = versions  # per sample, per token (partial rollouts); None: all ``version``
        self.episodes = episodes  # multi-turn: the episode columns and ``episode/*`` metrics of its samples
        self.reweighted = False  # counted as staler than k and kept (run.stale_samples=reweight)

    def token_versions(self) -> List[List[int]]:
        if self.versions is not None:
            return self.versions
        return [[self.version] * len(r) for r in self.columns.response_tokens]

    def oldest(self) -> int:
        """The oldest version among its tokens (``version`` if it has none)."""
        return min((v for vs in self.token_versions() for v in vs), default=self.version)


class Producer:
    """The background sampler of one engine service. ``current()`` gives the engine and the version it serves
    (-1: none, while weights load); ``draw(j)`` the :class:`~models.stages.rollout.Draw` of iteration j;
    ``tokenizer`` encodes its prompts; sampling stops after iteration ``stop − 1``; ``stale``: what becomes of a
    unit staler than k when taken (``run.stale_samples``: ``drop`` or ``reweight``). ``episodes``
    (``rollout.environment``): ``(engine, draw, start, end) -> (columns, episode columns, episode/* metrics)``, a
    unit's prompts as multi-turn episodes (:class:`~models.environments.episode_rollout.UnitEpisodes`), sampled
    whole under one version: a push waits for the unit's episodes, none of which sees two policies; on an engine
    that streams, units' episodes overlap in one step loop (:class:`~models.hosts.stream.EpisodeStreamer`).
    ``counts``: the engine's prompt counts before the first unit (:func:`models.stages.rollout.prompt_counts`),
    whence the first batch's ``rollout/prefix_cache_hit_rate``."""

    def __init__(self, k: int, start: int, stop: int, current: Callable[[], Tuple[object, int]], draw, tokenizer,
                 turns: EngineTurns, partial: bool = False, stale: str = "drop",
                 episodes: Optional[Callable[..., Tuple[RolloutColumns, Dict[str, Any], Dict[str, float]]]] = None,
                 counts: Optional[Tuple[Any, int, int]] = None):
        self.k, self.stop, self.current, self.draw, self.turns = k, stop, current, draw, turns
        self.tokenizer = tokenizer
        self.partial = partial  # new weights between two tokens (the engine's generate_versions)
        self.cond = threading.Condition()
        self.units: Dict[int, List[Unit]] = {}
        self.todo: List[Tuple[int, int]] = []  # (draw, prompt position) of units to sample again, first
        self.next = (start, 0)
        self.expect = start  # the iteration whose batch the next take is for
        self.stale = stale
        self.episodes = episodes
        self.counts = counts  # the engine's prompt counts at the last take, or at the start (prefix cache hits)
        self.dropped = self.reweighted = 0
        self.idle_s, self.window_t0 = 0.0, time.monotonic()
        self.epoch = 0  # moves when the run restarts sampling at another draw: units admitted before are not its
        self.steps = self.in_flight_sum = 0  # the continuous sampler's engine steps and requests they ran
        self.failed: Optional[BaseException] = None
        self.stopped = False
        self.thread = engine_thread(self._loop, "producer")  # at the count of the thread that made it

    def _position(self) -> Tuple[int, int]:
        return self.todo[0] if self.todo else self.next

    def _may_start(self) -> bool:
        return self.may_start()

    def may_start(self) -> bool:
        """Whether the next unit may start at the version served now (under ``cond``)."""
        return self.may_start_at(self.current()[1])

    def may_start_at(self, version: int) -> bool:
        draw, _ = self._position()
        return draw < self.stop and version >= 0 and draw - version <= self.k

    def claim(self) -> Tuple[int, int, int]:
        """The next unit ``(draw, start, end)``, taken off the queue as it starts (under ``cond``; continuous)."""
        draw, start = self._position()
        n = len(self.draw(draw).prompt_ids)
        end = min(start + UNIT_PROMPTS, n)
        if self.todo:
            self.todo.pop(0)
        else:
            self.next = (draw, end) if end < n else (draw + 1, 0)
        return draw, start, end

    def finished(self, draw: int, start: int, end: int, version: int, epoch: int, cols: RolloutColumns,
                 versions: Optional[List[List[int]]], episodes: Optional[Tuple[Dict[str, Any], Dict]] = None) -> None:
        """A unit the continuous sampler finished, to the buffer (dropped if the run moved meanwhile)."""
        with self.cond:
            if epoch == self.epoch:
                self.units.setdefault(draw, []).append(Unit(draw, start, end, version, cols, versions, episodes))
                self.cond.notify_all()

    def requeue(self, units: List[Tuple[int, int, int]]) -> None:
        """Units ``(draw, start, epoch)`` given up under way: sampled again first."""
        with self.cond:
            self.todo[:0] = sorted((d, s) for d, s, e in units if e == self.epoch)
            self.cond.notify_all()

    def count_step(self, in_flight: int, target: int) -> None:
        self.steps += 1
        self.in_flight_sum += in_flight

    def flight_stats(self) -> Dict[str, float]:
        """``async/engine_in_flight_mean``: the requests an engine step ran, on average, since the last call (the
        continuous sampler's; none for the unit by unit one)."""
        with self.cond:
            steps, total, self.steps, self.in_flight_sum = self.steps, self.in_flight_sum, 0, 0
        return {"async/engine_in_flight_mean": total / steps} if steps else {}

    def _loop(self) -> None:
        try:
            while True:
                engine = self.current()[0]
                if hasattr(engine, "stream") and (self.episodes is None or self._episodes_stream(engine)):
                    from models.hosts.stream import EpisodeStreamer, Streamer  # vLLM: continuous batching

                    (Streamer if self.episodes is None else EpisodeStreamer)(self, engine).run()
                    if self.stopped:
                        return
                    continue
                with self.cond:
                    t0 = time.monotonic()  # woken by a new version (poke), a take, or a second passing
                    ready = self.cond.wait_for(lambda: self.stopped or self._may_start(), timeout=1.0)
                    self.idle_s += time.monotonic() - t0
                    if self.stopped:
                        return
                    if not ready:
                        continue
                    draw, start = self._position()
                self._sample(draw, start)
        except BaseException as err:  # noqa: BLE001 -- the next take raises it
            log.exception("the producer stopped")
            with self.cond:
                self.failed = err
                self.cond.notify_all()

    def _episodes_stream(self, engine) -> bool:
        """Whether the units' episodes go to ``engine`` as groups of one step loop (their own pace, units
        overlapping: :class:`~models.hosts.stream.EpisodeStreamer`), or a unit at a time."""
        streams = getattr(self.episodes, "streams", None)
        return callable(streams) and streams(engine)

    def _sample(self, draw: int, start: int) -> None:
        d = self.draw(draw)
        end = min(start + UNIT_PROMPTS, len(d.prompt_ids))
        versions = episodes = None
        with self.turns.unit():
            engine, version = self.current()
            if version < 0 or draw - version > self.k:
                return  # the weights moved while it waited: decide again
            prompts, ids = d.data.prompts[start:end], d.prompt_ids[start:end]
            if self.episodes is not None:  # each episode at its own pace within the unit (vLLM), all at ``version``
                cols, extra, stats = self.episodes(engine, d, start, end)
                episodes = (extra, stats)
            elif not self.partial:
                cols = sample(engine, self.tokenizer, prompts, ids, d.spec, d.data.chat, first_index=start)
            else:
                try:
                    cols, versions = self._sample_partial(engine, version, prompts, ids, d, start)
                except _NoWeights:
                    return  # a push failed mid-unit: sampled again once the engine serves an actor
        with self.cond:
            if self.todo and self.todo[0] == (draw, start):
                self.todo.pop(0)
            elif self.next == (draw, start):
                self.next = (draw, end) if end < len(d.prompt_ids) else (draw + 1, 0)
            else:
                return  # restarted at another draw meanwhile: not this unit's
            self.units.setdefault(draw, []).append(Unit(draw, start, end, version, cols, versions, episodes))
            self.cond.notify_all()

    def _sample_partial(self, engine, version: int, prompts, ids, d, start: int):
        """The unit sampled step by step, giving way to pushes between two tokens (partial rollouts)."""
        t0 = time.perf_counter()
        tokens = encode_prompts(self.tokenizer, prompts, add_special_tokens=not d.data.chat)
        gens, versions = engine.generate_versions(tokens, d.spec, start, version, self._between_steps)
        slow_engine(len(prompts))  # a benchmark's slower engine, as :func:`sample` has it (models/faults.py)
        return rollout_columns(self.tokenizer, prompts, ids, tokens, gens, d.spec.n, t0), versions

    def _between_steps(self) -> int:
        self.turns.give_way()
        version = self.current()[1]
        if version < 0:
            raise _NoWeights()
        return version

    def poke(self) -> None:
        """The engine's version changed: the thread decides again."""
        with self.cond:
            self.cond.notify_all()

    def take(self, iteration: int, timeout_s: float) -> Tuple[List[Unit], Dict[str, float]]:
        """The units of draw ``iteration`` in prompt order once all are sampled, none staler than k for the actor
        of version ``iteration``; stale ones dropped, counted and sampled again. Also the window's
        ``(window_s, engine_idle_s, trainer_wait_s, dropped, reweighted)``."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            t0 = time.monotonic()
            if iteration != self.expect:  # the run moved elsewhere (a retried or skipped iteration): start there
                self.units, self.todo, self.next = {}, [], (iteration, 0)
                self.epoch += 1
                self.cond.notify_all()
            while True:
                self._drop_stale(iteration)
                units = sorted(self.units.get(iteration, []), key=lambda u: u.start)
                if self.failed is not None:
                    raise RuntimeError(f"the engine's producer failed: {self.failed}") from self.failed
                if units and units[-1].end == len(self.draw(iteration).prompt_ids) and \
                        all(a.end == b.start for a, b in zip(units, units[1:])) and units[0].start == 0:
                    break
                if not self.cond.wait(timeout=max(deadline - time.monotonic(), 0.0)) and \
                        time.monotonic() >= deadline:
                    raise TimeoutError(f"the batch of iteration {iteration} was not sampled in {timeout_s:.0f} s")
            for old in [d for d in self.units if d <= iteration]:
                del self.units[old]
            self.expect = iteration + 1
            now = time.monotonic()
            window = (now - self.window_t0, self.idle_s, now - t0, self.dropped, self.reweighted)
            self.window_t0, self.idle_s, self.dropped, self.reweighted = now, 0.0, 0, 0
            self.cond.notify_all()
        return units, dict(zip(("window_s", "engine_idle_s", "trainer_wait_s", "dropped", "reweighted"), window))

    def _drop_stale(self, iteration: int) -> None:
        """Units of draw ``iteration`` holding a token more than k versions before it: dropped and queued again,
        or (``stale="reweight"``) kept and counted once."""
        kept = []
        for unit in self.units.get(iteration, []):
            if iteration - unit.oldest() > self.k and self.stale == "reweight":
                if not unit.reweighted:
                    unit.reweighted = True
                    self.reweighted += len(unit.columns.response_tokens)
                    log.warning("kept prompts %d-%d of iteration %d: tokens of version %d, over %d behind, "
                                "trained with the truncated importance weight", unit.start, unit.end - 1,
                                iteration, unit.oldest(), self.k)
                kept.append(unit)
            elif iteration - unit.oldest() > self.k:
                self.dropped += len(unit.columns.response_tokens)
                self.todo.append((unit.draw, unit.start))
                log.warning("dropped prompts %d-%d of iteration %d: sampled by version %d, over %d behind",
                            unit.start, unit.end - 1, iteration, unit.oldest(), self.k)
            else:
                kept.append(unit)
        self.units[iteration] = kept

    def snapshot(self) -> Dict[str, Any]:
        """The buffer as a batch records it: the prompts finished but not taken (``prompt_id`` ranges, first and
        last, one per unit), and where sampling stands (draw, prompt). A resume samples them again from the resume
        point: none of them was trained."""
        with self.cond:
            finished = sorted([int(u.columns.prompt_id[0]), int(u.columns.prompt_id[-1])]
                              for units in self.units.values() for u in units)
            return {"taken_through": self.expect - 1, "finished_not_taken": finished,
                    "sampling": list(self._position())}

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout=60)

