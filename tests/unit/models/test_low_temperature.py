"""GRPO at ``rollout.temperature=0.1`` (the lowest accepted): every log-prob of a sample is taken at the
temperature it was sampled at, and the k3 KL term stays bounded where the policy has moved a sampled
token far below π_ref (kernels/kl.py: 1/τ turns a 3-logit move into 30 nats, e^30 ≈ 1e13)."""

from __future__ import annotations

import math

import torch

from kernels.kl import K3_EXP_LIMIT
from kernels.losses import PolicyLossConfig
from models.data.batch_tensors import ModelInputs
from models.training.scoring import score_microbatches
from models.training.update import actor_loss_fn
from tests.unit.models.test_sharded_update import LENGTHS, policy
from tests.unit.models.update_rows import padded_rows

T, BETA = 0.1, 0.04


def hand_logprobs(lm, data, temperature: float = T) -> torch.Tensor:
    """log_softmax(logits / temperature) of each response token, one row at a time on the whole logits ``[L, V]``."""
    out = torch.zeros(data.response_mask.shape)
    for b in range(len(data.input_ids)):
        L = int(data.attention_mask[b].sum())
        with torch.no_grad():
            logp = torch.log_softmax(lm(data.input_ids[b:b + 1, :L]).logits[0].double() / temperature, -1)  # [L, V]
        for t in range(int(data.response_mask[b].sum())):
            pos = int(data.response_positions[b, t])
            out[b, t] = float(logp[pos - 1, data.input_ids[b, pos]])
    return out


def test_scorer_and_trainer_take_every_logprob_at_the_sampling_temperature():
    model, data = policy(), padded_rows(LENGTHS)
    want = hand_logprobs(model.lm, data)
    m = data.response_mask
    assert float((want - hand_logprobs(model.lm, data, 1.0))[m].abs().max()) > 1  # a wrong τ would show
    is_response = torch.zeros_like(data.input_ids, dtype=torch.bool).scatter_(1, data.response_positions, m)
    inputs = ModelInputs(data.input_ids, data.attention_mask, is_response, data.response_positions, m)
    flat = score_microbatches([inputs], actor=model.eval(), reference=model, temperature=T)
    for key in ("old_logprobs", "ref_logprobs"):
        torch.testing.assert_close(torch.from_numpy(flat[key]), want[m], rtol=0, atol=2e-5)
    seen = {}

    def spy(inputs, temperature, with_entropy):  # the trainer's forward, as actor_loss_fn calls it
        seen["logp"], ent = model(inputs, temperature=temperature, with_entropy=with_entropy)
        return seen["logp"], ent

    actor_loss_fn(PolicyLossConfig(), T, BETA, "k3")(spy, data._replace(ref_logp=want), 1.0, 1.0)
    torch.testing.assert_close(seen["logp"].detach()[m], want[m], rtol=0, atol=2e-5)


def test_a_token_30_nats_below_the_reference_keeps_the_loss_bounded():
    """π_ref gives one token 30 nats more than π_θ (what one iteration at τ=0.1 did on the tiny task):
    the loss is the k3 tangent's, not β·e^30/N ≈ 4e10, and its gradient stays finite and small."""
    model, data = policy(), padded_rows(LENGTHS)
    with torch.no_grad():
        logp, _ = model.eval()(data, temperature=T, with_entropy=False)
    ref = logp.clone()
    ref[0, 0] += 30.0
    zero_adv = torch.zeros_like(data.adv)
    m = data._replace(old_logp=logp, ref_logp=ref, adv=zero_adv)
    n = float(data.response_mask.sum())
    model.train()
    loss, stats = actor_loss_fn(PolicyLossConfig(entropy_coef=0.0), T, BETA, "k3")(model, m, n, 1.0)
    e = math.expm1(K3_EXP_LIMIT)
    tangent = e - K3_EXP_LIMIT + e * (30.0 - K3_EXP_LIMIT)  # k3 at lr = -30, every other token's k3 is ~0
    assert abs(float(loss.detach()) - BETA * tangent / n) < 1e-3 * BETA * tangent / n
    assert float(stats["ref_kl"]) < 1e5 and float(loss.detach()) < 1e3
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    assert math.isfinite(float(norm)) and float(norm) < 1e6
