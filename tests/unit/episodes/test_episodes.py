"""The episode loop on the HF engine and the Qwen2-shaped chat checkpoint: one batched generate call
per turn, rows whose ``loss_mask`` marks exactly the sampled tokens, sampler log-probs that match the
trainer's forward of the whole episode on those tokens; and the tool path (calls parsed, run, their
results rendered by the template, errors as observations, ``episode/*`` metrics) on replayed turns."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.engines.base import Generation, SamplingSpec
from models.environments.episode_rollout import sample_episodes
from models.environments.episodes import Environment, EpisodeLimits, Step, run_episodes
from models.engines.hf_engine import HFEngine
from models.demos.tool_tasks import ArithmeticEnv
from models.environments.tools import HermesParser


class TalkEnv(Environment):
    """Answers every turn with a user message; done after the third turn, reward = turns."""

    def step(self, assistant, tool_results):
        self.turns = getattr(self, "turns", 0) + 1
        return Step(messages=[{"role": "user", "content": f"Go on ({self.turns})."}], reward=1.0,
                    done=self.turns == 3)


class CountingEngine:
    """The engine, with its generate calls counted."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, spec):
        self.calls.append(len(prompts))
        return self.engine.generate(prompts, spec)


@pytest.fixture(scope="module")
def qwen(qwen2_chat_dir):
    return HFEngine(str(qwen2_chat_dir)), AutoTokenizer.from_pretrained(qwen2_chat_dir), \
        AutoModelForCausalLM.from_pretrained(qwen2_chat_dir, dtype=torch.float32).eval()


def test_turns_are_batched_and_sampled_tokens_are_scored_as_sampled(qwen):
    engine, tok, model = qwen
    # stop at any of the first half of the vocabulary: turns end after a few tokens, with a stop
    spec = SamplingSpec(temperature=1.0, max_new_tokens=12, seed=3, stop_token_ids=tuple(range(3, len(tok) // 2)))
    envs = [TalkEnv({"prompt": f"Say {w}."}) for w in ("hi", "yes", "no")]
    counting = CountingEngine(engine)
    with ThreadPoolExecutor(2) as pool:
        episodes = run_episodes(counting, tok, envs, spec, EpisodeLimits(max_turns=5, max_episode_tokens=200),
                                HermesParser(), pool)
    assert counting.calls == [3, 3, 3]  # one call per turn for all active episodes
    for ep in episodes:
        assert (ep.turns, ep.done, ep.truncated, ep.reward) == (3, True, False, 3.0)
        assert len(ep.response_ids) == len(ep.loss_mask) == len(ep.logprobs)
        assert ep.loss_mask[0] and ep.loss_mask[-1] and not all(ep.loss_mask)
        text = tok.decode(ep.prompt_ids + ep.response_ids)
        assert "<|im_start|>user\nGo on (1).<|im_end|>\n<|im_start|>assistant\n" in text
        assert "Go on (3)" not in text  # the last answer came with done: nothing appended after it
        # the trainer's forward of the whole episode scores the sampled tokens as the engine did
        seq = torch.tensor([ep.prompt_ids + ep.response_ids])
        with torch.no_grad():
            logp = model(seq).logits[0, :-1].float().log_softmax(-1).gather(-1, seq[0, 1:, None])[:, 0]
        trainer = logp[len(ep.prompt_ids) - 1:]
        mask = torch.tensor(ep.loss_mask)
        gap = (trainer[mask] - torch.tensor(ep.logprobs)[mask]).abs().max()
        assert float(gap) < 1e-3
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)


class ReplayEngine:
    """Returns scripted turns (token ids) per episode and turn; log-prob -0.5 per token."""

    def __init__(self, turns):
        self.turns, self.calls = turns, 0

    def generate(self, prompts, spec):
        self.calls += 1
        out = []
        for p in prompts:
            script = next(s for s in self.turns if s["prefix"] == p[:len(s["prefix"])])
            toks = script["turns"].pop(0)
            out.append([Generation(toks, [-0.5] * len(toks), True)])
        return out


def test_tool_calls_run_and_their_results_are_rendered(qwen):
    _, tok, _ = qwen
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    good = enc('Let me calculate.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "48213*9127"}}\n'
               '</tool_call>')
    bad = enc('<tool_call>\n{"name": "calculator", "arguments": {"expression": 48213*}}\n</tool_call>')
    rows = [{"prompt": "What is 48213 * 9127?", "answer": str(48213 * 9127), "expression": "48213*9127"},
            {"prompt": "What is 12 + 30?", "answer": "42", "expression": "12+30"}]
    from models.environments.chat_tokens import ChatTokens
    from models.environments.tools import CALCULATOR
    prefixes = [ChatTokens(tok, [CALCULATOR.schema()]).first_prompt(ArithmeticEnv(r).start()) for r in rows]
    engine = ReplayEngine([{"prefix": prefixes[0], "turns": [good, enc(rows[0]["answer"]) + [im_end]]},
                           {"prefix": prefixes[1], "turns": [bad, enc("41") + [im_end]]}])
    cols, extra, stats = sample_episodes(engine, tok, ArithmeticEnv, rows, [7, 8], SamplingSpec(max_new_tokens=64),
                                         EpisodeLimits(max_turns=4, max_episode_tokens=300), HermesParser())
    assert engine.calls == 2
    assert list(extra["episode_reward"]) == [1.0, 0.0] and list(cols.is_end) == [True, True]
    assert stats["episode/turns_mean"] == 2 and stats["episode/tool_calls_mean"] == 1
    assert stats["episode/tool_errors_mean"] == 0.5 and stats["episode/truncated_frac"] == 0
    first = json.loads(extra["episode"][0])
    assert [m["role"] for m in first] == ["system", "user", "assistant", "tool", "assistant"]
    assert first[3]["content"] == rows[0]["answer"]
    assert first[2]["tool_calls"][0]["function"]["arguments"] == {"expression": "48213*9127"}
    second = json.loads(extra["episode"][1])
    assert second[3]["content"].startswith("error: the call is not JSON")  # the model reads its mistake
    resp, mask = cols.response_tokens[0], extra["loss_mask"][0]
    assert resp[:len(good)] == good and all(mask[:len(good)])
    observation = tok.decode([t for t, m in zip(resp, mask) if not m])
    assert observation == (f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{rows[0]['answer']}\n</tool_response>"
                           "<|im_end|>\n<|im_start|>assistant\n")
    assert cols.sampler_logprobs[0] == [-0.5 if m else 0.0 for m in mask]


def test_a_first_prompt_over_the_prompt_budget_is_refused_as_its_episode_starts(qwen):
    """The engine's context is ``data.max_prompt_tokens`` + ``rollout.max_episode_tokens``: a first prompt the
    environment writes longer than its budget (set-up renders only the longest rows' beyond 256) is refused before
    any generate, naming the setting, never truncated."""
    engine, tok, _ = qwen
    envs = [TalkEnv({"prompt": "Say hi."})]
    n = len(tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False))
    counting = CountingEngine(engine)
    spec = SamplingSpec(temperature=1.0, max_new_tokens=4, seed=3)
    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(ValueError, match=rf"first prompt has {n} tokens > data\.max_prompt_tokens={n - 1} "):
            run_episodes(counting, tok, envs, spec, EpisodeLimits(1, 20, 5.0, max_prompt_tokens=n - 1), HermesParser(),
                         pool)
        assert counting.calls == []
        run_episodes(counting, tok, envs, spec, EpisodeLimits(1, 20, 5.0, max_prompt_tokens=n), HermesParser(), pool)
    assert counting.calls == [1]
