"""HFEngine: weights swapped in place when the layout matches, by a restart when it does not,
an unusable checkpoint refused with the engine left as it was; min_new_tokens masks stop tokens.

The reference for "serves checkpoint X" is a fresh engine started on X (same code path
``from_pretrained``), compared on greedy tokens and their log-probs.
"""

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
