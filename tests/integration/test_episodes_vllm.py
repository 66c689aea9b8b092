"""Engine parity on multi-turn episodes with vLLM's CPU engine on the Qwen2-shaped chat checkpoint:
the sampled tokens of every turn (each turn's stop token included) carry the log-probs the trainer's
forward of the whole episode gives them, within the probe's 1e-3 nats; each episode as its own stream of requests
(``rollout.episode_pace=auto`` on vLLM) samples the episodes one batched call per turn samples."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from models.engines import SamplingSpec
from models.environments.episodes import EpisodeLimits, run_episodes, turn_stops
from models.environments.tools import HermesParser
from tests.unit.episodes.test_episodes import TalkEnv
from tests.unit.models.hub_copies import hf_logprobs, load

pytestmark = pytest.mark.integration
TOL = 1e-3


def test_vllm_episodes_are_scored_as_sampled(qwen2_chat_dir):
    pytest.importorskip("vllm")
    from models.engines import VLLMEngine

    tok = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    spec = SamplingSpec(temperature=1.0, max_new_tokens=10, seed=5, stop_token_ids=tuple(range(3, len(tok) // 2)))
    stops = set(turn_stops(tok, HermesParser(), spec).stop_token_ids) | {tok.convert_tokens_to_ids("<|im_end|>")}
    assert tok.convert_tokens_to_ids("</tool_call>") in stops  # the end of a call stops a turn (a token here)
    engine = VLLMEngine(str(qwen2_chat_dir), max_model_len=512)
    prompts = ("Hi. " * 40, "Count.", "Go.")  # the first over one of vLLM's KV blocks (128 tokens on CPU)
    try:
        block = engine.llm.llm_engine.vllm_config.cache_config.block_size
        with ThreadPoolExecutor(2) as pool:
            episodes = run_episodes(engine, tok, [TalkEnv({"prompt": w}) for w in prompts], spec,
                                    EpisodeLimits(max_turns=4, max_episode_tokens=200), HermesParser(), pool)
            counted = (engine.stats.prompt_tokens, engine.stats.cached_prompt_tokens)
            lockstep = run_episodes(engine, tok, [TalkEnv({"prompt": w}) for w in prompts], spec,
                                    EpisodeLimits(max_turns=4, max_episode_tokens=200, pace="lockstep"),
                                    HermesParser(), pool)
    finally:
        engine.close()
    # each turn's request resent the episode's context so far: the prompt and the response up to the turn's first
    # sampled token; vLLM's prefix cache served whole blocks of them (each turn's context holds the previous turn's)
    sent = [[len(ep.prompt_ids) + t for t, (m, before) in enumerate(zip(ep.loss_mask, [False] + ep.loss_mask))
             if m and not before] for ep in episodes]
    assert counted[0] == sum(map(sum, sent)) and [len(s) for s in sent] == [3, 3, 3]
    # a fresh engine: a first turn finds nothing (the episodes share no whole block); a later turn, every whole block
    # of its context but the last token's (vLLM computes at least one), all there from the turn before
    assert counted[1] == sum((n - 1) // block * block for s in sent for n in s[1:]) > 0, (counted, block, sent)
    assert engine.stats.prompt_tokens == 2 * counted[0]  # lockstep sent the same contexts
    print("prefix cache: sent", sent, "cached", counted[1], "block", block)
    # per episode (auto on vLLM: each episode its own requests in the step loop) and lockstep: the same seeds (every
    # episode lasts 3 turns), the same tokens; the log-probs as one forward gives them whatever the batch
    assert [ep.response_ids for ep in episodes] == [ep.response_ids for ep in lockstep]
    assert [ep.loss_mask for ep in episodes] == [ep.loss_mask for ep in lockstep]
    assert max(abs(a - b) for x, y in zip(episodes, lockstep) for a, b in zip(x.logprobs, y.logprobs)) < 1e-5
    model = load(qwen2_chat_dir)
    for ep in episodes:
        assert ep.turns == 3 and ep.done
        ref = hf_logprobs(model, ep.prompt_ids, ep.response_ids, 1.0)
        gaps = [abs(a - b) for a, b, m in zip(ep.logprobs, ref, ep.loss_mask) if m]
        assert max(gaps) < TOL
        turn_ends = [t for t, (m, nxt) in enumerate(zip(ep.loss_mask, ep.loss_mask[1:] + [False])) if m and not nxt]
        assert len(turn_ends) == 3 and all(ep.response_ids[t] in stops for t in turn_ends)
