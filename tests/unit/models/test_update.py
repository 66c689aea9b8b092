"""The update loop (models/update.py): micro-batches cut from length-sorted rows give the gradient of
the whole minibatch, with less padding than rows taken in their stored order."""

from __future__ import annotations

import torch

from kernels.losses import PolicyLossConfig
from models.distributed import DistInfo
from models.policy import PolicyLogprobs
from models.update import LoopSettings, UpdateData, actor_loss_fn, run_update

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
LENGTHS = [(2, 1), (3, 6), (2, 2), (4, 4)]  # (prompt, response) tokens per row: 3, 9, 4, 8 in all


def tiny_policy() -> PolicyLogprobs:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return PolicyLogprobs(LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=2, max_position_embeddings=32)))


def rows() -> UpdateData:
    """Right-padded rows of LENGTHS with random tokens, log-probs and advantages."""
    g = torch.Generator().manual_seed(1)
    n, L, T = len(LENGTHS), max(p + r for p, r in LENGTHS), max(r for _, r in LENGTHS)
    ids, att = torch.zeros(n, L, dtype=torch.long), torch.zeros(n, L, dtype=torch.long)
    pos, mask = torch.zeros(n, T, dtype=torch.long), torch.zeros(n, T, dtype=torch.bool)
    for b, (p, r) in enumerate(LENGTHS):
        ids[b, :p + r] = torch.randint(1, 16, (p + r,), generator=g)
        att[b, :p + r] = 1
        pos[b] = torch.clamp(p + torch.arange(T), max=L - 1)  # each response token's place (padding: clamped)
        mask[b, :r] = True
    old = -torch.rand(n, T, generator=g) * mask
    adv = torch.randn(n, T, generator=g) * mask
    return UpdateData(ids, att, pos, mask, old_logp=old, adv=adv)


def one_step(micro_batch_size: int, widths: list) -> PolicyLogprobs:
    model = tiny_policy()
    base = actor_loss_fn(PolicyLossConfig(), 1.0)

    def loss_fn(m, micro, tokens, seqs):
        widths.append(micro.input_ids.shape[1])
        return base(m, micro, tokens, seqs)

    run_update(model, torch.optim.SGD(model.parameters(), lr=1.0), rows(), loss_fn,
               LoopSettings(epochs=1, minibatch_size=4, micro_batch_size=micro_batch_size, grad_clip=1e9, seed=0), CPU)
    return model


def test_micro_batches_give_the_whole_minibatch_gradient_with_less_padding():
    whole_widths, micro_widths = [], []
    whole = one_step(4, whole_widths)  # one forward over the 4 rows: the reference
    micro = one_step(2, micro_widths)
    assert whole_widths == [9]
    assert micro_widths == [4, 9]  # rows of 3 and 4 tokens, then 8 and 9: 26 padded tokens, not 34 or 36
    moved = 0.0
    for (name, w), m, start in zip(whole.named_parameters(), micro.parameters(), tiny_policy().parameters()):
        torch.testing.assert_close(m, w, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, float((w - start).detach().abs().max()))
    assert moved > 1e-3  # the step did something to compare
