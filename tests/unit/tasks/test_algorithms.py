"""Algorithms declared once (models/algorithms/): what the config accepts and refuses, the workflow,
the actor loss and the docs' table all follow the declaration."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from kernels.aggregation import LossAgg
from kernels.losses import PolicyLossKind
from models import algorithms
from models.algorithms.docs_table import markdown_table, with_table
from models.config import AdvantageConfig, ConfigError, CriticConfig, LoraConfig, RolloutConfig, RunConfig, TrainConfig
from models.config.io import config_from_json_dict, load_config, to_dict
from models.run.setup import check_workflow
from models.stages.actor import policy_loss_config

ROOT = pathlib.Path(__file__).resolve().parents[3]
PRESETS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


def test_every_algorithm_runs_on_its_defaults():
    """Defaults never trigger a refusal: a config that names only the algorithm is valid for each, and
    its advantages and actor loss on a tiny batch (2 prompts × 2 samples, rewards 1 and 0 for prompt 0,
    0.5 and 0.5 for prompt 1) push up the better sample of prompt 0 and push down the worse one. Critic
    values are given only where the algorithm declares a critic (an estimator needing them would fail)."""
    import torch

    from kernels.advantages import AdvantageInput
    from kernels.losses import PolicyLossInput, policy_loss
    from models.stages.advantages import advantage_params

    old_logp = torch.full((4, 3), -1.0)  # [B, T]
    for name, spec in algorithms.ALGORITHMS.items():
        cfg = TrainConfig(run=RunConfig(algorithm=name))
        check_workflow(cfg, spec.workflow)
        x = AdvantageInput(reward=torch.tensor([1.0, 0.0, 0.5, 0.5]), old_logp=old_logp, ref_logp=old_logp,
                           mask=torch.ones(4, 3, dtype=torch.bool), prompt_id=torch.tensor([0, 0, 1, 1]),
                           values=torch.zeros(4, 3) if cfg.uses_critic else None)
        adv = spec.estimator(x, advantage_params(cfg, cfg.kl.coef)).advantages
        logp = old_logp.clone().requires_grad_(True)
        out = policy_loss(PolicyLossInput(logp, old_logp, adv, x.mask), policy_loss_config(cfg))
        (grad,) = torch.autograd.grad(out.loss, logp)
        assert torch.isfinite(out.loss) and grad[0].sum() < 0 < grad[1].sum(), name


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_load_and_name_only_what_their_algorithm_reads(preset):
    cfg = load_config(preset)
    check_workflow(cfg, cfg.spec.workflow)


@pytest.mark.parametrize("preset, overrides, fragment", [
    # written at its default value: still refused (the user believes it does something)
    ("tiny_grpo", ["advantage.whiten=true"], "advantage.whiten=True is set, but run.algorithm=grpo does not use it: "
                                             "batch whitening of the advantages; GRPO-style advantages are "
                                             "normalised within their group"),
    ("tiny_grpo", ["advantage.whiten=true"], "(used by ppo, reinforce, rloo); leave it out"),
    ("tiny_grpo", ["advantage.lam=0.9"], "advantage.lam=0.9 is set, but run.algorithm=grpo does not use it: λ is GAE's"),
    ("tiny_rloo", ["advantage.gamma=0.99"], "advantage.gamma=0.99 is set, but run.algorithm=rloo"),
    ("tiny_reinforce_pp", ["advantage.whiten=false"], "run.algorithm=reinforce_pp does not use it"),
    ("tiny_reinforce", ["actor.clip_eps=0.1"], "actor.clip_eps=0.1 is set, but run.algorithm=reinforce does not use "
                                              "it: the ratio clip of the clipped surrogate"),
    ("tiny_reinforce", ["actor.dual_clip=3"], "actor.dual_clip=3.0 is set"),
    ("tiny_grpo", ["critic.lr=1e-4"], "critic.lr=0.0001 is set, but run.algorithm=grpo does not use it: only an "
                                      "algorithm with a critic trains one (used by ppo)"),
    ("tiny_grpo", ["critic.lora.rank=4"], "critic.lora.rank=4 is set"),
    ("tiny_grpo", ["model.critic_path=/ckpt/critic"], "model.critic_path='/ckpt/critic' is set"),
    ("tiny_grpo", ["run.algorithm=dr_grpo", "actor.loss_agg=token_mean"],
     "actor.loss_agg='token_mean' is set, but run.algorithm=dr_grpo does not use it: the algorithm fixes"),
    ("tiny_ppo", ["advantage.dynamic_sampling=true"], "advantage.dynamic_sampling=True is set, but run.algorithm=ppo"),
    ("tiny_reinforce", ["advantage.dynamic_sampling=true"], "(used by rloo, grpo, dr_grpo)"),
    # a PPO preset's critic settings are refused for a critic-free algorithm
    ("tiny_ppo", ["run.algorithm=grpo"], "critic.lr=0.001 is set, but run.algorithm=grpo does not use it"),
])
def test_an_option_the_algorithm_does_not_use_is_refused_with_the_reason(preset, overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(preset, overrides)
    assert fragment in str(err.value)


@pytest.mark.parametrize("preset, overrides", [
    ("tiny_rloo", ["advantage.whiten=false", "advantage.dynamic_sampling=true"]),
    ("tiny_grpo", ["advantage.dynamic_sampling=true", "actor.loss_agg=seq_mean_token_mean", "actor.clip_eps_high=0.28"]),
    ("tiny_grpo", ["run.algorithm=dr_grpo", "advantage.dynamic_sampling=true"]),
    ("tiny_reinforce_pp", ["advantage.gamma=0.99"]),
    ("tiny_ppo", ["advantage.lam=1.0", "advantage.whiten=false", "advantage.mask_truncated=true"]),
    # options every algorithm reads
    ("tiny_reinforce", ["advantage.mask_truncated=true", "advantage.overlong_buffer=4", "actor.tis_cap=2"]),
])
def test_an_option_the_algorithm_uses_is_accepted(preset, overrides):
    import yaml

    cfg = to_dict(load_config(preset, overrides))
    for item in overrides:  # accepted, and in effect
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        assert cfg[section][name] == yaml.safe_load(value), item


def test_a_config_built_in_code_is_held_to_the_same_rule():
    """No preset or override to read: a value off its default is what counts."""
    with pytest.raises(ConfigError, match="advantage.whiten=False is set, but run.algorithm=grpo"):
        TrainConfig(run=RunConfig(algorithm="grpo"), advantage=AdvantageConfig(whiten=False))
    with pytest.raises(ConfigError, match="critic.lora.rank=2 is set, but run.algorithm=rloo"):
        TrainConfig(run=RunConfig(algorithm="rloo"), critic=CriticConfig(lora=LoraConfig(rank=2)))
    TrainConfig(run=RunConfig(algorithm="grpo"), advantage=AdvantageConfig(whiten=True))  # the default: unused


def test_a_stored_config_round_trips():
    """A run's stored config holds every field (ignored ones at their defaults) and reads back as it was."""
    for preset in ("tiny_grpo", "tiny_reinforce", "tiny_ppo"):
        cfg = load_config(preset)
        assert config_from_json_dict(to_dict(cfg)) == cfg


