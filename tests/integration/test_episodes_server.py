"""Multi-turn episodes through the rollout server (the cluster path): the same loop, one
``POST /generate`` per turn, gives the episodes the engine in this process gives (same checkpoint,
seed and one torch thread on both sides: the same tokens, log-probs within JSON float error)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from models.checkpoint import save_checkpoint
from models.engines import HFEngine, SamplingSpec
from models.environments.episodes import EpisodeLimits, run_episodes
from models.service.client import ServiceClient
from models.stages.engine import RemoteEngine
from tests.processes import server_process
from models.environments.tools import HermesParser
from tests.unit.episodes.test_episodes import TalkEnv

pytestmark = pytest.mark.integration


def _episodes(engine, tok):
    spec = SamplingSpec(temperature=1.0, max_new_tokens=10, seed=11, stop_token_ids=tuple(range(3, len(tok) // 2)))
    envs = [TalkEnv({"prompt": f"Say {w}."}) for w in ("hi", "yes")]
    with ThreadPoolExecutor(2) as pool:
        return run_episodes(engine, tok, envs, spec, EpisodeLimits(max_turns=4, max_episode_tokens=200),
                            HermesParser(), pool)


def test_episodes_through_the_rollout_server_equal_the_engine_in_process(qwen2_chat_dir, tmp_path):
    committed = str(tmp_path / "committed")
    save_checkpoint(str(qwen2_chat_dir), committed)
    tok = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = _episodes(HFEngine(committed), tok)
        srv = server_process(["--checkpoint", committed, "--engine", "hf", "--threads", "1", "--storage-root",
                              str(tmp_path)], "serve-rollout", log_path=tmp_path / "server.log").start()
        try:
            engine = RemoteEngine(ServiceClient(srv.url, timeout_s=120), committed, probe_tolerance=0.0)
            calls = []
            generate = engine.generate
            engine.generate = lambda prompts, spec: calls.append(len(prompts)) or generate(prompts, spec)
            remote = _episodes(engine, tok)
        finally:
            srv.stop()
    finally:
        torch.set_num_threads(before)
    assert calls == [2, 2, 2]  # one request per turn for both episodes
    for a, b in zip(remote, local):
        assert (a.response_ids, a.loss_mask, a.turns, a.done) == (b.response_ids, b.loss_mask, b.turns, b.done)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
