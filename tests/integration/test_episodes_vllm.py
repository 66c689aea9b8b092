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
    prompts = ("Hi.", "Count.", "Go.")
    try:
        with ThreadPoolExecutor(2) as pool:
            episodes = run_episodes(engine, tok, [TalkEnv({"prompt": w}) for w in prompts], spec,
                                    EpisodeLimits(max_turns=4, max_episode_tokens=200), HermesParser(), pool)
            lockstep = run_episodes(engine, tok, [TalkEnv({"prompt": w}) for w in prompts], spec,
                                    EpisodeLimits(max_turns=4, max_episode_tokens=200, pace="lockstep"),
                                    HermesParser(), pool)
    finally:
        engine.close()
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
