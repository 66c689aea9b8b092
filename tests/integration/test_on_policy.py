"""The rollout samples from the policy the trainer trains, on checkpoints shaped like the Hub's:
three PPO iterations on the Qwen2-shaped model (tied embeddings) and three GRPO iterations on the
Llama-shaped one (no pad token), at actor.lr 1e-3, on both engines, full fine-tuning and LoRA with
``lm_head`` among the targets (vLLM adapts ``lm_head`` on Llama; on Qwen2 it serves the merged,
untied model), every iteration's ``rollout/logprob_gap_max`` (sampler vs π_old over the whole
batch) and the probe's gap below 1e-3 nats in float32.

The bound means something only if the policy moved: the final actor must differ from the
reference by more than 1e-2 nats on the probe sequences, so an engine left on older weights would
show. Engines stay cached across the cases of one model (in-place reloads from one run's last actor
to the next run's reference), as they do across iterations."""

from __future__ import annotations

import math

import pytest

from models.engines import _CACHE, close_engines
from models.training.probe import compare_policies
from models.checkpoint.local import local_checkpoint
from tests.hub_runs import hub_run, iterate

pytestmark = pytest.mark.integration
TOL = 1e-3
LORA = ["actor.lora.rank=8", "actor.lora.alpha=16",
        "actor.lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head]"]
CASES = [  # (algorithm, model, engine, LoRA mode or "" for full fine-tuning)
    ("ppo", "qwen2", "vllm", ""), ("ppo", "qwen2", "vllm", "merged"),
    ("ppo", "qwen2", "hf", ""), ("ppo", "qwen2", "hf", "adapter"),
    ("grpo", "llama", "vllm", ""), ("grpo", "llama", "vllm", "adapter"),
    ("grpo", "llama", "hf", ""), ("grpo", "llama", "hf", "merged"),
]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    close_engines()


@pytest.mark.parametrize("algorithm, model, engine, lora", CASES, ids=["-".join(c).rstrip("-") for c in CASES])
def test_sampler_matches_the_trainer_for_three_iterations(algorithm, model, engine, lora, qwen2_chat_dir,
                                                         llama_bpe_dir, tmp_path, capsys):
    if engine == "vllm":
        pytest.importorskip("vllm")
    path = {"qwen2": qwen2_chat_dir, "llama": llama_bpe_dir}[model]
    overrides = [f"rollout.engine={engine}"] + (LORA + [f"rollout.lora_mode={lora}"] if lora else [])
    preset = "tiny_ppo" if algorithm == "ppo" else "tiny_grpo"
    with hub_run(tmp_path, path, preset, overrides, "on-policy") as (cfg, run, state):
        stats = iterate(cfg, run, state, 3)
        final = run.layout.read_state().actor_url
    for i, s in enumerate(stats):
        assert s["rollout/logprob_gap_max"] < TOL, (i, s["rollout/logprob_gap_max"])
        assert s["rollout/probe_gap_max"] < TOL, (i, s["rollout/probe_gap_max"])
        assert math.isfinite(s["rollout/logprob_gap_mean"])
        # an iteration whose every advantage is 0 (GRPO, all samples of each prompt scored alike)
        # takes no actor step and logs no loss; the others log a finite one
        assert s["actor/steps"] == 0 or math.isfinite(s["actor/loss"]), s
    assert any(s["actor/steps"] > 0 for s in stats), "no iteration trained: the bound would prove nothing"
    moved = compare_policies(local_checkpoint(run.reference_url), local_checkpoint(final), local_checkpoint)
    assert moved.gap_max > 1e-2, moved  # three updates changed the policy: a stale engine would show
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"[{algorithm}] iter ")]
    assert len(lines) == 3 and all(" gap " in line for line in lines), lines
    if engine == "vllm" and lora != "adapter":  # new weights every iteration (adapter mode: new adapters)
        served = _CACHE["policy"].engine.stats
        assert served.reloads >= 1, served  # in place at least once (the merged, untied head restarts once)
    gaps = [f"{s['rollout/logprob_gap_max']:.1e}" for s in stats]
    probes = [f"{s['rollout/probe_gap_max']:.1e}" for s in stats]
    print(f"{algorithm} {model} {engine} {lora or 'full'}: gap_max per iteration {gaps}, probe {probes}, "
          f"policy moved {moved.gap_max:.3f} nats")
