"""PolicyLogprobs: the chunked-from-hidden path (large logits) and the plain path agree, values and gradients."""

from __future__ import annotations

import torch

from models.training import policy
from models.data.batch_tensors import model_inputs
from models.demos.tiny import TinyModelConfig, build_actor
from models.demos.tokenizer import build_char_tokenizer


def _inputs(tok):
    import pyarrow as pa

    prompts = [tok.encode("abcd=", add_special_tokens=False), tok.encode("xy=", add_special_tokens=False)]
    responses = [tok.encode("dcba", add_special_tokens=False), tok.encode("yxz", add_special_tokens=False)]
    table = pa.table({"prompt_tokens": prompts, "response_tokens": responses})
    return model_inputs(table, tok.pad_token_id or 0)


def _run(model, inputs):
    model.zero_grad(set_to_none=True)
    logp, ent = model(inputs, temperature=0.7)
    (logp.sum() + 0.1 * ent.sum()).backward()
    return logp.detach(), ent.detach(), model.lm.lm_head.weight.grad.clone()


def test_from_hidden_path_equals_plain_logits(monkeypatch):
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = policy.PolicyLogprobs(build_actor(TinyModelConfig(), tok).float())
    inputs = _inputs(tok)
    monkeypatch.setattr(policy, "FROM_HIDDEN_MIN_LOGITS", 1 << 62)  # never: whole logits
    plain = _run(model, inputs)
    monkeypatch.setattr(policy, "FROM_HIDDEN_MIN_LOGITS", 0)  # always: vocabulary chunks from the hidden states
    chunked = _run(model, inputs)
    for a, b in zip(plain, chunked):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert plain[0].abs().sum() > 0 and plain[2].abs().sum() > 0  # (not vacuous: real values and gradients)


def test_autocast_runs_both_paths_in_bfloat16_on_float32_weights(monkeypatch):
    """``autocast_dtype`` (bfloat16 compute on float32 master weights, as ``model.dtype=bfloat16``
    trains without FSDP2): both paths give float32 log-probs and float32 gradients, within bfloat16's
    error of the float32 forward and not equal to it (the compute was bfloat16)."""
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = policy.PolicyLogprobs(build_actor(TinyModelConfig(), tok).float())
    inputs = _inputs(tok)
    exact = _run(model, inputs)
    model.autocast_dtype = torch.bfloat16
    for threshold in (1 << 62, 0):  # whole logits, then vocabulary chunks from the hidden states
        monkeypatch.setattr(policy, "FROM_HIDDEN_MIN_LOGITS", threshold)
        got = _run(model, inputs)
        assert [t.dtype for t in got] == [torch.float32] * 3
        assert model.lm.lm_head.weight.dtype == torch.float32
        for a, b in zip(got, exact):
            torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
        assert (got[0] - exact[0]).abs().max() > 1e-4
