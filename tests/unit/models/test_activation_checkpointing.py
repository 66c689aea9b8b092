"""Activation checkpointing in the update (``actor.activation_checkpointing``, ``critic.*``;
``models/training/distributed.py``): the gradients are the plain forward's, bit for bit (full weights and LoRA, the
actor and the critic), while the forward keeps nothing inside a decoder layer and each layer runs again in the
backward; a model it cannot mark is refused naming the setting. FSDP2 with it on two gloo ranks is
``tests/unit/models/test_sharded_update.py``'s FSDP2 case."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from torch import nn

from models.config import ConfigError
from models.config.critic import CriticConfig
from models.training.distributed import DistInfo, decoder_layers, wrap_for_training
from models.training.policy import CriticValues, PolicyLogprobs
from models.training.update import UpdateData
from tests.unit.models.update_rows import padded_rows

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
ROWS = padded_rows([(2, 3), (3, 6), (1, 5)])


def _lm(lora: bool = False, critic: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, num_labels=1)
    model = (LlamaForTokenClassification if critic else LlamaForCausalLM)(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    return model


def _loss(model: nn.Module, rows: UpdateData, critic: bool) -> torch.Tensor:
    from models.data.batch_tensors import ModelInputs

    inputs = ModelInputs(rows.input_ids, rows.attention_mask, torch.zeros_like(rows.input_ids, dtype=torch.bool),
                         rows.response_positions, rows.response_mask)
    if critic:
        return (model(inputs) * rows.response_mask).pow(2).sum()
    logp, ent = model(inputs)
    return logp.sum() + 0.1 * ent.sum()


def _step(checkpointed: bool, lora: bool = False, critic: bool = False) -> Dict[str, object]:
    """One forward and backward of the tiny model, wrapped for one process; its gradients, the tensors saved for the
    backward while inside a decoder layer's forward, and the layers' forward calls."""
    inner = _lm(lora, critic)
    model = wrap_for_training(CriticValues(inner) if critic else PolicyLogprobs(inner), CPU,
                              activation_checkpointing=checkpointed)
    model.train()
    inside, saved, calls = [0], [0], [0]

    def enter(*_):
        inside[0] += 1
        calls[0] += 1

    def leave(*_):
        inside[0] -= 1

    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)

    def pack(t):
        saved[0] += bool(inside[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model, ROWS, critic)
    forward_calls = calls[0]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"grads": grads, "saved_inside": saved[0], "forward_calls": forward_calls, "calls": calls[0]}


@pytest.mark.parametrize("lora,critic", [(False, False), (True, False), (False, True)],
                         ids=["full", "lora", "critic"])
def test_gradients_are_the_plain_forwards_and_no_layer_keeps_its_activations(lora, critic):
    plain, checkpointed = _step(False, lora, critic), _step(True, lora, critic)
    assert set(plain["grads"]) == set(checkpointed["grads"]) and plain["grads"]
    for name, want in plain["grads"].items():
        assert torch.equal(checkpointed["grads"][name], want), name  # the same operations, recomputed
    assert plain["saved_inside"] > 0 and checkpointed["saved_inside"] == 0
    layers = 2
    assert plain["forward_calls"] == checkpointed["forward_calls"] == layers
    assert (plain["calls"], checkpointed["calls"]) == (layers, 2 * layers)  # each layer again in the backward


def test_eval_forwards_are_left_alone():
    """Scoring (eval mode, no gradients) runs each layer once, checkpointing on or off."""
    model = wrap_for_training(PolicyLogprobs(_lm()), CPU, activation_checkpointing=True).eval()
    calls: List[int] = []
    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        _loss(model, ROWS, critic=False)
    assert len(calls) == 2


def test_a_model_without_decoder_layers_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="actor.activation_checkpointing"):
        wrap_for_training(CriticValues(nn.Linear(4, 1)), CPU, activation_checkpointing=True)


def test_the_critic_server_refuses_it():
    with pytest.raises(ConfigError, match="critic.activation_checkpointing needs the critic inside the tasks"):
        CriticConfig(activation_checkpointing=True, remote_url="http://critic:8000")
