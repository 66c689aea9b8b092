"""The run's starting model from ``model.builder`` (models/run/setup.py ``build_start``), the demo
presets that name theirs (models/demos/builders.py), the old demo keys as aliases of its arguments
(models/config/aliases.py), and production code that neither imports the demos nor defaults to them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from models.config import ConfigError
from models.config.io import config_from_json_dict, given_keys, load_config, to_dict
from models.run.setup import build_start
from tests.unit.models.test_checkpoint import tiny_model_and_tokenizer

ROOT = Path(__file__).resolve().parents[3]
HERE = "tests.unit.tasks.test_builder"
REVERSE = "models.demos.builders:reverse_demo"


def write_start(out_dir, size=2, prompts=False):
    """A user's builder: an actor checkpoint (``size`` recorded in its folder name) and, if asked, prompts."""
    model, tokenizer = tiny_model_and_tokenizer()
    actor = Path(out_dir) / f"actor-{size}"
    model.save_pretrained(actor, safe_serialization=True)
    tokenizer.save_pretrained(actor)
    built = {"actor": actor}
    if prompts:
        built["train_prompts"] = Path(out_dir) / "train.jsonl"
        built["train_prompts"].write_text('{"prompt": "a b"}\n')
    return built


def no_actor(out_dir):
    return {"critic": out_dir}


def test_set_up_calls_the_builder_the_config_names_with_its_arguments(tmp_path):
    cfg = load_config("", [f"model.builder={HERE}:write_start(size=3, prompts=True)"])
    built = build_start(cfg, str(tmp_path))
    assert built == {"actor": str(tmp_path / "actor-3"), "train_prompts": str(tmp_path / "train.jsonl")}
    assert (tmp_path / "actor-3" / "config.json").is_file()


def test_the_demo_presets_builders_write_what_set_up_takes(tmp_path, monkeypatch):
    """Each demo builder, at its smallest (no warm-start step), returns an actor whose tokenizer loads, and
    the prompts it wrote."""
    from models.run.setup import load_tokenizer_only

    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config("tiny_ppo", ["model.tiny_hidden_size=32", "model.tiny_num_layers=1", "model.warm_start_steps=0",
                                   "data.num_demo_train_prompts=4", "data.num_demo_eval_prompts=2"])
    built = build_start(cfg, str(tmp_path / "reverse"))
    assert sorted(built) == ["actor", "critic", "eval_prompts", "train_prompts"]
    assert len(load_tokenizer_only(built["actor"])) > 4
    assert len(Path(built["train_prompts"]).read_text().splitlines()) == 4
    assert (Path(built["critic"]) / "config.json").is_file()
    cfg = load_config("tiny_math", ["model.warm_start_steps=0", "data.num_demo_train_prompts=4",
                                    "data.num_demo_eval_prompts=2"])
    built = build_start(cfg, str(tmp_path / "math"))
    assert sorted(built) == ["actor", "eval_prompts", "train_prompts"]  # GRPO: no critic
    assert load_tokenizer_only(built["actor"]).chat_template
    assert len(Path(built["eval_prompts"]).read_text().splitlines()) == 2


@pytest.mark.parametrize("spec, fragment", [
    (f"{HERE}:no_actor", r"returned \['critic'\]: it must return the paths it wrote, 'actor' and any of"),
    (f"{HERE}:write_start(depth=2)", r"write_start\(depth=2\)': write_start\(\) got an unexpected keyword "
                                     r"argument 'depth'"),
    (f"{HERE}:no_such_builder", r"module 'tests\.unit\.tasks\.test_builder' has no attribute"),
    ("models.demos.builders:reverse_demo(hidden_size=30, num_heads=4)",
     r"hidden_size=30 is not divisible by num_heads=4"),
])
def test_a_builder_that_cannot_run_is_named(tmp_path, spec, fragment):
    cfg = load_config("", [f"model.builder={spec}"])
    with pytest.raises(ConfigError, match=rf"model\.builder=.*{fragment}"):
        build_start(cfg, str(tmp_path))


