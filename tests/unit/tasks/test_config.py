"""The typed config: presets load, overrides apply, bad values are named in the error."""

import dataclasses
import re

import pytest

from models.config import ConfigError, TrainConfig
from models.config.io import config_from_json_dict, flatten, load_config, to_dict


def test_a_preset_naming_only_the_algorithm_trains_with_the_papers_settings(tmp_path):
    """What the defaults do, through the kernels they feed (hand-worked): GAE with γ = 1, λ = 0.95, the
    ratio and the critic's values clipped at ±0.2, a fixed KL penalty of 0.01 per nat in the reward."""
    import torch

    from kernels.gae import compute_gae
    from kernels.kl import kl_shaped_rewards
    from kernels.losses import ppo_clip_token_loss, value_loss
    from models.stages.commit import next_kl_coef
    from models.run.types import PolicyState
    from models.stages.actor import policy_loss_config

    (tmp_path / "bare.yaml").write_text("run:\n  algorithm: ppo\n")
    cfg = load_config(str(tmp_path / "bare.yaml"), [])
    ones = torch.ones(1, 3)
    # reward 1 on the last of 3 tokens, values 0: A_t = (γλ)^(2−t) = [0.9025, 0.95, 1]; returns = A + V
    gae = compute_gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.zeros(1, 3), ones, cfg.advantage.gamma, cfg.advantage.lam)
    torch.testing.assert_close(gae.advantages, torch.tensor([[0.9025, 0.95, 1.0]]))
    # A = 1 at ratios 1.1 and 1.5: the second is clipped to 1.2 (loss −1.2, no gradient through the ratio)
    ratio = torch.tensor([[1.1, 1.5]], requires_grad=True)
    token = ppo_clip_token_loss(ratio, torch.ones(1, 2), policy_loss_config(cfg))
    torch.testing.assert_close(token.loss, torch.tensor([[-1.1, -1.2]]))
    (grad,) = torch.autograd.grad(token.loss.sum(), ratio)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.0]]))
    # the critic's value moves 0 → 0.5 towards a return of 1: clipped at 0.2, ½·(0.2 − 1)² = 0.32
    critic = value_loss(torch.tensor([[0.5]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                        clip_eps=cfg.critic.value_clip)
    assert critic.loss.item() == pytest.approx(0.32)
    # log π − log π_ref = 2 on the first token: −0.01·2 there; the reward 1 lands on the last token
    shaped = kl_shaped_rewards(torch.tensor([1.0]), torch.tensor([[-1.0, -1.0]]), torch.tensor([[-3.0, -1.0]]),
                               torch.ones(1, 2), beta=cfg.kl.coef)
    torch.testing.assert_close(shaped.token_rewards, torch.tensor([[-0.02, 1.0]]))
    # the coefficient stays where it is however far the KL is from any target (no adaptive controller)
    assert next_kl_coef(cfg, PolicyState(3, "a", kl_coef=0.01), {"rollout/init_policy_kl": 50.0}) == 0.01


def test_presets_load_and_overrides_apply():
    cfg = load_config("configs/tiny_ppo.yaml", ["actor.lr=1e-4", "rollout.stop_strings=['.']", "kl.adaptive=true"])
    assert cfg.actor.lr == pytest.approx(1e-4)
    assert cfg.rollout.stop_strings == ["."]
    assert cfg.kl.adaptive is True
    gpu = load_config("llama8b_ppo_gpu")
    assert gpu.actor.world_size == 8 and gpu.model.dtype == "bfloat16"
    assert gpu.critic.lora.enabled and not gpu.actor.lora.enabled  # a full 8B critic's AdamW would not fit one GPU


def test_the_math_preset_rewards_the_demo_rows_it_writes():
    """The preset's reward (its functions, weights and format pattern, combined as the score task does,
    in-process here) on the demo's rows: a worked solution 1 + 0.1, the right number alone 1, a wrong
    one in the worked format 0.1. A backslash lost to YAML quoting would fail the format part."""
    from models.demos.math_task import MathTaskConfig, ProblemGenerator
    from models.rewards import compute_rewards, resolve_reward_fn

    cfg = load_config("configs/tiny_math.yaml", [])
    demos = ProblemGenerator(MathTaskConfig(max_number=12), "eval", 0).demonstrations(8)
    prompts = [m[0]["content"] for m, _ in demos]
    rows = ProblemGenerator(MathTaskConfig(max_number=12), "eval", 0).rows(8)
    answers = [r["answer"] for r in rows]
    worked = [w for _, w in demos]
    wrong = [w.replace(f"\\boxed{{{a}}}", f"\\boxed{{{int(a) + 1}}}") for w, a in zip(worked, answers)]

    def reward(responses):
        parts = [compute_rewards(resolve_reward_fn(spec), prompts, responses, spec, {"answer": answers},
                                 cfg.reward.options) for spec in cfg.reward.specs]
        return [pytest.approx(sum(w * p[i] for w, p in zip(cfg.reward.weights, parts))) for i in range(len(prompts))]

    assert [m[0]["role"] for m, _ in demos] == ["user"] * 8 and cfg.data.messages_column in rows[0]
    assert reward(worked) == [1.1] * 8
    assert reward(answers) == [1.0] * 8
    assert reward(wrong) == [0.1] * 8


def test_frozen():
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.lr = 1.0  # type: ignore[misc]


def test_the_kl_a_run_uses_is_computed_not_written_back():
    """An empty kl.placement/kl.estimator stays empty in the config (nothing rewrites a field after
    construction); what the run uses is computed from the algorithm, and that is what a stored config and
    the MLflow params record, reading back equal to the config they came from."""
    from models.config import KLConfig, RunConfig

    kl = KLConfig(coef=0.02)
    cfg = TrainConfig(run=RunConfig(algorithm="grpo"), kl=kl)
    assert cfg.kl is kl and (cfg.kl.placement, cfg.kl.estimator) == ("", "")
    assert (cfg.kl_placement, cfg.kl_estimator) == ("loss", "k3")
    assert to_dict(cfg)["kl"] == {"estimator": "k3", "placement": "loss", "coef": 0.02, "adaptive": False,
                                  "target": 6.0, "horizon": 10000}
    assert (flatten(cfg)["kl.placement"], flatten(cfg)["kl.estimator"]) == ("loss", "k3")
    stored = config_from_json_dict(to_dict(cfg))
    assert stored.kl.placement == "loss" and stored == cfg
    assert cfg != TrainConfig(run=RunConfig(algorithm="grpo"), kl=KLConfig(coef=0.02, placement="reward"))
    assert cfg != dataclasses.replace(cfg, kl=KLConfig(coef=0.03))


def test_no_product_code_reads_the_kl_choice_as_given():
    """``kl.placement``/``kl.estimator`` may be empty (the algorithm's own); code reads what the run uses,
    ``TrainConfig.kl_placement``/``kl_estimator``. Reading the field would drop GRPO's KL term silently."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3]
    pattern = re.compile(r"\.kl\.(placement|estimator)\b")
    readers = [f"{p.relative_to(root)}:{n}" for folder in ("models", "tasks", "workflows", "kernels")
               for p in sorted((root / folder).rglob("*.py")) if p.parent.name != "config"
               for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not readers, readers


@pytest.mark.parametrize("overrides, fragment", [
    (["actor.bogus=1"], "unknown key(s) in actor: ['bogus']"),
    (["nosection.x=1"], "unknown key(s) in config: ['nosection']"),
    (["actor.lr=abc"], "actor.lr must be a number"),
    (["actor.lr=-1"], "actor.lr must be > 0"),
    (["actor.ppo_epochs=1.5"], "actor.ppo_epochs must be an integer"),
    (["kl.estimator=k9"], "kl.estimator='k9' is not one of"),
    (["run.algorithm=grpo", "rollout.n_samples_per_prompt=1"], "n_samples_per_prompt must be >= 2 (got 1)"),
    (["run.algorithm=rloo", "rollout.n_samples_per_prompt=1"], "rloo needs a group baseline"),
    (["actor.minibatch_size=48"], "actor.minibatch_size=48 must be divisible by actor.micro_batch_size × ranks = 32 × 2"),
    (["rollout.prompts_per_iteration=5"], "batch (rollout.prompts_per_iteration × rollout.n_samples_per_prompt = 20)"),
    (["reward.source=model"], "reward.source=model needs reward.model_path"),
    (["rollout.remote_url=localhost:8124"], "rollout.remote_url='localhost:8124' must be an http:// or https:// URL"),
    (["rollout.remote_url=http://"], "rollout.remote_url='http://' must be an http:// or https:// URL with a host"),
    (["advantage.lam=1.5"], "advantage.lam must be in [0, 1]"),
    (["actor"], "must look like section.field=value"),
    (["actor.old_logprobs=engine"], "actor.old_logprobs='engine' is not one of"),
    (["actor.sharding=zero3"], "actor.sharding='zero3' is not one of"),
    (["actor.old_logprobs=sampler", "rollout.vllm_dtype=bfloat16"],
     "engine vllm in bfloat16); bf16 samplers differ"),
    (["actor.old_logprobs=sampler", "rollout.engine=hf", "model.dtype=bfloat16"],
     "got model.dtype=bfloat16, engine hf in bfloat16"),
    (["actor.old_logprobs=sampler", "rollout.remote_url=http://127.0.0.1:8125"], "remote http://127.0.0.1:8125"),
    (["actor.old_logprobs=update"], "it needs one step a batch, actor.ppo_epochs=1 and actor.minibatch_size >= the "
                                    "batch's 256 rows (got ppo_epochs=2, minibatch_size=64)"),
    (["actor.old_logprobs=update", "actor.ppo_epochs=1", "actor.minibatch_size=256"],
     "actor.old_logprobs=update with kl.placement=reward: the reward's KL needs π_old before the update"),
    (["rollout.temperature=0.01"], "rollout.temperature=0.01 is below 0.1: log-probs at temperature τ are logits/τ"),
    (["rollout.temperature=1e-4"], "below 0.01 vLLM also samples another temperature than the trainer scores"),
    (["rollout.temperature=0"], "rollout.temperature=0.0 is below 0.1"),
    (["rollout.eval_temperature=0.005"], "rollout.eval_temperature=0.005 must be 0 (greedy) or >= 0.01"),
    (["rollout.top_k=-1"], "rollout.top_k must be >= 0"),
    (["rollout.probe_tolerance=-1"], "rollout.probe_tolerance must be >= 0"),
    (["model.demo_task=gsm8k"], "model.demo_task='gsm8k' is not one of ['reverse', 'math']"),
    (["run.eval_before_training=true", "run.eval_interval=0"], "run.eval_before_training needs run.eval_interval > 0"),
])
def test_bad_values_are_named(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_ppo", overrides)
    assert fragment in str(err.value)


def test_missing_preset_is_named():
    with pytest.raises(ConfigError, match="preset 'nope.yaml' not found"):
        load_config("nope.yaml")


def test_round_trip_and_flatten():
    cfg = load_config("tiny_ppo", ["actor.lr=2e-4"])
    assert config_from_json_dict(to_dict(cfg)) == cfg
    flat = flatten(cfg)
    assert flat["actor.lr"] == pytest.approx(2e-4)
    assert flat["run.algorithm"] == "ppo"
    # every leaf field appears exactly once (nested sections such as actor.lora included)
    def leaves(obj) -> int:
        return sum(leaves(v) if dataclasses.is_dataclass(v) else 1
                   for v in (getattr(obj, f.name) for f in dataclasses.fields(obj)))

    assert len(flat) == leaves(cfg)
    assert flat["actor.lora.rank"] == 0


def test_temperature_bounds_accept_what_both_engines_sample_exactly():
    from models.engines import SamplingSpec

    cfg = load_config("tiny_grpo", ["rollout.temperature=0.1", "rollout.eval_temperature=0.01", "rollout.top_k=20"])
    assert (cfg.rollout.temperature, cfg.rollout.eval_temperature, cfg.rollout.top_k) == (0.1, 0.01, 20)
    assert load_config("tiny_grpo", ["rollout.eval_temperature=0"]).rollout.eval_temperature == 0  # greedy
    with pytest.raises(ValueError, match="temperature 0.005 is below 0.01, where vLLM samples another temperature"):
        SamplingSpec(temperature=0.005)  # the engines' own guard (the rollout server's requests too)


def test_the_probe_tolerance_is_raised_where_bfloat16_rounding_alone_exceeds_it():
    assert load_config("tiny_ppo").probe_tolerance == 1e-3  # float32 engine and trainer
    assert load_config("tiny_ppo", ["rollout.vllm_dtype=bfloat16"]).probe_tolerance == 0.5
    assert load_config("tiny_ppo", ["rollout.engine=hf", "model.dtype=bfloat16"]).probe_tolerance == 0.5
    assert load_config("tiny_ppo", ["rollout.vllm_dtype=bfloat16", "rollout.probe_tolerance=2"]).probe_tolerance == 2
    assert load_config("tiny_ppo", ["model.dtype=bfloat16", "rollout.probe_tolerance=0"]).probe_tolerance == 0  # off


def test_critic_optimizer_state_sharded_needs_the_critic_inside_the_tasks():
    assert load_config("tiny_ppo", ["critic.optimizer_state_sharded=true"]).critic.optimizer_state_sharded
    with pytest.raises(ConfigError, match="critic.optimizer_state_sharded needs the critic inside the tasks"):
        load_config("tiny_ppo", ["critic.optimizer_state_sharded=true", "critic.remote_url=http://127.0.0.1:1"])


NAMES = ["flyte-rlhf-policy", "my team policy", "Policy_v1.2", "π-policy", "a\\b", "x..", "my team/policy:v1",
         "a:b", "a/b", "a%b", ".", "..", "..x", "   "]


@pytest.mark.parametrize("name", NAMES)
def test_registered_model_names_follow_mlflows_own_rules(name):
    """Refused before training exactly when MLflow's registries (its SQL and file stores' validators)
    would refuse it at the run's end."""
    from mlflow.exceptions import MlflowException
    from mlflow.store.model_registry.file_store import _validate_model_name as file_store_rules
    from mlflow.utils.validation import _validate_model_name as sql_store_rules

    try:
        sql_store_rules(name)
        file_store_rules(name)
        mlflow_accepts = True
    except MlflowException:
        mlflow_accepts = False
    try:
        dataclasses.replace(TrainConfig().run, registered_model_name=name)
        ours = True
    except ConfigError as err:
        ours = False
        assert f"run.registered_model_name={name!r} is not a name the MLflow Model Registry accepts" in str(err)
    assert ours == mlflow_accepts


@pytest.mark.parametrize("preset", ["configs/tiny_math.yaml", "configs/tiny_tools.yaml"])
def test_the_demo_presets_evaluate_their_starting_policy(preset):
    """The demos' curves start at the warm start: the workflow evaluates step -1, as it does after the last."""
    from workflows.common import eval_due

    cfg = load_config(preset, [])
    assert eval_due(cfg, -1) and eval_due(cfg, cfg.run.num_iterations - 1)


def test_engine_tensor_parallelism_is_checked_against_the_engine_and_the_gpus():
    assert load_config("tiny_ppo", ["rollout.tensor_parallel_size=2"]).rollout.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=2 needs rollout.engine=vllm"):
        load_config("tiny_ppo", ["rollout.tensor_parallel_size=2", "rollout.engine=hf"])
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size must be >= 1"):
        load_config("tiny_ppo", ["rollout.tensor_parallel_size=0"])
    with pytest.raises(ConfigError, match=r"splits the engine over 8 GPUs, but the rollout task has "
                                          r"resources.rollout_gpu=4: set resources.rollout_gpu=8"):
        load_config("tiny_ppo", ["rollout.tensor_parallel_size=8", "resources.rollout_gpu=4"])
    load_config("tiny_ppo", ["rollout.tensor_parallel_size=8", "resources.rollout_gpu=8"])


def test_engine_replicas_are_checked_against_the_gpus():
    r = load_config("tiny_ppo", ["rollout.data_parallel_size=2", "rollout.engine=hf"]).rollout
    assert (r.data_parallel_size, r.engine) == (2, "hf")
    with pytest.raises(ConfigError, match=r"rollout.data_parallel_size=0 must be >= 1"):
        load_config("tiny_ppo", ["rollout.data_parallel_size=0"])
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=2 x rollout.data_parallel_size=4 splits the "
                                          r"engine over 8 GPUs, but the rollout task has resources.rollout_gpu=4: "
                                          r"set resources.rollout_gpu=8"):
        load_config("tiny_ppo", ["rollout.tensor_parallel_size=2", "rollout.data_parallel_size=4",
                                 "resources.rollout_gpu=4"])
    load_config("tiny_ppo", ["rollout.tensor_parallel_size=2", "rollout.data_parallel_size=4",
                             "resources.rollout_gpu=8"])


