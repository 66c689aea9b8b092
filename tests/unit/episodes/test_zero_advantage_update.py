"""An actor update on multi-turn episodes whose advantages are all 0 (GRPO when every sample of a
prompt scores the same) must leave the policy where it is, on the Qwen2-shaped chat checkpoint.

The tool demo's run drifted instead (docs/multi_turn.md, "Why the KL rose with zero advantages"):
the only gradient left is the k3 KL term's, ``β·(1 − π_ref/π)·∇log π``, ~1e-13 per weight when π_old
and π_ref differ by float rounding (the trainer pads micro-batches unlike the scorer). AdamW turns a
gradient far below its ε (1e-8) into plain gradient descent at lr/ε = 5e4 times the gradient, which
overshoots the KL's minimum and grows the gap ~10x per step until the steps are lr-sized; the
policy then drifted ~0.1 nats per token from π_ref whatever ``kl.coef``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kernels.kl import kl_penalty
from models.environments.chat_tokens import ChatTokens
from models.training.distributed import DistInfo
from models.training.policy import PolicyLogprobs
from models.demos.tool_demo import demonstration_ids
from models.demos.tool_tasks import ArithmeticEnv, problems
from models.training.update import LoopSettings, actor_loss_fn, disable_dropout, make_optimizer, run_update
from kernels.losses import PolicyLossConfig
from models.data.batch import BatchMetadata, RolloutBatch
from models.stages.actor import _ACTOR_COLS
from models.stages.updates import update_data
from tests.unit.models.hub_copies import hf_logprobs

ROWS, LR, BETA = 8, 5e-4, 0.01


def _episodes(ckpt):
    """Calculator episodes (call, tool result, answer) of the demo, as rows: the first prompt, the rest,
    ``loss_mask`` on the assistant turns, and the model's own log-probs as π_old = π_ref (one row per
    forward, as the scorer's batching differs from the trainer's)."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    lm = disable_dropout(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32))
    chat = ChatTokens(tok, [t.schema() for t in ArithmeticEnv.tools])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts, responses, masks, logps = [], [], [], []
    for row in problems(ROWS, seed=3):
        ids, labels = demonstration_ids(chat, row, im_end)
        n = len(chat.first_prompt(ArithmeticEnv(row).start()))
        prompts.append(ids[:n])
        responses.append(ids[n:])
        masks.append([lab != -100 for lab in labels[n:]])
        logps.append(hf_logprobs(lm.eval(), ids[:n], ids[n:]))
    batch = RolloutBatch.from_columns(
        BatchMetadata(iteration=0, policy_version=0, algorithm="grpo"), prompt_id=list(range(ROWS)),
        prompt_tokens=prompts, response_tokens=responses, sampler_logprobs=logps, is_end=[True] * ROWS,
        old_logprobs=logps, ref_logprobs=logps, reward=[0.0] * ROWS, loss_mask=masks,
        advantages=[[0.0] * len(r) for r in responses])
    return lm, update_data(batch, tok.pad_token_id, _ACTOR_COLS, (0, 1))


def _policy_token_k3(model, data) -> float:
    """Mean k3 KL(π ‖ π_ref) over the tokens the policy sampled."""
    with torch.no_grad():
        logp, _ = model.eval()(data, temperature=1.0, with_entropy=False)
    return float(kl_penalty(logp, data.ref_logp, "k3")[data.loss_tokens].mean())


def test_zero_advantages_leave_the_policy_at_the_reference(qwen2_chat_dir):
    lm, data = _episodes(qwen2_chat_dir)
    assert 0 < data.loss_tokens.sum() < data.response_mask.sum()  # tool and template tokens are masked
    model = PolicyLogprobs(lm)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = make_optimizer(model, LR)
    loss = actor_loss_fn(PolicyLossConfig(kind="ppo"), 1.0, kl_beta=BETA, kl_estimator="k3")
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    steps = [run_update(model, optimizer, data, loss, LoopSettings(2, ROWS // 2, ROWS // 2, 1.0, i), info)["steps"]
             for i in range(3)]  # three updates of 2 epochs x 2 minibatches, the optimizer carried over
    print("k3 per policy token after the updates:", _policy_token_k3(model, data))
    assert _policy_token_k3(model, data) < 1e-9
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert steps == [0, 0, 0]  # no advantage anywhere: nothing to learn, no step


def test_the_logged_kl_is_over_policy_tokens(qwen2_chat_dir):
    """Where one advantage is non-zero the minibatch steps, and its logged ``ref_kl`` is the k3 mean over
    the policy's tokens, worked out here from the trainer's own log-probs (not over the tool's)."""
    lm, data = _episodes(qwen2_chat_dir)
    torch.manual_seed(0)
    tool_tokens = data.response_mask & ~data.loss_tokens
    ref = data.ref_logp + 0.05 * torch.randn_like(data.ref_logp) - tool_tokens.float()  # away from the policy,
    # by a nat on the tool's tokens (as in the demo's run, where they carried most of the logged KL)
    adv = torch.zeros_like(data.adv)
    adv[0, data.loss_tokens[0].nonzero()[0]] = 1.0
    data = data._replace(ref_logp=ref, adv=adv)
    model = PolicyLogprobs(lm)
    with torch.no_grad():
        logp, _ = model.eval()(data, temperature=1.0, with_entropy=False)
    k3 = kl_penalty(logp, ref, "k3")  # [N, T]
    expected = float(k3[data.loss_tokens].mean())
    everywhere = float(k3[data.response_mask].mean())
    assert everywhere > 2 * expected  # the tool tokens would change it
    stats = run_update(model, make_optimizer(model, 0.0), data,
                       actor_loss_fn(PolicyLossConfig(kind="ppo"), 1.0, kl_beta=BETA, kl_estimator="k3"),
                       LoopSettings(1, ROWS, ROWS, 1.0, 0), DistInfo(0, 1, 0, torch.device("cpu")))
    assert stats["steps"] == 1
    assert stats["ref_kl"] == pytest.approx(expected, rel=1e-4)
