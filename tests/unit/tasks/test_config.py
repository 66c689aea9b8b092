"""The typed config: presets load, overrides apply, bad values are named in the error."""

import dataclasses

import pytest

from tasks.config import ConfigError, TrainConfig
from tasks.config_io import config_from_json_dict, flatten, load_config, to_dict


def test_anchor_defaults():
    cfg = TrainConfig()
    assert (cfg.advantage.gamma, cfg.advantage.lam) == (1.0, 0.95)
    assert (cfg.actor.clip_eps, cfg.critic.value_clip, cfg.kl.coef) == (0.2, 0.2, 0.01)
    assert cfg.kl.adaptive is False


def test_presets_load_and_overrides_apply():
    cfg = load_config("configs/tiny_ppo.yaml", ["actor.lr=1e-4", "rollout.stop_strings=['.']", "kl.adaptive=true"])
    assert cfg.actor.lr == pytest.approx(1e-4)
    assert cfg.rollout.stop_strings == ["."]
    assert cfg.kl.adaptive is True
    gpu = load_config("llama8b_ppo_gpu")
    assert gpu.actor.world_size == 8 and gpu.model.dtype == "bfloat16"
    assert gpu.critic.lora.enabled and not gpu.actor.lora.enabled  # a full 8B critic's AdamW would not fit one GPU


def test_the_math_preset_reads_the_demo_rows_it_writes():
    cfg = load_config("configs/tiny_math.yaml", [])
    assert (cfg.model.demo_task, cfg.run.algorithm, cfg.data.messages_column) == ("math", "grpo", "messages")
    assert cfg.reward.functions == ["models.verifiers:math_reward", "models.verifiers:format_reward"]
    from models.math_task import FORMAT_PATTERN

    assert cfg.reward.format_pattern == FORMAT_PATTERN  # YAML quoting kept every backslash


def test_frozen():
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.lr = 1.0  # type: ignore[misc]


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
    (["rollout.temperature=0.01"], "rollout.temperature=0.01 is below 0.1: log-probs at temperature τ are logits/τ"),
    (["rollout.temperature=1e-4"], "below 0.01 vLLM also samples another temperature than the trainer scores"),
    (["rollout.temperature=0"], "rollout.temperature=0.0 is below 0.1"),
    (["rollout.eval_temperature=0.005"], "rollout.eval_temperature=0.005 must be 0 (greedy) or >= 0.01"),
    (["rollout.top_k=-1"], "rollout.top_k must be >= 0"),
    (["rollout.probe_tolerance=-1"], "rollout.probe_tolerance must be >= 0"),
    (["model.demo_task=gsm8k"], "model.demo_task='gsm8k' is not one of ['reverse', 'math']"),
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
