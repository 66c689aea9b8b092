"""Episodes at their own pace (``rollout.episode_pace``) against lockstep, on engines whose turns are a function of
their seed: the same seeds give the same episodes either way; per episode, a turn that ends leaves the engine at
once and its environment steps while the other episodes generate; the option is refused where the engine cannot
stream, before any model loads."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from models.config.io import load_config
from models.config.checks import ConfigError
from models.engines.base import Generation, SamplingSpec, sample_seed, stream_seed
from models.engines.vllm_steps import Sample
from models.environments.episodes import Environment, EpisodeLimits, Step, run_episodes, streams
from models.environments.tools import HermesParser

WORDS = ("yes", "no", "maybe so", "one two three", "ok")


def turn_tokens(tok, seed: int) -> list:
    """What a turn seeded ``seed`` samples: a few words and the end of the turn; its length varies with the seed."""
    return tok(WORDS[seed % len(WORDS)], add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(
        "<|im_end|>")]


class LockstepEngine:
    """Seeded turns, one batched call per turn (sample ``j`` of prompt ``i`` seeded as the engines seed it)."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def generate(self, prompts, spec, first_index=0):
        self.calls.append(len(prompts))
        out = []
        for i, _ in enumerate(prompts):
            toks = turn_tokens(self.tok, sample_seed(spec.seed, first_index + i, 0))
            out.append([Generation(toks, [-0.25] * len(toks), True)])
        return out


class StreamingEngine(LockstepEngine):
    """The same turns as requests of a step loop: a request takes ``1 + seed % 3`` steps; each step finishes the
    requests whose steps are done. Records the requests in the engine at each step."""

    def __init__(self, tok):
        super().__init__(tok)
        self.in_flight, self.closed = [], 0

    class Loop:
        def __init__(self):
            self.samples, self.left, self.suspended = [], {}, False

        def add(self, samples):
            self.samples += samples
            self.left.update({id(s): 1 + s.seed % 3 for s in samples})

        def forget(self, samples):
            gone = {id(s) for s in samples}
            self.samples = [s for s in self.samples if id(s) not in gone]

        def resume(self):
            pass

    def stream(self):
        return self.Loop()

    def stream_samples(self, prompts, spec, first_index):
        return [Sample(list(p), sample_seed(spec.seed, first_index + i, 0)) for i, p in enumerate(prompts)]

    def stream_open(self, loop):
        return True

    def stream_step(self, loop, version):
        running = [s for s in loop.samples if not s.done]
        self.in_flight.append(len(running))
        done = []
        for s in running:
            loop.left[id(s)] -= 1
            if loop.left[id(s)] == 0:
                s.tokens = turn_tokens(self.tok, s.seed)
                s.logprobs, s.done, s.ended = [-0.25] * len(s.tokens), True, True
                done.append(s)
        return done

    def close_stream(self, loop):
        self.closed += 1


class TalkEnv(Environment):
    """A user turn after every assistant turn; done after ``row["turns"]`` turns, reward = turns."""

    def step(self, assistant, tool_results):
        self.turns = getattr(self, "turns", 0) + 1
        return Step(messages=[{"role": "user", "content": f"Go on ({self.turns})."}], reward=1.0,
                    done=self.turns == int(self.row.get("turns", 3)))


@pytest.fixture(scope="module")
def tok(qwen2_chat_dir):
    return AutoTokenizer.from_pretrained(qwen2_chat_dir)


def episodes(engine, tok, rows, pace: str, limits=None):
    spec = SamplingSpec(temperature=1.0, max_new_tokens=12, seed=11)
    limits = limits or EpisodeLimits(max_turns=5, max_episode_tokens=200, pace=pace)
    with ThreadPoolExecutor(2) as pool:
        return run_episodes(engine, tok, [TalkEnv(r) for r in rows], spec, limits, HermesParser(), pool)


def as_rows(eps):
    return [(ep.prompt_ids, ep.response_ids, ep.loss_mask, ep.logprobs, ep.turns, ep.done, ep.reward) for ep in eps]


def test_per_episode_gives_lockstep_episodes_and_turns_leave_the_engine_as_they_end(tok):
    rows = [{"prompt": f"Say {w}."} for w in ("hi", "yes", "no", "so")]
    lock, stream = LockstepEngine(tok), StreamingEngine(tok)
    assert not streams(lock) and streams(stream)
    expected = episodes(lock, tok, rows, "auto")  # auto: lockstep on an engine that does not stream
    assert lock.calls == [4, 4, 4]
    got = episodes(stream, tok, rows, "auto")  # auto: per episode where it streams
    assert stream.calls == [] and stream.closed == 1
    assert as_rows(got) == as_rows(expected)
    assert len({len(ep.response_ids) for ep in got}) > 1  # the turns' lengths (and steps) differ by seed
    # never more than one request per episode, and fewer once some episodes' turns ended before others'
    assert max(stream.in_flight) == 4 and min(stream.in_flight) < 4
    assert episodes(StreamingEngine(tok), tok, rows, "lockstep")[0].response_ids == expected[0].response_ids


