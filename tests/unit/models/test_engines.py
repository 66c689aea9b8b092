"""HFEngine: weights swapped in place when the layout matches, by a restart when it does not,
an unusable checkpoint refused with the engine left as it was; min_new_tokens masks stop tokens.

The reference for "serves checkpoint X" is a fresh engine started on X (same code path
``from_pretrained``), compared on greedy tokens and their log-probs.
"""

import os

import pytest
import torch

from models.engines import EngineLoadError, HFEngine, SamplingSpec, WeightsLayout
from tests.unit.models.actor_checkpoints import PROMPTS, actor_dir, with_truncated_weights

GREEDY = SamplingSpec(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("actors")
    return {"a": actor_dir(root / "a", seed=0), "b": actor_dir(root / "b", seed=1),
            "wide": actor_dir(root / "wide", seed=2, intermediate_size=384)}


def _outputs(engine):
    gens = [g[0] for g in engine.generate(PROMPTS, GREEDY)]
    return [g.tokens for g in gens], torch.tensor([lp for g in gens for lp in g.logprobs])


def _assert_serves(engine, ckpt):
    tokens, logp = _outputs(engine)
    ref_tokens, ref_logp = _outputs(HFEngine(ckpt))
    assert tokens == ref_tokens
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)


def test_same_layout_goes_in_place_and_serves_the_new_weights(ckpts):
    engine = HFEngine(ckpts["a"])
    before, _ = _outputs(engine)
    engine.load_weights(ckpts["b"])
    assert (engine.stats.reloads, engine.stats.restarts) == (1, 0)
    _assert_serves(engine, ckpts["b"])
    assert _outputs(engine)[0] != before  # the two checkpoints are told apart


def test_other_shapes_restart_from_the_checkpoint(ckpts):
    engine = HFEngine(ckpts["a"])
    engine.load_weights(ckpts["wide"])  # intermediate_size 256 -> 384
    assert (engine.stats.reloads, engine.stats.restarts) == (0, 1)
    _assert_serves(engine, ckpts["wide"])
    engine.load_weights(ckpts["a"])  # and back
    _assert_serves(engine, ckpts["a"])


def test_unusable_checkpoint_is_refused_and_the_engine_keeps_serving(ckpts, tmp_path):
    broken = with_truncated_weights(ckpts["b"], tmp_path / "broken")
    engine = HFEngine(ckpts["a"])
    with pytest.raises(EngineLoadError, match="broken is unusable"):
        engine.load_weights(broken)
    _assert_serves(engine, ckpts["a"])


def test_layout_mismatch_names_what_differs(ckpts):
    a, b, wide = (WeightsLayout.read(ckpts[k]) for k in ("a", "b", "wide"))
    assert a.mismatch(b) is None  # other values, same layout
    assert a.mismatch(wide) == "config differs in ['intermediate_size']"
    reshaped = WeightsLayout(a.config, {**a.shapes, "lm_head.weight": (7, 64)})
    assert a.mismatch(reshaped) == f"tensor shapes differ: ['lm_head.weight {a.shapes['lm_head.weight']} -> (7, 64)']"
    fewer = WeightsLayout(a.config, {k: v for k, v in a.shapes.items() if k != "lm_head.weight"})
    assert a.mismatch(fewer) == "tensors differ: missing ['lm_head.weight'], unexpected []"


def test_min_new_tokens_masks_stop_tokens(ckpts):
    engine = HFEngine(ckpts["a"])
    first = [g[0].tokens[0] for g in engine.generate(PROMPTS, GREEDY)]
    for prompt, stop in zip(PROMPTS, first):  # the greedy first token made a stop token
        spec = SamplingSpec(temperature=0.0, max_new_tokens=6, stop_token_ids=[stop])
        (gen,), = engine.generate([prompt], spec)
        assert (gen.tokens, gen.is_end) == ([stop], True)
        forced = SamplingSpec(temperature=0.0, max_new_tokens=6, min_new_tokens=6, stop_token_ids=[stop])
        (gen,), = engine.generate([prompt], forced)
        assert len(gen.tokens) == 6 and stop not in gen.tokens and not gen.is_end


