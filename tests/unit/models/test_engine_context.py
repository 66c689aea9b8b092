"""The engine's context and KV cache from the run, not the checkpoint (#46 item 1): ``max_model_len`` is the run's
budget (prompt + new tokens, or + the episode's tokens) capped at the checkpoint's ``max_position_embeddings``, for
every path that starts an engine; the KV cache of a CPU engine is checked at set-up against one such sequence.

References: the figures of a Qwen3-0.6B-shaped ``config.json`` worked by hand (2 × 28 layers × 8 KV heads × 128 ×
4 bytes = 229,376 bytes per float32 token; its 40,960-token context takes the issue's 8.75 GiB), and the chat
template's own rendering for an environment's first prompt (``tests/unit/tasks/test_prompts.py``). A real engine
on such a context: ``tests/integration/test_hub_checkpoints.py``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from models.config import ConfigError
from models.config.io import load_config
from models.engines.context import GIB, kv_fit
from models.engines.vllm_setup import llm_kwargs
from models.run.context import check_engine_memory, prompt_room
from models.stages.engine import engine_kwargs
from models.training.probe import PROBE_LENGTH

QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
             "vocab_size": 151936}
PER_TOKEN = 2 * 28 * 8 * 128 * 4


def _config_only(tmp_path, config=QWEN3_06B) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _cfg(preset="tiny_grpo", *overrides):
    return load_config(preset, ["rollout.engine=vllm", *overrides])


def test_the_engine_context_is_the_runs_budget():
    single = _cfg("tiny_grpo", "data.max_prompt_tokens=512", "rollout.max_new_tokens=32")
    assert single.engine_context == 544 == engine_kwargs(single)["max_model_len"]
    episodes = _cfg("tiny_tools", "data.max_prompt_tokens=300")  # rollout.max_episode_tokens: 160, max_new_tokens 48
    assert episodes.engine_context == 460 == engine_kwargs(episodes)["max_model_len"]
    tiny = _cfg("tiny_grpo", "data.max_prompt_tokens=4", "rollout.max_new_tokens=2")  # still holds the probe's
    assert engine_kwargs(tiny)["max_model_len"] == PROBE_LENGTH
    kw = engine_kwargs(_cfg("tiny_grpo", "rollout.vllm_max_num_seqs=8", "rollout.vllm_kv_cache_gib=0.5",
                            "rollout.data_parallel_size=2"))
    assert (kw["max_num_seqs"], kw["kv_cache_gib"], kw["data_parallel_size"]) == (8, 0.5, 2)  # replicas get them all
    with pytest.raises(ConfigError, match=r"rollout\.vllm_max_num_seqs=-1 must be >= 0"):
        _cfg("tiny_grpo", "rollout.vllm_max_num_seqs=-1")


def test_vllm_gets_the_runs_context_capped_at_the_checkpoints(tmp_path):
    ckpt = _config_only(tmp_path)

    def kwargs(length, cuda=False, **kw):
        return llm_kwargs(ckpt, "float32", 0.5, length, 0, 0, 1, False, cuda, **kw)

    run = kwargs(544, kv_cache_gib=0.5, max_num_seqs=8)
    assert (run["max_model_len"], run["max_num_batched_tokens"], run["kv_cache_memory_bytes"], run["max_num_seqs"]) \
        == (544, 2048, GIB // 2, 8)
    assert (kwargs(4096)["max_model_len"], kwargs(4096)["max_num_batched_tokens"]) == (4096, 4096)  # not 40,960
    assert (kwargs(50000)["max_model_len"], kwargs(50000)["max_num_batched_tokens"]) == (40960, 40960)
    assert kwargs(None)["max_model_len"] == 40960  # a caller that names no context: the checkpoint's own
    gpu = kwargs(544, cuda=True)
    assert gpu["max_model_len"] == 544 and "kv_cache_memory_bytes" not in gpu and "max_num_seqs" not in gpu


def test_the_kv_cache_figures_of_a_qwen3_06b_shape():
    today = kv_fit(QWEN3_06B, "float32", 40960, 1.0)  # the checkpoint's context: the 8.75 GiB, none fits
    assert (today.bytes_per_token, today.sequence_bytes, today.sequences) == (PER_TOKEN, 8.75 * GIB, 0)
    run = kv_fit(QWEN3_06B, "float32", 544, 1.0)  # 5 blocks of 128 tokens, one block held back: 7.11 -> 7
    assert run.sequence_bytes == 5 * 128 * PER_TOKEN and run.sequences == 7
    assert kv_fit(QWEN3_06B, "bfloat16", 544, 1.0, tensor_parallel_size=2).bytes_per_token == PER_TOKEN // 4


def test_setup_refuses_a_kv_cache_that_holds_no_sequence_of_the_context(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    over = _cfg("tiny_grpo", "data.max_prompt_tokens=4000", "rollout.max_new_tokens=96", "rollout.vllm_kv_cache_gib=0.5")
    with pytest.raises(ConfigError, match=r"rollout\.vllm_kv_cache_gib=0\.5 GiB of KV cache cannot hold one sequence "
                                          r"of max_model_len=4096 tokens \(data\.max_prompt_tokens=4000 \+ "
                                          r"rollout\.max_new_tokens=96.*takes 0\.902 GiB .*at least 0\.91"):
        check_engine_memory(over, QWEN3_06B)
    fits = check_engine_memory(dataclasses.replace(over, rollout=dataclasses.replace(over.rollout,
                                                                                      vllm_kv_cache_gib=1.0)),
                               QWEN3_06B)
    assert (fits.max_model_len, fits.sequences) == (4096, 1)
    assert check_engine_memory(_cfg("tiny_grpo", "rollout.engine=hf"), QWEN3_06B) is None  # not vLLM's cache


def test_a_cpu_engine_refuses_its_kv_cache_before_any_weight_loads(tmp_path, monkeypatch):
    """The rollout server's engine, or one started outside a run: refused from ``config.json`` alone (this folder
    has no weights, which vLLM would have failed on first)."""
    from models.engines import EngineLoadError, VLLMEngine

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(EngineLoadError, match=r"vllm_kv_cache_gib .*=0\.5 GiB of KV cache cannot hold one sequence of "
                                              r"max_model_len=4096 tokens"):
        VLLMEngine(_config_only(tmp_path), max_model_len=4096, kv_cache_gib=0.5)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # the environment's wins, and says so
    with pytest.raises(EngineLoadError, match=r"=0 GiB \(VLLM_CPU_KVCACHE_SPACE is set and wins\)"):
        VLLMEngine(_config_only(tmp_path), max_model_len=544, kv_cache_gib=4)


def test_a_generation_budget_over_the_checkpoints_limit_is_refused():
    assert prompt_room(_cfg("tiny_tools"), QWEN3_06B) == 40960 - 160  # episodes: the episode's tokens, not 48
    assert prompt_room(_cfg("tiny_grpo"), {"vocab_size": 8}) is None  # the checkpoint does not say
    with pytest.raises(ConfigError, match=r"rollout\.max_episode_tokens=40960 leaves no room for a prompt in the "
                                          r"actor's context of 40960 tokens \(its config\.json max_position_embeddings"):
        prompt_room(_cfg("tiny_tools", "rollout.max_episode_tokens=40960"), QWEN3_06B)


def test_replicas_and_the_rollout_server_start_their_engines_with_a_context(tmp_path, monkeypatch):
    import models.engines as engines
    from models.hosts import rollout as server

    made = {}
    monkeypatch.setattr(engines, "EngineReplicas", lambda make, n, workers: made.update(make.keywords, n=n))
    kw = engine_kwargs(_cfg("tiny_grpo", "rollout.data_parallel_size=2"))
    engines.make_engine("vllm", "unused", **kw)  # each replica process calls make_engine with these
    assert (made["max_model_len"], made["n"]) == (kw["max_model_len"], 2)

    seen = {}
    monkeypatch.setattr(server, "_fetch", lambda url: _config_only(tmp_path))
    monkeypatch.setattr(server, "make_engine", lambda kind, weights, **kw: seen.update(kw))
    for given, context in (({}, 8192), ({"max_tokens": 1024}, 1024), ({"max_model_len": 600}, 600)):
        host = server.RolloutHost(server.RolloutServiceConfig("committed", **given))
        host._thread.shutdown()
        assert seen["max_model_len"] == context  # the engine caps it at the checkpoint's (llm_kwargs)


def test_a_bfloat16_engine_on_a_cpu_without_bf16_arithmetic_is_told_once(tmp_path, caplog, monkeypatch):
    """vLLM's CPU kernels compute bfloat16 through float32 conversions on an x86 CPU without AVX-512 BF16 or AMX
    (3x slower than float32, measured on this machine's AVX2 EPYC): the engine's start says so once a process, with
    what to set; nothing for float32, a GPU, a CPU with bf16 arithmetic or another architecture."""
    from models.engines import vllm_setup
    from models.engines.vllm_setup import cpu_dtype_note

    assert "rollout.vllm_dtype=float32" in cpu_dtype_note("bfloat16", False, "x86_64", bf16_native=False)
    assert not cpu_dtype_note("bfloat16", False, "x86_64", bf16_native=True)
    assert not cpu_dtype_note("float32", False, "x86_64", bf16_native=False)
    assert not cpu_dtype_note("bfloat16", True, "x86_64", bf16_native=False)
    assert not cpu_dtype_note("bfloat16", False, "aarch64", bf16_native=False)
    monkeypatch.setattr(vllm_setup, "_NOTED", set())
    monkeypatch.setattr(vllm_setup.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    ckpt = _config_only(tmp_path)
    with caplog.at_level("WARNING", logger="models.engines.vllm_setup"):
        for dtype in ("bfloat16", "bfloat16", "float32"):  # a stateless run's engine of each task
            assert llm_kwargs(ckpt, dtype, 0.5, 544, 0, 0, 1, False, False)["dtype"] == dtype
    notes = [r.getMessage() for r in caplog.records if "AVX-512 BF16" in r.getMessage()]
    assert len(notes) == 1 and "3x slower than float32" in notes[0], notes
