"""vLLM's CPU engine on the Hub-shaped checkpoints (``models/demos/hub_models.py``): one sampling rule,
every eos id, a stream per sample, and weights that are the trainer's after an in-place reload of a
tied model — with the probe catching (and a restart repairing) a stale ``lm_head``.

References are independent of the engine: a plain transformers forward (``hub_copies.hf_logprobs``)
for log-probs, the checkpoint's files for eos ids. Checkpoints are float32; vLLM's CPU kernels agree
with transformers within 1e-3 nats (``test_models_vllm.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.engines import SamplingSpec
from tests.unit.models.engine_tensors import check_serves_tensors, sent_state
from tests.unit.models.hub_copies import hf_logprobs, load, trained_copy, with_eos

pytestmark = pytest.mark.integration
TOL = 1e-3


@pytest.fixture(scope="module")
def vllm_engine_cls():
    pytest.importorskip("vllm")
    from models.engines import VLLMEngine

    return VLLMEngine


def _prompt(path, text: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def _worst_gap(engine, path, prompts, spec) -> float:
    model = load(path)
    worst = 0.0
    for prompt, per_prompt in zip(prompts, engine.generate(prompts, spec)):
        for g in per_prompt:
            ref = hf_logprobs(model, prompt, g.tokens, spec.temperature or 1.0)
            worst = max(worst, max(abs(a - b) for a, b in zip(g.logprobs, ref)))
    return worst


def test_vllm_samples_without_the_checkpoint_defaults(vllm_engine_cls, qwen2_sharp_dir):
    """repetition_penalty 1.05, temperature 0.7, top-k 20, top-p 0.8 in generation_config.json: the
    engine's log-probs are still the forward's at the spec's temperature (0.7 here would show as a
    multi-nat gap, the penalty alone as > 1e-2 on the peaked model, test_engines.py)."""
    engine = vllm_engine_cls(str(qwen2_sharp_dir), max_model_len=256)
    try:
        prompts = [_prompt(qwen2_sharp_dir, "7 7 7 7 7 7 7 7"), _prompt(qwen2_sharp_dir, "abc abc abc abc")]
        assert _worst_gap(engine, qwen2_sharp_dir, prompts, SamplingSpec(n=4, max_new_tokens=12, seed=3)) < TOL
        assert _worst_gap(engine, qwen2_sharp_dir, prompts, SamplingSpec(n=2, temperature=0.5, max_new_tokens=8,
                                                                          seed=4)) < TOL
    finally:
        engine.close()


def test_both_engines_stop_on_the_second_eos_id(vllm_engine_cls, qwen2_chat_dir, llama_bpe_dir, tmp_path):
    from models.engines import HFEngine
    from transformers import AutoTokenizer

    for name, path in (("qwen2", qwen2_chat_dir), ("llama", llama_bpe_dir)):
        tok = AutoTokenizer.from_pretrained(path)
        prompt = _prompt(path, "Reverse: abc")
        greedy = SamplingSpec(temperature=0.0, max_new_tokens=6)
        first = HFEngine(str(path)).generate([prompt], greedy)[0][0].tokens[0]
        assert first != tok.eos_token_id
        stopping = str(with_eos(path, tmp_path / name, [tok.eos_token_id, first]))
        engine = vllm_engine_cls(stopping, max_model_len=256)
        try:
            (vllm_gen,), = engine.generate([prompt], greedy)
            ((step_gen,),), versions = engine.generate_versions([prompt], greedy, version=3,
                                                                between_steps=lambda: 3)  # partial rollouts' loop
        finally:
            engine.close()
        (hf_gen,), = HFEngine(stopping).generate([prompt], greedy)
        assert (vllm_gen.tokens, vllm_gen.is_end) == (hf_gen.tokens, hf_gen.is_end) == ([first], True), name
        assert (step_gen.tokens, step_gen.is_end, versions) == ([first], True, [[3]]), name
        assert step_gen.logprobs == pytest.approx(vllm_gen.logprobs, abs=1e-6), name


def test_sample_streams_do_not_collide_across_prompts(vllm_engine_cls, qwen2_chat_dir, tmp_path):
    """vLLM gives sample j of a request seeded s the stream s + j: with per-prompt seeds base + i,
    (prompt i, sample j) and (prompt i+1, sample j−1) drew the same response whenever the prompts
    were equal. Each sample now has its own seeded request.

    The engine is the one a run starts (``engine_kwargs``) on a checkpoint that says Qwen3's 40,960 positions: its
    context is the run's budget, its batch of prefill tokens follows that, and its KV cache is the run's 1 GiB in the
    blocks :func:`models.engines.context.kv_fit` counts (#46)."""
    import shutil

    from models.config.io import load_config
    from models.engines import make_engine
    from models.engines.context import kv_fit
    from models.stages.engine import engine_kwargs

    long_context = tmp_path / "qwen2-40960"
    shutil.copytree(qwen2_chat_dir, long_context)
    config = json.loads((long_context / "config.json").read_text())
    (long_context / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40960}))
    cfg = load_config("tiny_grpo", ["rollout.engine=vllm", "data.max_prompt_tokens=480", "rollout.max_new_tokens=32",
                                    "rollout.vllm_kv_cache_gib=1"])
    engine = make_engine("vllm", str(long_context), **engine_kwargs(cfg))
    try:
        vllm_config = engine.llm.llm_engine.vllm_config
        assert vllm_config.model_config.max_model_len == cfg.engine_context == 512  # not the checkpoint's 40,960
        assert vllm_config.scheduler_config.max_num_batched_tokens == 2048
        fit = kv_fit(config, "float32", 512, 1.0)
        assert vllm_config.cache_config.num_gpu_blocks == fit.space_bytes // fit.block_bytes
        same = _prompt(qwen2_chat_dir, "Reverse: abc")
        spec = SamplingSpec(n=4, max_new_tokens=6, seed=11)
        out = [[tuple(g.tokens) for g in p] for p in engine.generate([same] * 8, spec)]
        shifted = sum(out[i][j] == out[i + 1][j - 1] for i in range(7) for j in range(1, 4))
        assert shifted == 0 and len({r for p in out for r in p}) == 32
        engine.restart(str(long_context))  # a restarted engine (a resumed run) draws the same samples
        assert [[tuple(g.tokens) for g in p] for p in engine.generate([same] * 8, spec)] == out
    finally:
        engine.close()