def test_get_engine_drops_an_engine_that_cannot_serve_the_new_checkpoint(ckpts, tmp_path):
    from models.engines import _CACHE, close_engines, get_engine

    broken = with_truncated_weights(ckpts["b"], tmp_path / "broken")
    close_engines()  # an engine left by an earlier test in this process would be reused
    try:
        engine = get_engine("hf", ckpts["a"])
        assert get_engine("hf", ckpts["b"]) is engine and engine.stats.reloads == 1  # same layout: in place
        with pytest.raises(EngineLoadError, match="unusable"):
            get_engine("hf", broken)
        assert "policy" not in _CACHE
        _assert_serves(get_engine("hf", ckpts["a"]), ckpts["a"])  # a fresh engine
    finally:
        close_engines()


# --- the Hub-shaped checkpoints (models/demos/hub_models.py): one sampling rule, eos ids, streams, the probe ---

def _chat_prompt(path, text: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


@pytest.mark.slow
def test_hf_engine_samples_what_the_trainer_scores_not_the_checkpoint_defaults(qwen2_sharp_dir):
    """generation_config.json asks for repetition_penalty 1.05, temperature 0.7, top-k 20, top-p 0.8:
    none of it may reach the sampler, whose log-probs must be the plain forward's at the spec's τ."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from tests.unit.models.hub_copies import hf_logprobs, load

    prompts = [_chat_prompt(qwen2_sharp_dir, "7 7 7 7 7 7 7 7"), _chat_prompt(qwen2_sharp_dir, "abc abc abc abc")]
    spec = SamplingSpec(n=4, temperature=1.0, max_new_tokens=12, seed=3)
    gens = HFEngine(str(qwen2_sharp_dir)).generate(prompts, spec)
    model = load(qwen2_sharp_dir)
    worst, penalised = 0.0, 0.0
    penalty = RepetitionPenaltyLogitsProcessor(1.05)
    for prompt, per_prompt in zip(prompts, gens):
        for g in per_prompt:
            worst = max(worst, max(abs(a - b) for a, b in zip(g.logprobs, hf_logprobs(model, prompt, g.tokens))))
            for t, tok in enumerate(g.tokens):  # what a sampler applying the checkpoint's penalty would report
                ids = torch.tensor([prompt + g.tokens[:t]])
                with torch.no_grad():
                    logits = model(input_ids=ids).logits[:, -1].float()
                lp = torch.log_softmax(penalty(ids, logits.clone()), -1)[0, tok]
                penalised = max(penalised, abs(float(lp) - g.logprobs[t]))
    assert worst < 1e-5
    assert penalised > 1e-2  # the check can fail: the penalty alone moves the log-probs this much


def test_hf_engine_stops_on_every_eos_id_of_generation_config(qwen2_chat_dir, tmp_path):
    from models.engines import eos_token_ids
    from models.demos.hub_models import ENDOFTEXT, IM_END
    from tests.unit.models.hub_copies import with_eos

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    im_end, endoftext = tok.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    assert eos_token_ids(str(qwen2_chat_dir)) == tuple(sorted((im_end, endoftext)))
    prompt = _chat_prompt(qwen2_chat_dir, "Reverse: abc")
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=6)
    free = HFEngine(str(qwen2_chat_dir)).generate([prompt], greedy)[0][0]
    first = free.tokens[0]
    assert first not in (im_end, endoftext) and len(free.tokens) > 1  # it does not stop there on its own
    stopping = with_eos(qwen2_chat_dir, tmp_path / "eos", [im_end, first])  # the second eos id: `first`
    (gen,), = HFEngine(str(stopping)).generate([prompt], greedy)
    assert (gen.tokens, gen.is_end) == ([first], True)


def test_sample_streams_are_per_prompt_and_sample_and_survive_a_restart(qwen2_chat_dir):
    engine = HFEngine(str(qwen2_chat_dir))
    same = _chat_prompt(qwen2_chat_dir, "Reverse: abc")
    spec = SamplingSpec(n=4, temperature=1.0, max_new_tokens=6, seed=11)
    out = [[tuple(g.tokens) for g in p] for p in engine.generate([same] * 8, spec)]
    shifted = sum(out[i][j] == out[i + 1][j - 1] for i in range(7) for j in range(1, 4))  # seed + i + j collides
    distinct = len({r for p in out for r in p})
    assert shifted == 0 and distinct == 32  # a near-uniform random model: equal responses only from equal streams
    assert [[tuple(g.tokens) for g in p] for p in engine.generate([same] * 8, spec)] == out  # reproducible
    engine.restart(str(qwen2_chat_dir))
    again = engine.generate([same] * 8, spec)
    assert [[tuple(g.tokens) for g in p] for p in again] == out  # a restarted engine: the same samples
    other = engine.generate([same] * 8, SamplingSpec(n=4, temperature=1.0, max_new_tokens=6, seed=12))
    assert not {tuple(g.tokens) for p in other for g in p} & {r for p in out for r in p}  # another iteration


def test_probe_detects_a_stale_lm_head_and_restarts_the_engine(qwen2_chat_dir, tmp_path, capsys):
    from models.training.probe import ensure_serves, verify
    from tests.unit.models.hub_copies import trained_copy

    trained = str(trained_copy(qwen2_chat_dir, tmp_path / "trained", seed=1))
    engine = HFEngine(str(qwen2_chat_dir))
    engine.load_weights(trained)  # tied: the head follows the embedding in place
    first = ensure_serves(engine, ("trained",), trained, 1e-3, lambda: engine.restart(trained))
    assert first.gap_max < 1e-5 and not first.restarted and engine.stats.restarts == 0
    stale = HFEngine(str(qwen2_chat_dir)).model.lm_head.weight.detach().clone()
    engine.model.lm_head.weight = torch.nn.Parameter(stale)  # what vLLM's CPU reload left: the old head
    result = verify(engine, trained, 1e-3, lambda: engine.restart(trained))
    assert result.restarted and result.gap_max < 1e-5 and engine.stats.restarts == 1
    said = capsys.readouterr().out
    assert "log-probs differ by up to" in said and "restarting the engine from the checkpoint" in said


def test_probe_stops_the_run_when_a_restart_does_not_help(qwen2_chat_dir, tmp_path, monkeypatch):
    from models.training.probe import EngineMismatchError, verify
    from tests.unit.models.hub_copies import trained_copy

    trained = str(trained_copy(qwen2_chat_dir, tmp_path / "trained", seed=1))
    engine = HFEngine(trained)
    start = HFEngine._start

    def start_wrong(self, checkpoint_dir):  # an engine that computes this model differently, every time
        start(self, checkpoint_dir)
        with torch.no_grad():
            self.model.lm_head.weight = torch.nn.Parameter(self.model.lm_head.weight * 1.5)

    monkeypatch.setattr(HFEngine, "_start", start_wrong)
    engine.restart(trained)
    with pytest.raises(EngineMismatchError, match=r"still differ after restarting the engine from the checkpoint: "
                                                  r"largest gap \d\.\d+ nats \(tolerance 0\.001, rollout\.probe_tol"
                                                  r"erance\) at sequence \d, position \d+ \(token id \d+\): engine "):
        verify(engine, trained, 1e-3, lambda: engine.restart(trained))


def test_cpu_workers_get_disjoint_shares_of_the_allowed_cores():
    from models.engines.vllm_setup import cpu_worker_groups

    assert cpu_worker_groups([3, 2, 1, 0], 2) == "0,1|2,3"
    assert cpu_worker_groups([0, 1, 2], 2) == "0,1|2"  # the first worker takes the odd core
    assert cpu_worker_groups([4, 6], 2) == "4|6"
    with pytest.raises(EngineLoadError, match=r"tensor_parallel_size=2 needs a CPU core per worker; this process may use 1"):
        cpu_worker_groups([0], 2)


def test_the_cpu_workers_binding_lasts_only_while_the_engine_starts(monkeypatch):
    """vLLM's workers read the binding when the engine starts them; after that the process's environment
    is as before, so a later one-worker engine of the process binds as vLLM would (not to one core)."""
    from models.engines.vllm_setup import cpu_workers_bound

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with cpu_workers_bound(2):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    with pytest.raises(RuntimeError, match="the engine failed"), cpu_workers_bound(4):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1|2|3"
        raise RuntimeError("the engine failed")
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    with cpu_workers_bound(1):  # one worker: vLLM's own binding
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "2,3|0,1")
    with cpu_workers_bound(2):  # the user's binding wins
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "2,3|0,1"


def test_weights_from_memory_go_in_place_on_the_tiny_actor(ckpts):
    from tests.unit.models.engine_tensors import check_serves_tensors

    engine = HFEngine(ckpts["a"])
    check_serves_tensors(engine, ckpts["a"], ckpts["b"], 1e-3)
    assert engine.stats.restarts == 0


def test_weights_from_memory_go_in_place_on_a_tied_model(qwen2_chat_dir, tmp_path):
    """Qwen2 ties lm_head to the embedding: the trainer's state dict holds both names as one tensor, the
    engine's head follows the embedding; an lm_head that is not the embedding is refused."""
    from tests.unit.models.engine_tensors import check_serves_tensors, sent_state
    from tests.unit.models.hub_copies import trained_copy

    trained = str(trained_copy(qwen2_chat_dir, tmp_path / "trained", seed=1))
    state, _ = sent_state(trained)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    engine = HFEngine(str(qwen2_chat_dir))
    check_serves_tensors(engine, str(qwen2_chat_dir), trained, 1e-3)
    untied = {**state, "lm_head.weight": state["lm_head.weight"] + 1}
    with pytest.raises(EngineLoadError, match=r"unexpected \['lm_head.weight'\]"):
        engine.load_tensors(untied)


def test_weights_from_memory_that_fail_half_way_close_the_engine(ckpts):
    """Names and shapes fit, but one tensor has no data (a meta tensor): the copy fails after others went
    in, so the engine must not serve; a restart from a checkpoint brings it back."""
    from tests.unit.models.engine_tensors import sent_state

    engine = HFEngine(ckpts["a"])
    state, _ = sent_state(ckpts["b"])
    name = sorted(state)[-1]
    with pytest.raises(EngineLoadError, match="these weights are not all tensors: .*list"):
        engine.load_tensors({**state, name: [0.0]})
    _assert_serves(engine, ckpts["a"])  # refused before anything was copied
    with pytest.raises(EngineLoadError, match=r"(?s)copying new weights into the engine failed \(.*\); the engine is "
                                              r"closed: restart it from a checkpoint"):
        engine.load_tensors({**state, name: torch.empty(state[name].shape, device="meta")})
    with pytest.raises(EngineLoadError, match="closed"):
        engine.generate(PROMPTS, GREEDY)
    engine.restart(ckpts["a"])
    _assert_serves(engine, ckpts["a"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_weights_pushed_are_read_back_bit_for_bit(ckpts, dtype):
    """The engine's side of a push's exact check (#38): what it holds is read back and compared bit for bit, so an
    engine that kept its weights or left a tensor out is named, in bfloat16 as in float32, whatever the probe says
    (in bfloat16 its tolerance is 0.5 nats)."""
    from tests.unit.models.engine_tensors import check_reads_back_what_was_pushed

    engine = HFEngine(ckpts["a"], dtype=dtype)
    check_reads_back_what_was_pushed(engine, ckpts["a"], ckpts["b"], dtype)


def test_vllm_captures_cuda_graphs_on_a_gpu_unless_told_not_to(ckpts, monkeypatch, tmp_path):
    """``rollout.enforce_eager`` (#38 item 7): CUDA graphs on a GPU by default, eager when asked; the CPU is always
    eager. Read from vLLM's arguments, and from the config through the engine a stage starts."""
    from models.config.io import load_config
    from models.engines.vllm_setup import llm_kwargs
    from models.stages import engine as stage_engine

    def eager(cuda, asked=False):
        return llm_kwargs(ckpts["a"], "bfloat16", 0.5, 64, 0, 0, 1, asked, cuda)["enforce_eager"]

    assert (eager(cuda=True), eager(cuda=True, asked=True)) == (False, True)
    assert eager(cuda=False) and eager(cuda=False, asked=True)
    seen = {}
    monkeypatch.setattr(stage_engine, "get_engine", lambda kind, weights, **kw: seen.update(kw) or HFEngine(weights))
    monkeypatch.setattr(stage_engine, "ensure_serves", lambda *a, **k: None)
    from models.checkpoint import save_checkpoint

    url = str(tmp_path / "committed")
    save_checkpoint(ckpts["a"], url)
    for asked in (False, True):
        cfg = load_config("tiny_ppo", ["rollout.engine=vllm", f"rollout.enforce_eager={str(asked).lower()}"])
        stage_engine.engine_for(cfg, url)
        assert seen["enforce_eager"] is asked
        assert seen["max_model_len"] == cfg.engine_context  # the run's context, not the checkpoint's (#46)
