"""Pad-free forwards (models/training/packing.py, models/training/policy.py ``packed``): the plan against hand-worked
costs, the packed layout, and packed forwards and updates against padded ones."""

from __future__ import annotations

import copy

import pytest
import torch

from models.training import packing
from models.training.distributed import DistInfo
from models.training.policy import CriticValues, PolicyLogprobs, packing_supported, with_packing
from models.training.update import (LoopSettings, UpdateData, actor_loss_fn, critic_loss_fn, disable_dropout, make_optimizer,
                           run_update)
from kernels.losses import PolicyLossConfig
from tests.unit.models.update_rows import padded_rows

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
LENGTHS = [(3, 2), (2, 6), (4, 1), (2, 2), (5, 4), (1, 3)]  # (prompt, response): 5, 8, 5, 4, 9, 4 tokens


def llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, max_position_embeddings=32, **kw)


def policy(packed: bool) -> PolicyLogprobs:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return PolicyLogprobs(LlamaForCausalLM(llama_config()), packed=packed)


def critic(packed: bool) -> CriticValues:
    from transformers import LlamaForTokenClassification

    torch.manual_seed(0)  # (HF's token-classification head has dropout 0.1 unless disabled, as updates do)
    return CriticValues(disable_dropout(LlamaForTokenClassification(llama_config(num_labels=1))), packed=packed)


def rows() -> UpdateData:
    return padded_rows(LENGTHS)


def test_plan_takes_the_cheapest_pack_count_worked_by_hand():
    # A slot costs 8H + width with dense attention, 8H with flash. Lengths 5, 3, 3:
    # H=1: padded 15 slots x (8 + 5) = 195; 2 packed rows {5}, {3, 3}: 12 x 14 = 168; 1 row: 11 x 19 = 209
    assert packing.plan([5, 3, 3], hidden_size=1) == [[0], [1, 2]]
    # flash attention: 2 rows 12 x 8 = 96, 1 row 11 x 8 = 88
    assert packing.plan([5, 3, 3], hidden_size=1, dense_attention=False) == [[0, 1, 2]]
    # H=64: padded 15 x 517 = 7755, 2 rows 12 x 518 = 6216, 1 row 11 x 523 = 5753
    assert packing.plan([5, 3, 3], hidden_size=64) == [[0, 1, 2]]
    # equal lengths: every plan costs at least padding's 8 x (8H + 4)
    assert packing.plan([4, 4], hidden_size=64) is None
    assert packing.plan([7], hidden_size=64) is None


def test_deal_gives_the_longest_rows_to_the_emptiest_pack():
    members, width = packing.deal([9, 8, 5, 4, 3, 1], 2)
    # 9 -> A, 8 -> B, 5 -> B (8 < 9), 4 -> A (9 < 13), 3 -> A (13 = 13: the lower pack index), 1 -> B
    assert members == [[0, 3, 4], [1, 2, 5]]
    assert width == 16


def test_pack_layout():
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    pk = packing.pack(ids, [3, 2, 4], [[2], [0, 1]])
    assert pk.input_ids.tolist() == [[6, 7, 8, 9, 0], [1, 2, 3, 4, 5]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert pk.starts.tolist() == [5, 8, 0]
    out = torch.arange(10).view(2, 5) * 10  # a "forward output" per slot
    assert packing.read_back(out, pk, torch.tensor([[0, 2], [1, 1], [3, 0]])).tolist() == [[50, 70], [90, 90],
                                                                                          [30, 0]]


def test_packed_forwards_equal_padded_ones_values_and_gradients():
    data = rows()
    assert packing.plan(data.attention_mask.sum(1).tolist(), 16) is not None  # the packed path is taken
    for make, run in ((policy, lambda m: m(data)[0] + m(data)[1]), (critic, lambda m: m(data))):
        padded, packed = make(False), make(True)
        a, b = run(padded), run(packed)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert float(a.detach().abs().sum()) > 0
        (a * torch.randn_like(a, generator=torch.Generator().manual_seed(2))).sum().backward()
        (b * torch.randn_like(b, generator=torch.Generator().manual_seed(2))).sum().backward()
        for (name, p), q in zip(padded.named_parameters(), packed.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_updates_equal_padded_updates():
    data = rows()
    settings = LoopSettings(epochs=2, minibatch_size=4, micro_batch_size=2, grad_clip=1.0, seed=3)
    for make, loss in ((policy, actor_loss_fn(PolicyLossConfig(), 1.0)), (critic, critic_loss_fn(0.2))):
        models = [make(False), make(True)]
        stats = [run_update(m, make_optimizer(m, 1e-2), data, loss, settings, CPU) for m in models]
        assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], rel=1e-4)
        moved = 0.0
        for p, q, fresh in zip(models[0].parameters(), models[1].parameters(), make(False).parameters()):
            # AdamW divides by sqrt(v): rounding differences of the packed sums can move a weight whose
            # gradient is near zero by a small fraction of lr (2e-5 = 0.2% of lr seen on an AMD EPYC);
            # a wrong packing would differ by O(lr), and the update must move weights by more than 1e-3 below
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-4)
            moved = max(moved, float((p.detach() - fresh.detach()).abs().max()))
        assert moved > 1e-3


def test_a_model_whose_attention_mixes_packed_rows_is_refused(capsys, monkeypatch):
    """A trunk that drops the position ids (so one causal mask spans the packed row) fails the check;
    with_packing then pads, and says so (once)."""
    import models.training.policy

    monkeypatch.setattr(models.training.policy, "_SAID_PADS", set())  # whatever earlier tests of this process said
    good = policy(False)
    assert packing_supported(good) and packing_supported(critic(False))

    class IgnoresPositions(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.config = inner.config

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    bad = copy.deepcopy(good)
    bad.lm.model = IgnoresPositions(bad.lm.model)
    assert not packing_supported(bad)
    assert not with_packing(bad, True).packed
    assert "does not keep packed rows apart" in capsys.readouterr().out
    assert not with_packing(bad, True).packed
    assert capsys.readouterr().out == ""  # said once per process and model class, not at every task
    assert with_packing(good, True).packed and not with_packing(policy(False), False).packed
    assert bad.training  # the check left the training mode as it found it


def test_the_packing_check_runs_once_per_model_structure(monkeypatch):
    """The verdict is checked once per process for a model's structure and configuration (its forwards gathered the
    whole model at every load of a sharded reference): a second model alike reuses it, another structure or dtype
    is checked anew."""
    import models.training.policy as policy_module
    from models.training import packing as packing_module

    monkeypatch.setattr(policy_module, "_PACKING", {})
    calls = []
    real = packing_module.packing_works
    monkeypatch.setattr(packing_module, "packing_works", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    first = policy(False)
    assert policy_module.known_packing(first) is None
    assert with_packing(first, True).packed and len(calls) == 1
    assert policy_module.known_packing(policy(False)) is True
    assert with_packing(policy(False), True).packed and len(calls) == 1  # the same structure: not checked again
    assert with_packing(critic(False), True).packed and len(calls) == 2  # another wrapper and model
    assert with_packing(policy(False).double(), True).packed and len(calls) == 3  # another dtype