def test_tied_weights_reload_in_place_and_the_probe_repairs_a_stale_head(vllm_engine_cls, qwen2_chat_dir, tmp_path,
                                                                        monkeypatch, capsys):
    import models.engines.vllm_engine as vllm_engine
    from models.training.probe import verify

    trained = [str(trained_copy(qwen2_chat_dir, tmp_path / f"t{i}", seed=i)) for i in (1, 2)]
    prompts = [_prompt(qwen2_chat_dir, "Reverse: abc"), _prompt(qwen2_chat_dir, "What is 12*13?")]
    spec = SamplingSpec(n=2, max_new_tokens=8, seed=0)
    engine = vllm_engine_cls(str(qwen2_chat_dir), max_model_len=256)
    try:
        engine.load_weights(trained[0])  # tied lm_head: reloaded in place, its packed copy re-derived
        assert (engine.stats.reloads, engine.stats.restarts) == (1, 0)
        assert _worst_gap(engine, trained[0], prompts, spec) < TOL
        assert verify(engine, trained[0], TOL, lambda: engine.restart(trained[0])).gap_max < TOL

        # plant what vLLM's reload does on its own: no report captured, no repair -> the old head
        def reload_stale(worker, weights_path):
            worker.reload_weights(weights_path=weights_path)
            return []

        monkeypatch.setattr(vllm_engine, "_reload_reporting", reload_stale)
        engine.load_weights(trained[1])
        assert (engine.stats.reloads, engine.stats.restarts) == (2, 0)
        assert _worst_gap(engine, trained[1], prompts, spec) > 1e-2  # stale: sampling from another policy
        result = verify(engine, trained[1], TOL, lambda: engine.restart(trained[1]))
        assert result.restarted and result.gap_max < TOL and engine.stats.restarts == 1
        assert _worst_gap(engine, trained[1], prompts, spec) < TOL
        assert "restarting the engine from the checkpoint" in capsys.readouterr().out

        # from memory: the trainer's state dict (lm_head.weight the embedding's tensor) through bytes;
        # the packed copy of the tied head is re-derived as after a folder reload, else the probe fails
        state, _ = sent_state(trained[0])
        assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
        check_serves_tensors(engine, trained[1], trained[0], TOL)
    finally:
        engine.close()


def test_a_reload_vllm_reports_as_incomplete_restarts_the_engine(vllm_engine_cls, qwen2_chat_dir, tmp_path,
                                                                 monkeypatch):
    """Any weight the loader says it could not load fails the reload, whatever the log level."""
    import logging

    import models.engines.vllm_push as vllm_push

    monkeypatch.setattr(vllm_push, "tied_modules", lambda model: [])  # no repair: the head's report stands
    logging.getLogger("vllm").setLevel(logging.ERROR)  # as a user silencing vLLM would
    trained = str(trained_copy(qwen2_chat_dir, tmp_path / "t", seed=3))
    engine = vllm_engine_cls(str(qwen2_chat_dir), max_model_len=256)
    try:
        engine.load_weights(trained)
        assert (engine.stats.reloads, engine.stats.restarts) == (0, 1)
        assert _worst_gap(engine, trained, [_prompt(trained, "hi")], SamplingSpec(n=2, max_new_tokens=6)) < TOL
    finally:
        logging.getLogger("vllm").setLevel(logging.INFO)
        engine.close()