@pytest.mark.parametrize("name, placement, estimator", [
    ("ppo", "reward", "k1"), ("reinforce", "reward", "k1"), ("rloo", "reward", "k1"),
    ("reinforce_pp", "reward", "k1"), ("grpo", "loss", "k3"), ("dr_grpo", "loss", "k3"),
])
def test_an_empty_kl_placement_is_the_algorithms_own(name, placement, estimator):
    cfg = TrainConfig(run=RunConfig(algorithm=name))
    assert (cfg.kl_placement, cfg.kl_estimator) == (placement, estimator)
    moved = load_config("", [f"run.algorithm={name}", "kl.placement=reward" if placement == "loss" else
                             "kl.placement=loss"])
    assert (moved.kl_placement, moved.kl_estimator) == (("reward", "k1") if placement == "loss" else ("loss", "k3"))


def test_k1_as_a_loss_term_is_refused():
    with pytest.raises(ConfigError, match=r"kl.estimator=k1 with kl.placement=loss: the gradient of k1 .* is ∇log π"):
        load_config("tiny_grpo", ["kl.estimator=k1"])
    assert load_config("tiny_grpo", ["kl.estimator=k2"]).kl.estimator == "k2"


@pytest.mark.parametrize("overrides, fragment", [
    (["actor.tis_cap=2", "actor.old_logprobs=sampler"], "actor.tis_cap with actor.old_logprobs=sampler"),
    (["actor.tis_cap=-1"], "actor.tis_cap must be >= 0"),
    (["advantage.overlong_buffer=9"], "advantage.overlong_buffer=9 must be <= rollout.max_new_tokens=8"),
    (["advantage.overlong_penalty=0.5"], "advantage.overlong_penalty=0.5 needs advantage.overlong_buffer > 0"),
    (["run.algorithm=a2c"], "run.algorithm='a2c' is not one of ['ppo', 'reinforce', 'rloo', 'grpo', 'dr_grpo', "
                            "'reinforce_pp']"),
])
def test_rlvr_options_are_checked_against_the_rest_of_the_config(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_ppo", overrides)
    assert fragment in str(err.value)


def test_the_workflow_is_the_declared_one():
    for name, spec in algorithms.ALGORITHMS.items():
        cfg = TrainConfig(run=RunConfig(algorithm=name))
        other = "reinforce" if spec.workflow == "ppo" else "ppo"
        with pytest.raises(ConfigError, match=f"run.algorithm={name} .*: use workflows/{spec.workflow}.py "
                                              f"{spec.workflow}_training"):
            check_workflow(cfg, other)
    with pytest.raises(ConfigError, match="unknown workflow 'a2c'"):
        check_workflow(TrainConfig(), "a2c")


def test_the_actor_loss_is_the_declared_one():
    reinforce = policy_loss_config(load_config("tiny_reinforce"))
    assert (reinforce.kind, reinforce.agg) == (PolicyLossKind.REINFORCE, LossAgg.TOKEN_MEAN)
    dr = policy_loss_config(load_config("tiny_grpo", ["run.algorithm=dr_grpo", "actor.tis_cap=2"]))
    assert (dr.kind, dr.agg, dr.horizon, dr.tis_cap) == (PolicyLossKind.PPO, LossAgg.SEQ_MEAN_TOKEN_SUM_NORM, 8, 2.0)
    grpo = policy_loss_config(load_config("tiny_grpo", ["actor.clip_eps_high=0.28"]))
    assert (grpo.clip_low, grpo.clip_high, grpo.tis_cap) == (0.2, 0.28, None)


def test_a_declaration_that_contradicts_itself_is_refused():
    ppo = algorithms.get("ppo")
    with pytest.raises(ValueError, match="honours unknown options"):
        dataclasses.replace(ppo, honours=ppo.honours | {"advantage.bogus"})
    with pytest.raises(ValueError, match="uses_critic and honouring 'critic' must agree"):
        dataclasses.replace(ppo, uses_critic=False)
    with pytest.raises(ValueError, match="fixes loss_agg"):
        dataclasses.replace(ppo, loss_agg="token_mean")


def test_the_docs_table_is_rendered_from_the_declarations():
    page = (ROOT / "docs" / "algorithms.md").read_text()
    assert with_table(page) == page, "docs/algorithms.md is stale: run python -m models.algorithms docs/algorithms.md"
    table = markdown_table()
    for name, spec in algorithms.ALGORITHMS.items():
        assert f"| [`{name}`](algorithms/{name}.md) | `workflows/{spec.workflow}.py` |" in table
        assert (ROOT / "docs" / spec.doc).is_file(), f"docs/{spec.doc} is missing"
    assert "| `seq_mean_token_sum_norm`" not in table and "clipped surrogate, `seq_mean_token_sum_norm`" in table


def test_group_baselines_need_groups():
    for name, spec in algorithms.ALGORITHMS.items():
        small = RolloutConfig(n_samples_per_prompt=1, prompts_per_iteration=64)
        if spec.needs_groups:
            with pytest.raises(ConfigError, match=f"run.algorithm={name} needs a group baseline"):
                TrainConfig(run=RunConfig(algorithm=name), rollout=small)
        else:
            TrainConfig(run=RunConfig(algorithm=name), rollout=small)
