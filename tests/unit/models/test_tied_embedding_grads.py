"""A tied input embedding's gradient in the update (``models.training.distributed.sparse_tied_embedding_grads``):
the embedding gives a sparse gradient (the rows of the batch's tokens) that autograd adds to the head's dense one,
so its backward makes no dense ``[vocab, hidden]`` gradient of its own beside the head's and their sum; the
weight's gradient is the plain model's dense one (to float32 rounding: the rows of repeated tokens are summed in
another order), every other gradient bit for bit; an untied embedding, or a model that does not train, keeps its
dense gradient. Two FSDP2 ranks train with it in ``tests/unit/models/test_sharded_update.py`` (the same weights as
one process)."""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from models.training.distributed import DistInfo, sparse_tied_embedding_grads, wrap_for_training
from models.training.policy import PolicyLogprobs
from tests.unit.models.test_activation_checkpointing import ROWS, _loss

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
VOCAB, HIDDEN = 64, 16


def _lm(tied: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


class NewWeightSized(TorchDispatchMode):
    """The ops that make a new tensor of the embedding's ``[vocab, hidden]`` shape (in-place ops not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if (isinstance(out, torch.Tensor) and tuple(out.shape) == (VOCAB, HIDDEN) and not out.is_sparse
                and not name.endswith("_") and name not in ("detach", "view", "alias", "t", "transpose")):
            self.made.append(name)
        return out


def _backward(model: nn.Module) -> Dict[str, object]:
    model.train()
    loss = _loss(model, ROWS, critic=False)
    with NewWeightSized() as mode:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"grads": grads, "made": mode.made}


def test_a_tied_embedding_makes_no_second_dense_gradient_and_the_gradients_are_the_dense_ones():
    plain = _backward(PolicyLogprobs(_lm(tied=True)))  # not wrapped: the dense embedding gradient
    wrapped_model = wrap_for_training(PolicyLogprobs(_lm(tied=True)), CPU)
    assert wrapped_model.lm.get_input_embeddings().sparse
    wrapped = _backward(wrapped_model)
    # the plain backward makes the head's gradient, the embedding's, and their sum; the wrapped one no embedding's
    assert plain["made"] == ["mm", "embedding_dense_backward", "add"], plain["made"]
    assert wrapped["made"] == ["mm", "add"], wrapped["made"]
    assert plain["grads"].keys() == wrapped["grads"].keys()
    embedding = "lm.model.embed_tokens.weight"
    for name, grad in wrapped["grads"].items():
        assert not grad.is_sparse and grad.layout == torch.strided, name
        if name != embedding:
            assert torch.equal(grad, plain["grads"][name]), name
    # the tied weight's: the same sums, the rows of repeated tokens added in another order (float32 rounding)
    torch.testing.assert_close(wrapped["grads"][embedding], plain["grads"][embedding], rtol=1e-6, atol=1e-6)
    assert not torch.equal(wrapped["grads"][embedding], torch.zeros_like(wrapped["grads"][embedding]))


def test_an_untied_embedding_and_a_frozen_model_keep_the_dense_gradient():
    untied = PolicyLogprobs(_lm(tied=False))
    assert not sparse_tied_embedding_grads(untied) and not untied.lm.get_input_embeddings().sparse
    frozen = PolicyLogprobs(_lm(tied=True)).requires_grad_(False)
    assert not sparse_tied_embedding_grads(frozen)
    scored = wrap_for_training(PolicyLogprobs(_lm(tied=True)), CPU, frozen=True)
    assert not scored.lm.get_input_embeddings().sparse
