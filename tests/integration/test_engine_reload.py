"""VLLMEngine.load_weights: new weights in place when the layout matches, else a restart from the
checkpoint; an unusable checkpoint gives a clear error. min_new_tokens masks stop tokens.

vLLM's own ``reload_weights`` does not check shapes: a checkpoint with a wider MLP is cut to
the old shape without an error, so the "other shapes" test fails if the engine trusts it.
"Serves checkpoint X" is checked against Hugging Face on X, as in test_models_vllm.py: the
engine's sampled tokens get the log-probs HF's forward pass gives them (within 1e-3; the
checkpoints differ by several nats per token). Weights from memory (``load_tensors``) are checked
against the trainer's forward and the folder reload, and read back from the worker bit for bit
(``tests/unit/models/engine_tensors.py``).
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from models.engines import EngineLoadError, SamplingSpec, VLLMEngine
from tests.unit.models.actor_checkpoints import PROMPTS, actor_dir, with_extra_tensor, with_truncated_weights
from tests.unit.models.engine_tensors import check_reads_back_what_was_pushed, check_serves_tensors

pytestmark = pytest.mark.integration

SAMPLE = SamplingSpec(n=2, temperature=1.0, max_new_tokens=6, seed=0)
PROBE_TOL = 1e-3
"""``rollout.probe_tolerance``'s default (float32 on both sides)."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("actors")
    out = {"a": actor_dir(root / "a", seed=0), "b": actor_dir(root / "b", seed=1),
           "wide": actor_dir(root / "wide", seed=2, intermediate_size=384)}
    out["extra"] = with_extra_tensor(out["b"], root / "extra")
    out["truncated"] = with_truncated_weights(out["b"], root / "truncated")
    return out


@pytest.fixture
def engine(ckpts):
    pytest.importorskip("vllm")
    eng = VLLMEngine(ckpts["a"], max_model_len=64)
    yield eng
    eng.close()


def _worst_logp_error(engine, ckpt) -> float:
    """max |log-prob of the engine - HF's log-prob under ``ckpt``| over sampled tokens."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    worst = 0.0
    for prompt, gens in zip(PROMPTS, engine.generate(PROMPTS, SAMPLE)):
        for gen in gens:
            ids = torch.tensor([prompt + gen.tokens])  # [1, P + R]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # [R, V]
            hf = F.log_softmax(logits, -1).gather(-1, torch.tensor(gen.tokens)[:, None]).squeeze(-1)
            worst = max(worst, (torch.tensor(gen.logprobs) - hf).abs().max().item())
    return worst


def test_same_layout_goes_in_place_and_serves_the_new_weights(engine, ckpts, monkeypatch):
    assert engine.stats.extra["cuda_graphs"] == 0.0  # the CPU runs eager (rollout.enforce_eager aside)
    assert _worst_logp_error(engine, ckpts["a"]) < 1e-3
    _probe_takes_one_request_a_sequence(engine, monkeypatch)
    # a chunk an engine replica is given (rollout.data_parallel_size): prompts[1:3] from index 1, or prompts 0 and 2
    # by their indices (a sticky session's), sample what one engine samples for them in the whole request (each
    # sample's own seed)
    whole, chunk = engine.generate(PROMPTS, SAMPLE), engine.generate(PROMPTS[1:3], SAMPLE, first_index=1)
    assert [[g.tokens for g in p] for p in chunk] == [[g.tokens for g in p] for p in whole[1:3]]
    picked = engine.generate([PROMPTS[0], PROMPTS[2]], SAMPLE, indices=[0, 2])
    assert [[g.tokens for g in p] for p in picked] == [[g.tokens for g in p] for p in (whole[0], whole[2])]
    assert _worst_logp_error(engine, ckpts["b"]) > 0.5  # the checkpoints are told apart
    engine.load_weights(ckpts["b"])  # the same prompts are in the prefix cache: it must be reset
    assert (engine.stats.reloads, engine.stats.restarts) == (1, 0)
    assert _worst_logp_error(engine, ckpts["b"]) < 1e-3
    check_serves_tensors(engine, ckpts["b"], ckpts["a"], PROBE_TOL)  # and from memory: A's state, then B's
    assert (engine.stats.reloads, engine.stats.restarts) == (3, 0)
    check_reads_back_what_was_pushed(engine, ckpts["b"], ckpts["a"], "float32")  # from the worker, bit for bit
    assert engine.stats.restarts == 0


def _probe_takes_one_request_a_sequence(engine, monkeypatch):
    """The probe's log-probs (no adapter): one request a sequence, the values a request per prefix gives (the way
    a LoRA engine takes) bit for bit, for a sequence shorter than a KV block and one longer."""
    sequences = [[3, 5, 7, 11, 13, 17, 19, 23], list(range(2, 38, 2))]
    sent, generate = [], engine.llm.generate
    monkeypatch.setattr(engine.llm, "generate", lambda prompts, *a, **k: sent.append(len(prompts)) or
                        generate(prompts, *a, **k))
    one, by_prefix = engine.prompt_logprobs(sequences), engine._logprobs_by_prefix(sequences)
    assert sent == [2, 7 + 17] and [len(r) for r in one] == [7, 17]
    assert one == by_prefix


def test_other_shapes_restart_from_the_checkpoint(engine, ckpts):
    engine.load_weights(ckpts["wide"])  # intermediate_size 256 -> 384
    assert (engine.stats.reloads, engine.stats.restarts) == (0, 1)
    assert _worst_logp_error(engine, ckpts["wide"]) < 1e-3


def test_unreadable_checkpoint_is_refused_and_the_engine_keeps_serving(engine, ckpts):
    with pytest.raises(EngineLoadError, match="truncated is unusable"):
        engine.load_weights(ckpts["truncated"])
    assert _worst_logp_error(engine, ckpts["a"]) < 1e-3


def test_checkpoint_vllm_cannot_load_is_a_clear_error(engine, ckpts):
    with pytest.raises(EngineLoadError, match=r"extra: tensors differ: .*unexpected "
                                              r"\['model.layers.0.mlp.extra_proj.weight'\].*starting the engine"):
        engine.load_weights(ckpts["extra"])
    with pytest.raises(EngineLoadError, match="closed"):
        engine.generate(PROMPTS, SAMPLE)


def test_min_new_tokens_masks_stop_tokens(engine):
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=6)
    first = [g[0].tokens[0] for g in engine.generate(PROMPTS, greedy)]
    stop = SamplingSpec(temperature=0.0, max_new_tokens=6, stop_token_ids=[first[0]])
    assert engine.generate(PROMPTS[:1], stop)[0][0].tokens == [first[0]]
    forced = SamplingSpec(temperature=0.0, max_new_tokens=6, min_new_tokens=6, stop_token_ids=[first[0]])
    gen = engine.generate(PROMPTS[:1], forced)[0][0]
    assert len(gen.tokens) == 6 and first[0] not in gen.tokens and not gen.is_end


def _held_by_the_worker(worker) -> list:
    """In the worker: the bytes its parameters' storage holds, whether any linear layer can still compute, and the
    bytes its KV cache's storage holds."""
    model = worker.model_runner.model
    from models.engines import in_rank
    from models.engines.in_rank import _discarded

    found: dict = {}
    in_rank._storages(worker.model_runner.kv_caches, found)
    return [sum(p.untyped_storage().nbytes() for p in model.parameters()),
            any(m.__dict__.get("cpu_linear", _discarded) is not _discarded for m in model.modules()),
            sum(s.nbytes() for s in found.values())]


