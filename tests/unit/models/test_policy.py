"""PolicyLogprobs: the chunked-from-hidden path (large logits) and the plain path agree, values and gradients."""

from __future__ import annotations

import torch

from models import policy
from models.batch_tensors import model_inputs
from models.tiny import TinyModelConfig, build_actor
from models.tokenizer import build_char_tokenizer


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