@pytest.mark.parametrize("override, named", [
    ("rollout.remote_url=http://127.0.0.1:9", "rollout.remote_url"),
    ("critic.remote_url=http://127.0.0.1:9", "critic.remote_url"),
])
def test_what_a_resident_run_does_not_serve_is_refused_naming_it(override, named):
    with pytest.raises(ConfigError, match=rf"run.resident=true does not support {re.escape(named)} .*Use the "
                                          rf"stateless mode \(run.resident=false\)"):
        load_config("tiny_ppo", ["run.resident=true", *override.split()])
    load_config("tiny_ppo", ["run.resident=true", "run.off_policy_steps=1", "actor.tis_cap=2",
                             "actor.old_logprobs=recompute", "actor.lora.rank=8"])  # these compose
    load_config("tiny_ppo", ["run.resident=true", "actor.nnodes=2", "actor.nproc_per_node=1"])  # on a cluster


@pytest.mark.parametrize("overrides,message", [
    (["run.resident=true", "run.off_policy_steps=1", "actor.tis_cap=2"],
     r"generation and training cannot overlap: run.off_policy_steps=1 needs run.resident_layout=separate"),
    (["run.resident=true", "run.max_staleness=2", "actor.tis_cap=2"],
     r"generation and training cannot overlap: run.max_staleness=2 needs run.resident_layout=separate"),
    (["run.resident=true", "rollout.tensor_parallel_size=3"],
     r"rollout.tensor_parallel_size=3 ranks each out of the actor's 2 .*: it must divide them"),
    (["run.resident=true", "rollout.engine=hf", "rollout.tensor_parallel_size=2"],
     r"rollout.tensor_parallel_size=2 needs rollout.engine=vllm \(the HF engine runs in one process\)"),
    (["run.resident=true", "rollout.data_parallel_size=2"],
     r"the actor's ranks are the engine replicas; rollout.data_parallel_size=2 must be 1"),
])
def test_a_colocated_layout_it_cannot_run_is_refused_naming_why(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_grpo", ["run.resident_layout=colocated", *overrides])
    cfg = load_config("tiny_grpo", ["run.resident=true", "run.resident_layout=colocated"])
    assert cfg.run.resident_layout == "colocated"
    cfg = load_config("tiny_grpo", ["run.resident=true", "run.resident_layout=colocated", "rollout.engine=vllm",
                                    "rollout.tensor_parallel_size=2"])  # one engine group of the actor's 2 ranks
    assert (cfg.rollout.tensor_parallel_size, cfg.actor.nnodes * cfg.actor.nproc_per_node) == (2, 2)
    # read only by a resident run: a stateless run of a preset that sets it ignores it, off-policy included
    load_config("tiny_grpo", ["run.resident_layout=colocated", "run.off_policy_steps=1", "actor.tis_cap=2"])
    with pytest.raises(ConfigError, match="run.resident_layout"):
        load_config("tiny_grpo", ["run.resident=true", "run.resident_layout=hybrid"])
