"""The update loop (models/training/update.py): micro-batches cut from length-sorted rows give the gradient of
the whole minibatch, with less padding than rows taken in their stored order; the fused AdamW;
no dropout in updates."""

from __future__ import annotations

import pytest
import torch

from kernels.losses import PolicyLossConfig
from models.training.distributed import DistInfo
from models.training.policy import PolicyLogprobs
from models.training.update import LoopSettings, UpdateData, actor_loss_fn, run_update, stat_keys
from tests.unit.models.update_rows import padded_rows

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
LENGTHS = [(2, 1), (3, 6), (2, 2), (4, 4)]  # (prompt, response) tokens per row: 3, 9, 4, 8 in all


def tiny_policy() -> PolicyLogprobs:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return PolicyLogprobs(LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=2, max_position_embeddings=32)))


def rows() -> UpdateData:
    return padded_rows(LENGTHS)


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
    # the spent gradients are freed with the update: a resident trainer holds no copy of them until the next one
    assert all(p.grad is None for p in list(whole.parameters()) + list(micro.parameters()))


def test_optimizer_is_fused_and_steps_as_torchs_adamw():
    """make_optimizer takes the fused AdamW where the device has it; its steps equal the default
    (multi-tensor) AdamW's up to rounding, with weight decay and over several steps."""
    from models.training.update import make_optimizer

    fused_model, ref_model = tiny_policy(), tiny_policy()
    fused = make_optimizer(fused_model, 1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    assert fused.defaults["fused"] is True
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p, q in zip(fused_model.parameters(), ref_model.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        fused.step()
        ref.step()
    moved = max(float((p - q).abs().max()) for p, q in zip(fused_model.parameters(), tiny_policy().parameters()))
    assert moved > 1e-3  # the steps did move the weights
    for p, q in zip(fused_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_optimizer_falls_back_where_no_fused_kernel():
    """Parameters on a device without the fused kernel (here ``meta``) get the default AdamW."""
    from models.training.update import make_optimizer

    model = torch.nn.Linear(4, 4, device="meta")
    opt = make_optimizer(model, 1e-3)
    assert not opt.defaults["fused"]
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())


def test_updates_train_without_dropout_except_loras():
    """HF's token-classification head drops 10% of the hidden state in training; an update's model has
    no dropout (two training-mode forwards agree), while a LoRA adapter keeps its configured dropout."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForTokenClassification

    from models.training.update import disable_dropout

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, num_labels=1)
    critic = LlamaForTokenClassification(cfg).train()
    ids = torch.randint(0, 16, (2, 5))
    assert not torch.equal(critic(input_ids=ids).logits, critic(input_ids=ids).logits)  # dropout as loaded
    disable_dropout(critic)
    torch.testing.assert_close(critic(input_ids=ids).logits, critic(input_ids=ids).logits, rtol=0, atol=0)
    peft = get_peft_model(LlamaForTokenClassification(cfg),
                          LoraConfig(r=2, lora_dropout=0.3, target_modules=["q_proj"], task_type="TOKEN_CLS"))
    disable_dropout(peft)
    rates = {n: m.p for n, m in peft.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert rates and all(p == (0.3 if "lora_dropout" in n else 0.0) for n, p in rates.items())
    assert any("lora_dropout" in n for n in rates)


def test_old_logprobs_from_the_update_forward_equal_a_recomputed_pi_old():
    """``actor.old_logprobs=update``: π_old taken from the update's own forward (detached) trains one step exactly as
    π_old recomputed beforehand by the same model does (the score's forward it saves), and the sampler's gap to it,
    mean and max over the response tokens, is what the update reports."""
    data = rows()
    sampler = data.response_mask * (-torch.rand(data.response_mask.shape, generator=torch.Generator().manual_seed(5)))
    data = data._replace(sampler_logp=sampler)
    model = tiny_policy()
    with torch.no_grad():
        recomputed, _ = model.eval()(data, temperature=1.0, with_entropy=False)
    settings = LoopSettings(epochs=1, minibatch_size=4, micro_batch_size=2, grad_clip=1e9, seed=0)
    models, stats = [], []
    for old_from_forward, old in ((False, recomputed), (True, torch.full_like(recomputed, 7.0))):  # 7: never read
        m = tiny_policy()
        stats.append(run_update(m, torch.optim.SGD(m.parameters(), lr=1.0), data._replace(old_logp=old),
                                actor_loss_fn(PolicyLossConfig(), 1.0, old_from_forward=old_from_forward), settings,
                                CPU))
        models.append(m)
    for (name, want), got in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
    assert stats[1]["loss"] == pytest.approx(stats[0]["loss"], rel=1e-5)
    gap = (sampler - recomputed).abs()[data.response_mask]
    assert stats[1]["rollout/logprob_gap_max"] == pytest.approx(float(gap.max()), rel=1e-5)
    assert stats[1]["rollout/logprob_gap_mean"] == pytest.approx(float(gap.mean()), rel=1e-5)
    assert "rollout/logprob_gap_max" not in stats[0]  # recomputed: the score measures it
    assert stat_keys("actor", stats[1])["rollout/logprob_gap_max"] == stats[1]["rollout/logprob_gap_max"]