def test_top_p_and_top_k_log_probs_are_the_same_on_both_engines(vllm_engine_cls, qwen2_sharp_dir):
    """processed_logprobs: of the truncated, renormalised distribution, on both engines (the tokens
    differ: each engine draws with its own noise)."""
    from kernels.sampling import processed_logprobs
    from models.engines import HFEngine

    prompt = _prompt(qwen2_sharp_dir, "Reverse: abcdef")
    spec = SamplingSpec(n=4, temperature=0.8, top_p=0.7, top_k=5, max_new_tokens=6, seed=5)
    model = load(qwen2_sharp_dir)
    engine = vllm_engine_cls(str(qwen2_sharp_dir), max_model_len=256)
    try:
        for gens in (engine.generate([prompt], spec)[0], HFEngine(str(qwen2_sharp_dir)).generate([prompt], spec)[0]):
            for g in gens:
                ids = torch.tensor([prompt + g.tokens])
                with torch.no_grad():
                    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # [R, V]
                want = processed_logprobs(logits, 0.8, 5, 0.7).gather(-1, torch.tensor(g.tokens)[:, None])
                assert max(abs(a - b) for a, b in zip(g.logprobs, want.squeeze(-1).tolist())) < TOL
    finally:
        engine.close()


def test_a_resumed_rollout_is_bit_identical_to_the_warm_one(vllm_engine_cls, qwen2_chat_dir, tmp_path):
    """What ``test_resume.py`` relies on, on the tied model: iteration 1's batch sampled by the engine
    kept warm (reloaded in place with iteration 0's actor) and by a fresh one (a resumed run's)."""
    from models.engines import close_engines
    from models.data.batch import RolloutBatch
    from models.stages.rollout import run_rollout
    from models.run.types import PolicyState
    from tests.hub_runs import hub_run, iterate

    with hub_run(tmp_path, qwen2_chat_dir, "tiny_grpo", ["rollout.engine=vllm", "run.save_interval=1"],
                 "resume") as (cfg, run, state):
        iterate(cfg, run, state, 2)
        url = run.layout.batch_url(1, "rollouts")
        warm = RolloutBatch.read(url).table.replace_schema_metadata(None)
        close_engines()
        s1 = PolicyState(1, run.layout.actor_url(0), "", state.kl_coef)
        fresh = run_rollout(cfg, run, s1).batch.table.replace_schema_metadata(None)
        close_engines()
    assert fresh.equals(warm)
    assert len({tuple(r) for r in warm.column("response_tokens").to_pylist()}) > 1


def test_vllm_serves_an_lm_head_adapter_on_a_tied_llama(vllm_engine_cls, tmp_path):
    """Llama 3.2-style (tied embeddings): vLLM's Llama adapts lm_head, on the logits only, as peft trains
    it; Qwen2's does not (refused at set-up, ``test_lora.py``)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from models.checkpoint import save_checkpoint
    from models.engines import close_engines
    from models.demos.hub_models import HubModelConfig, build_llama_bpe
    from models.training.lora import load_pretrained
    from models.config.io import load_config
    from models.run.preflight import check_rollout_setup
    from models.stages.engine import engine_for
    from tests.unit.models.hub_copies import adapter_checkpoint

    hf = build_llama_bpe(tmp_path / "hf", HubModelConfig(num_kv_heads=2, tie_word_embeddings=True))
    base, adapter = str(tmp_path / "base"), str(tmp_path / "adapter")
    save_checkpoint(str(hf), base)
    spec = SimpleNamespace(rank=8, alpha=16.0, dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"])
    adapter_checkpoint(base, spec, AutoTokenizer.from_pretrained(base), adapter, std=0.3)
    cfg = load_config("tiny_ppo_lora", ["rollout.lora_mode=adapter", "rollout.engine=vllm"])
    check_rollout_setup(cfg, json.loads((tmp_path / "base" / "config.json").read_text()))  # Llama: not refused
    try:
        engine = engine_for(cfg, adapter)  # probed: the engine (base + adapter) against peft's forward
        assert engine.stats.extra["probe_gap_max"] < TOL
        trained = load_pretrained(adapter, AutoModelForCausalLM, torch.float32).eval()
        prompt = _prompt(base, "Reverse: abc")
        for g in engine.generate([prompt], SamplingSpec(n=4, max_new_tokens=8, seed=1))[0]:
            assert max(abs(a - b) for a, b in zip(g.logprobs, hf_logprobs(trained, prompt, g.tokens))) < TOL
    finally:
        close_engines()
