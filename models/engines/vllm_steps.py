"""vLLM driven step by step, for partial rollouts (``run.partial_rollouts``, docs/off_policy.md): the samples of
:meth:`models.engines.VLLMEngine.generate_versions` go in as requests of vLLM's engine (``llm_engine.add_request``)
and advance one ``llm_engine.step()`` at a time, as vLLM's own ``LLM._run_engine`` drives them; between two steps
the caller's ``between_steps()`` may let the service's ops use the engine (a weight push, an evaluation).

Anything else using the engine first *suspends* the loop (:meth:`StepLoop.suspend`, called by the engine's
``_llm()``): the requests under way are aborted, their tokens so far kept. When ``between_steps()`` returns, each
unfinished sample is submitted again with its tokens appended to its prompt (``max_tokens`` and ``min_tokens``
less what it has), so the keys and values of its earlier tokens are recomputed by the weights served from then
on. Its next tokens' log-probs are then exactly the new policy's, π_new(y_t | x, y_<t), the π_sampler that
truncated importance sampling (``actor.tis_cap``) divides by. AReaL keeps the old weights' KV cache instead; vLLM
cannot (it resets its prefix cache only once no block is in use, so blocks of the old weights would also serve
later requests), and the kept cache's log-probs belong to no policy. The cost: one prefill of prompt + tokens so
far per unfinished sample and suspension.

Each token is tagged with the version whose weights computed its logits: the version served when the step that
drew it ran. A resubmitted sample draws from a new stream, seeded ``stream_seed(seed, tokens so far)``; without a
suspension every sample is the one request ``generate`` makes (same seed, same stop ids and limits), so the loop's
tokens and log-probs are ``generate``'s. With a suspension a stop string that straddles the resubmission is found
afterwards (:func:`cut_at_stop_string`), as vLLM checks only the text a request generated itself.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from models.engines.base import Generation, SamplingSpec, stream_seed

_LOOPS = itertools.count()


@dataclass
class Sample:
    """One sample of the loop: its prompt, seed, and what it has drawn so far."""

    prompt: List[int]
    seed: int
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    resubmitted: bool = False
    done: bool = False
    ended: bool = False  # a stop token or string, not the length limit
    params: Optional[Callable[["Sample"], Any]] = field(default=None, repr=False, compare=False)
    """Its ``SamplingParams`` for what it still has to draw (None: the loop's)."""


def cut_at_stop_string(tokenizer, tokens: List[int], stop_strings: Sequence[str]) -> int:
    """The number of tokens up to and including the first whose text completes a stop string (``len(tokens)``
    if none does): vLLM's stop on strings, applied afterwards to a sample submitted twice."""
    if stop_strings:
        for t in range(1, len(tokens) + 1):
            text, before = tokenizer.decode(tokens[:t]), tokenizer.decode(tokens[:t - 1])
            if any(s in text and s not in before for s in stop_strings):
                return t
    return len(tokens)


def count_prompt(stats, prompt_tokens: int, cached_tokens: Optional[int]) -> None:
    """A finished request's prompt tokens and those vLLM's prefix cache served, added to ``stats`` (if any)."""
    if stats is not None:
        stats.prompt_tokens += prompt_tokens
        stats.cached_prompt_tokens += int(cached_tokens or 0)


class StepLoop:
    """The samples of one ``generate_versions`` call in the ``llm``'s engine; ``params(sample)`` gives a
    sample's ``SamplingParams`` for what it still has to draw."""

    def __init__(self, llm, samples: List[Sample], params: Callable[[Sample], Any], lora=None, stats=None):
        self.llm, self.samples, self.params, self.lora, self.stats = llm, samples, params, lora, stats
        self.running: Dict[str, Sample] = {}  # vLLM request id -> sample
        self._prompt_len: Dict[str, int] = {}  # vLLM request id -> its prompt's tokens (for ``stats``)
        self.suspended = False
        self._ids = itertools.count()
        self._tag = f"steps-{next(_LOOPS)}"

    def submit(self, samples: List[Sample]) -> None:
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        for s in samples:
            params = (s.params or self.params)(s)
            params.output_kind = RequestOutputKind.DELTA  # each step's new tokens
            rid = f"{self._tag}-{next(self._ids)}"  # the outputs carry it (vLLM's internal id adds a suffix)
            self.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=s.prompt + s.tokens), params,
                                            lora_request=self.lora)
            self.running[rid] = s
            self._prompt_len[rid] = len(s.prompt) + len(s.tokens)

    def add(self, samples: List[Sample]) -> None:
        """More samples while the loop runs (continuous batching: the asynchronous producer's), submitted now."""
        if self.suspended:
            raise RuntimeError("samples added to a suspended step loop (resume it first)")
        self.samples += samples
        self.submit(samples)

    def forget(self, samples: List[Sample]) -> None:
        """Samples the caller took (done) or gave up (their requests aborted, if any are under way)."""
        ids = {id(s) for s in samples}
        gone = [rid for rid, s in self.running.items() if id(s) in ids]
        if gone:
            self.llm.llm_engine.abort_request(gone)
            for rid in gone:
                del self.running[rid]
                self._prompt_len.pop(rid, None)
        self.samples = [s for s in self.samples if id(s) not in ids]

    @property
    def in_flight(self) -> int:
        """Requests of this loop in the engine now."""
        return len(self.running)

    def suspend(self) -> None:
        """Abort the requests under way (their tokens kept): something else is about to use the engine."""
        if self.running and not self.suspended:
            self.llm.llm_engine.abort_request(list(self.running))
            self.running, self._prompt_len = {}, {}
        self.suspended = True

    def resume(self) -> None:
        """Submit again the unfinished samples of a suspension, each from its prompt and tokens so far."""
        if not self.suspended:
            return
        self.suspended = False
        todo = [s for s in self.samples if not s.done]
        for s in todo:
            s.resubmitted = True
            s.seed = stream_seed(s.seed, len(s.tokens))
        self.submit(todo)

    def step(self, version: int) -> List[Sample]:
        """One engine step; each new token tagged ``version``. The samples it finished."""
        finished = []
        for out in self.llm.llm_engine.step():
            s = self.running.get(out.request_id)
            if s is None:
                continue  # an aborted request's last output
            c = out.outputs[0]
            new = list(c.token_ids)
            s.tokens += new
            s.logprobs += [float(step[t].logprob) for step, t in zip(c.logprobs or [], new)]
            s.versions += [version] * len(new)
            if out.finished:
                s.done, s.ended = True, c.finish_reason == "stop"
                del self.running[out.request_id]
                count_prompt(self.stats, self._prompt_len.pop(out.request_id, 0), out.num_cached_tokens)
                finished.append(s)
        return finished

    def run(self, version: int, between_steps: Optional[Callable[[], int]]) -> int:
        """Step until every sample is done; ``between_steps()`` after each step (while any is left) returns the
        version served from then on. Returns the last version."""
        self.submit(self.samples)
        try:
            while self.running:
                self.step(version)
                if between_steps is not None and any(not s.done for s in self.samples):
                    version = between_steps()
                    self.resume()
        except BaseException:
            with contextlib.suppress(Exception):  # nothing of this call left in the engine (if it still runs)
                self.suspend()
            raise
        return version

    def generations(self, tokenizer, spec: SamplingSpec) -> List[Generation]:
        """Each sample as a :class:`Generation`, cut at a stop string a resubmission hid from vLLM."""
        return generations(self.samples, tokenizer, spec)