def test_an_episode_that_ends_early_frees_its_place_and_the_others_go_on(tok):
    """Episodes of 1, 2 and 4 turns: each ends when its environment says so, per episode as in lockstep (turn
    counts, rewards, masks); the first turn of each is the same tokens on both."""
    rows = [{"prompt": "One.", "turns": 1}, {"prompt": "Two.", "turns": 2}, {"prompt": "Four.", "turns": 4}]
    lock, stream = episodes(LockstepEngine(tok), tok, rows, "lockstep"), episodes(StreamingEngine(tok), tok, rows,
                                                                                   "episode")
    assert [(ep.turns, ep.done, ep.reward) for ep in stream] == [(1, True, 1.0), (2, True, 2.0), (4, True, 4.0)]
    assert [(ep.turns, ep.done, ep.reward) for ep in lock] == [(1, True, 1.0), (2, True, 2.0), (4, True, 4.0)]
    for a, b in zip(stream, lock):
        first = b.loss_mask.index(False) if False in b.loss_mask else len(b.loss_mask)  # the first turn
        assert a.response_ids[:first] == b.response_ids[:first]
    # per episode, turn t of episode k is seeded sample_seed(stream_seed(seed, t), k, 0) whatever ended before it
    for k, ep in enumerate(stream):
        turns = [[t for t, m in group] for sampled, group in
                 itertools.groupby(zip(ep.response_ids, ep.loss_mask), key=lambda x: x[1]) if sampled]
        assert turns == [turn_tokens(tok, sample_seed(stream_seed(11, t), k, 0)) for t in range(ep.turns)]
    assert stream[2].response_ids != lock[2].response_ids  # lockstep seeds by position among the active ones


class WaitingEnv(TalkEnv):
    """The ``slow`` episode's first step waits for the ``fast`` one to have finished its third turn (at most
    ``wait_s``): possible only when an environment's step overlaps the other episodes' turns."""

    wait_s = 5.0
    third_turn = threading.Event()
    overlapped: list = []

    def step(self, assistant, tool_results):
        out = super().step(assistant, tool_results)
        if self.row["role"] == "slow" and self.turns == 1:
            WaitingEnv.overlapped.append(WaitingEnv.third_turn.wait(self.wait_s))
        if self.row["role"] == "fast" and self.turns == 3:
            WaitingEnv.third_turn.set()
        return out


@pytest.mark.parametrize("pace, overlaps", [("episode", True), ("lockstep", False)])
def test_an_environment_step_overlaps_the_other_episodes_turns(tok, pace, overlaps):
    WaitingEnv.third_turn.clear()
    WaitingEnv.overlapped = []
    WaitingEnv.wait_s = 5.0 if overlaps else 0.5  # lockstep: the wait times out (the fast episode waits on it)
    spec = SamplingSpec(temperature=1.0, max_new_tokens=12, seed=11)
    envs = [WaitingEnv({"prompt": "Slow.", "role": "slow", "turns": 2}),
            WaitingEnv({"prompt": "Fast.", "role": "fast", "turns": 4})]
    with ThreadPoolExecutor(2) as pool:
        eps = run_episodes(StreamingEngine(tok), tok, envs, spec,
                           EpisodeLimits(max_turns=5, max_episode_tokens=200, pace=pace), HermesParser(), pool)
    assert WaitingEnv.overlapped == [overlaps]
    assert [(ep.turns, ep.done) for ep in eps] == [(2, True), (4, True)]


def test_per_episode_is_refused_where_the_engine_cannot_stream(tok):
    with pytest.raises(ValueError, match=r"rollout.episode_pace=episode needs an engine that streams requests .*"
                                         r"not LockstepEngine"):
        episodes(LockstepEngine(tok), tok, [{"prompt": "Hi."}], "episode")
    with pytest.raises(ValueError, match=r"rollout.episode_pace='steady': one of auto, episode, lockstep"):
        episodes(LockstepEngine(tok), tok, [{"prompt": "Hi."}], "steady",
                 EpisodeLimits(max_turns=2, max_episode_tokens=50, pace="steady"))


@pytest.mark.parametrize("overrides, why", [
    (["rollout.engine=hf"], "rollout.engine=hf: the HF engine runs lockstep"),
    (["rollout.data_parallel_size=2"], "rollout.data_parallel_size=2: replicas take one batch per call"),
    (["run.resident=true", "run.resident_layout=colocated"], "with run.resident_layout=colocated"),
])
def test_the_config_refuses_per_episode_where_no_engine_streams(overrides, why):
    base = ["rollout.environment=models.demos.tool_tasks:ArithmeticEnv", "rollout.episode_pace=episode"]
    with pytest.raises(ConfigError, match=why.replace(".", r"\.")):
        load_config("configs/tiny_grpo.yaml", base + overrides)
    assert load_config("configs/tiny_grpo.yaml", base).rollout.episode_pace == "episode"