def test_weights_discarded_on_the_cpu_come_back_with_a_full_push(engine, ckpts):
    """A CPU engine that slept discarding its weights (the separate layout's engine service and a colocated rank
    between the rollout and the push: ``models/engines/in_rank.py``) frees every parameter's storage and the linear
    layers' packed copies; once the push (all of the served state, from memory) is in, it samples the same tokens and
    gives the same log-probs, bit for bit, as before it slept; so it does reloaded from its folder instead."""
    import psutil

    from models.engines import in_rank
    from tests.unit.models.engine_tensors import sent_state

    sequences = [[3, 5, 7, 11, 13, 17, 19, 23]]
    before, lp_before = engine.generate(PROMPTS, SAMPLE), engine.prompt_logprobs(sequences)
    _, computes, kv = engine.llm.collective_rpc(_held_by_the_worker)[0]
    assert computes and kv > 0  # awake
    rss = psutil.Process().memory_info().rss
    in_rank.sleep(engine, discard_weights=True)
    assert in_rank.weights_discarded(engine)
    assert engine.llm.collective_rpc(_held_by_the_worker) == [[0, False, 0]]
    assert psutil.Process().memory_info().rss <= rss - kv  # the KV cache's pages went back to the machine (this
    # model's 0.6 MB of weights stay in malloc's arenas; the weights' GiB at the real shape: bench_real_shape.py)
    in_rank.wake(engine, ("weights",))
    engine.load_tensors(sent_state(ckpts["a"])[0])
    in_rank.weights_loaded(engine)
    in_rank.wake(engine, ("kv_cache",))
    assert [[g.tokens for g in p] for p in engine.generate(PROMPTS, SAMPLE)] == [[g.tokens for g in p] for p in before]
    assert engine.prompt_logprobs(sequences) == lp_before and not in_rank.weights_discarded(engine)
    in_rank.sleep(engine, discard_weights=True)  # and asked for a stage before the push: the engine service reloads
    in_rank.wake(engine)  # the state's committed actor from its folder (models/hosts/engine.py, serve)
    engine.load_weights(ckpts["a"])
    in_rank.weights_loaded(engine)
    assert [[g.tokens for g in p] for p in engine.generate(PROMPTS, SAMPLE)] == [[g.tokens for g in p] for p in before]