def generations(samples: List[Sample], tokenizer, spec: SamplingSpec) -> List[Generation]:
    """Each of ``samples`` (done) as a :class:`Generation`, cut at a stop string a resubmission hid from vLLM."""
    out = []
    for s in samples:
        keep = cut_at_stop_string(tokenizer, s.tokens, spec.stop_strings) if s.resubmitted else len(s.tokens)
        ended = s.ended or keep < len(s.tokens)
        del s.tokens[keep:], s.logprobs[keep:], s.versions[keep:]
        out.append(Generation(s.tokens, s.logprobs, ended))
    return out


RESET_WAITS_S = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8)
"""Waits before each try of :func:`reset_prefix_cache` (1.55 s in all)."""


def reset_prefix_cache(llm, waits: Optional[Sequence[float]] = None) -> None:
    """Drop every cached prefix of ``llm`` after new weights went in, or raise naming the reset.

    vLLM's ``reset_prefix_cache()`` returns False and resets nothing while a request still holds cache blocks
    (``BlockPool.reset_prefix_cache``); the next rollout would then reuse prefixes the old weights computed. The
    requests of a step loop are aborted before a push (:meth:`StepLoop.suspend`), and an engine core in
    another process frees their blocks shortly after: tried again after each of ``waits``; still False, a
    :class:`RuntimeError` fails the push (the engine is closed, as after any failed copy). ``waits``: None for
    :data:`RESET_WAITS_S`."""
    waits = RESET_WAITS_S if waits is None else waits
    for wait in waits:
        time.sleep(wait)
        if llm.reset_prefix_cache() is not False:
            return
    raise RuntimeError(f"vLLM's prefix cache reset failed {len(waits)} times in {sum(waits):.2f} s (requests still "
                       f"hold cache blocks): prefixes computed by the old weights could be served")
