"""``loss_mask`` in the actor update: a row left out of the loss moves the weights exactly as if it were
not in the batch (loss, KL and entropy terms, token and sequence counts), on the tiny Llama and on a
Hub-shaped Qwen2 (tied embeddings, grouped-query attention); a minibatch with nothing left takes no
optimizer step."""

from __future__ import annotations

import pytest
import torch

from kernels.losses import PolicyLossConfig
from models.training.policy import PolicyLogprobs
from models.training.update import LoopSettings, UpdateData, actor_loss_fn, make_optimizer, run_update
from tests.unit.models.test_update import CPU, tiny_policy
from tests.unit.models.update_rows import padded_rows

LENGTHS = [(2, 3), (3, 6), (2, 2), (4, 4)]


def _rows() -> UpdateData:
    data = padded_rows(LENGTHS)
    g = torch.Generator().manual_seed(5)
    return data._replace(ref_logp=-torch.rand(data.adv.shape, generator=g) * data.response_mask)


def _policy(source) -> PolicyLogprobs:
    """The tiny Llama, or the checkpoint at ``source`` (its weights as saved, the same every call)."""
    if source is None:
        return tiny_policy()
    from transformers import AutoModelForCausalLM

    return PolicyLogprobs(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32))


@pytest.fixture(params=["tiny_llama", "qwen2_chat"])
def source(request):
    return None if request.param == "tiny_llama" else request.getfixturevalue("qwen2_chat_dir")


def _step(data: UpdateData, cfg: PolicyLossConfig, source=None) -> torch.nn.Module:
    """One SGD step on ``data`` as one minibatch (micro-batches of 2 rows); the moved policy."""
    model = _policy(source)
    run_update(model, torch.optim.SGD(model.parameters(), lr=1.0), data,
               actor_loss_fn(cfg, 1.0, kl_beta=0.1, kl_estimator="k3"),
               LoopSettings(epochs=1, minibatch_size=len(data.input_ids), micro_batch_size=2, grad_clip=1e9,
                            seed=0), CPU)
    return model


@pytest.mark.parametrize("cfg", [PolicyLossConfig(entropy_coef=0.01),
                                 PolicyLossConfig(agg="seq_mean_token_mean", entropy_coef=0.01),
                                 PolicyLossConfig(agg="seq_mean_token_sum_norm", horizon=8, entropy_coef=0.01)],
                         ids=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_a_masked_row_moves_the_weights_as_if_it_were_not_there(cfg, source):
    data = _rows()
    keep = torch.tensor([True, False, True, True])  # row 1 (6 response tokens) left out
    masked = _step(data._replace(loss_mask=keep[:, None].expand_as(data.response_mask)), cfg, source)
    subset = _step(UpdateData(*(None if t is None else t[keep] for t in data)), cfg, source)
    start = _policy(source)
    moved = 0.0
    for (name, a), b, s in zip(masked.named_parameters(), subset.parameters(), start.parameters()):
        step = float((b - s).detach().abs().max())  # lr 1.0 moves some weights by tens: float32 rounds at 1e-6 of that
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(1.0, step), msg=name)
        moved = max(moved, float((a - s).detach().abs().max()))
    assert moved > 1e-4  # the kept rows did move the weights
    everything = _step(data, cfg, source)  # and the masked row would have moved them differently
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(everything.parameters(), masked.parameters()))


def test_a_minibatch_with_nothing_to_learn_takes_no_step():
    """AdamW's moments would move the weights on a zero gradient; the minibatch is skipped instead."""
    model = tiny_policy()
    optimizer = make_optimizer(model, 1e-2)
    loss = actor_loss_fn(PolicyLossConfig(), 1.0)
    settings = LoopSettings(epochs=1, minibatch_size=4, micro_batch_size=4, grad_clip=1e9, seed=0)
    data = _rows()
    assert run_update(model, optimizer, data, loss, settings, CPU)["steps"] == 1  # momentum now nonzero
    after_one = [p.detach().clone() for p in model.parameters()]
    stats = run_update(model, optimizer, data._replace(loss_mask=torch.zeros_like(data.response_mask)), loss,
                       settings, CPU)
    assert stats["steps"] == 0
    for p, q in zip(model.parameters(), after_one):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