def test_a_malformed_builder_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"model\.builder='demo\(x=1\)': reward spec must look like"):
        load_config("", ["model.builder=demo(x=1)"])


def test_the_old_demo_keys_are_arguments_of_the_builder():
    cfg = load_config("tiny_ppo", ["data.num_demo_train_prompts=64", "model.tiny_hidden_size=32",
                                   "model.warm_start_steps=0"])
    assert cfg.model.builder == (f"{REVERSE}(hidden_size=32, num_layers=2, num_heads=2, warm_start_steps=0, "
                                 f"num_train_prompts=64, num_eval_prompts=64)")
    keys = given_keys("tiny_ppo", ["data.num_demo_train_prompts=64"])
    assert "model.builder" in keys and "data.num_demo_train_prompts" not in keys
    assert load_config("tiny_ppo", ["model.demo_task=math"]).model.builder == "models.demos.builders:math_demo"
    math = load_config("tiny_math").model.builder
    assert load_config("tiny_math", ["model.tiny_hidden_size=32"]).model.builder == math  # never applied to it
    assert load_config("tiny_math", ["model.demo_task=math"]).model.builder == math
    assert load_config("", ["model.actor_path=/ckpt", "model.tiny_num_layers=4"]).model.builder == ""
    with pytest.raises(ConfigError, match=r"model\.demo_task='gsm8k' is not one of \['reverse', 'math'\]"):
        load_config("", ["model.demo_task=gsm8k"])


def test_a_run_stored_before_the_builders_resumes_with_the_same_config():
    """A ``run.json`` of before: the seven demo fields, the old default reward beside ``functions``."""
    for preset, old in (("tiny_math", {"demo_task": "math", "warm_start_steps": 400}),
                        ("tiny_ppo", {"demo_task": "reverse", "warm_start_steps": 300})):
        now = load_config(preset, ["data.num_demo_eval_prompts=8"])
        stored = to_dict(now)
        del stored["model"]["builder"]
        stored["model"].update(old, tiny_hidden_size=64, tiny_num_layers=2, tiny_num_heads=2)
        stored["data"].update(num_demo_train_prompts=1024 if preset == "tiny_math" else 2000, num_demo_eval_prompts=8)
        if stored["reward"]["functions"]:
            stored["reward"]["function"] = "models.demos.reverse_task:reverse_reward"
        assert config_from_json_dict(stored) == now


def test_reward_function_and_functions_are_one_setting_across_layers(tmp_path):
    cfg = load_config("tiny_ppo", ["reward.functions=[tests.reward_fns:answer_length]"])  # the base names function
    assert (cfg.reward.function, cfg.reward.functions) == ("", ["tests.reward_fns:answer_length"])
    cfg = load_config("tiny_math", ["reward.function=tests.reward_fns:answer_length", "reward.weights=[]"])
    assert (cfg.reward.function, cfg.reward.functions) == ("tests.reward_fns:answer_length", [])
    both = tmp_path / "both.yaml"
    both.write_text("reward:\n  function: a:b\n  functions: [a:c]\n")  # one layer writes both: refused
    with pytest.raises(ConfigError, match="set reward.function or reward.functions, not both"):
        load_config(str(both))


def test_no_reward_is_the_default():
    assert load_config("").reward.specs == []
    assert load_config("tiny_ppo").reward.specs == ["models.demos.reverse_task:reverse_reward"]


def test_production_code_imports_no_demo():
    """models/ outside models/demos/, tasks/ and workflows/ import nothing of the demos (function-level
    imports included): set-up calls whatever builder the config names."""
    importers = []
    for folder in ("models", "tasks", "workflows"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(ROOT / "models" / "demos"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
                importers += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("models.demos")]
    assert importers == []
