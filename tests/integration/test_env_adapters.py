"""Other libraries' environments, unchanged, for two whole iterations each (rollout, score, advantages,
the actor's update, the commit) through the stage functions in this process, on the tool demo's preset
(``configs/tiny_tools.yaml``) and the Qwen2-shaped chat checkpoint: a real environment of each library
that runs offline (TextArena's and GEM's GuessTheNumber, the same GEM class through ``gym:``, SkyRL-Gym's
multi-turn GSM8K, an OpenEnv MCP environment in process), and TextArena's, GEM's (by its ``make`` and as a
Gymnasium-style class through ``gym:``) and SkyRL-Gym's again through ``pyflyte run``.
``verifiers`` and OpenEnv run through ``pyflyte run`` in ``test_tools_workflow.py`` (the PPO and asynchronous
cases).

Per library: each episode's reward is what the library itself gives when the episode's turns are
replayed into a fresh environment of it (not through the adapter), and it is what reaches the batch's
``reward_raw`` and MLflow's ``rollout/reward_mean``; the stored ids are what the engine returned (each
generation found verbatim after its prompt, on ``loss_mask`` 1), and the mask covers nothing else."""

from __future__ import annotations

import json
import random

import mlflow
import numpy as np
import pytest

from models.data.batch import RolloutBatch
from models.demos.tool_tasks import final_number, problems
from models.run.layout import RunLayout

pytestmark = pytest.mark.integration

SMALL = ["rollout.engine=hf", "run.num_iterations=2", "rollout.prompts_per_iteration=2",
         "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8", "rollout.max_turns=2",
         "rollout.max_episode_tokens=400", 'rollout.stop_strings=[" "]', "actor.minibatch_size=4", "actor.micro_batch_size=4",
         "actor.nproc_per_node=1", "actor.ppo_epochs=1", "data.max_prompt_tokens=600",
         'reward.functions=["models.environments.episode_rollout:environment_reward"]', "reward.weights=[1.0]"]


def _games(n):
    return [{"prompt": "Play.", "seed": s} for s in range(n)]


def _gsm(n):
    return [{"prompt": f"What is {a}+{a + 1}?", "reward_spec": {"ground_truth": str(2 * a + 1)}, "max_turns": 2}
            for a in range(n)]


def _replay_textarena(env_id, row, actions):
    import textarena as ta

    env = ta.make(f"{env_id}-raw")
    env.reset(num_players=1, seed=row["seed"])
    for a in actions:
        done, _ = env.step(a)
        if done:
            return float(env.close()[0][0]), True
    return 0.0, False


def _replay_gym(make, row, actions):
    env = make()
    random.seed(row["seed"])
    np.random.seed(row["seed"])
    env.reset(seed=row["seed"])
    total = 0.0
    for a in actions:
        _, r, term, trunc, _ = env.step(a)
        total += float(r)
        if term or trunc:
            return total, True
    return total, False


def _replay_skyrl(env_id, row, actions):
    import skyrl_gym

    env = skyrl_gym.make(env_id, env_config={}, extras={k: v for k, v in row.items() if k != "prompt"} |
                         {"extra_info": {}})
    env.init([{"role": "user", "content": row["prompt"]}])
    total = 0.0
    for a in actions:
        out = env.step(a)
        total += float(out["reward"])
        if out["done"]:
            return total, True
    return total, False


def _replay_openenv(row, actions):
    return float(final_number(actions[-1]) == row["answer"]), True


def _gem_make():
    import gem

    return lambda: gem.make("game:GuessTheNumber-v0")


def _gem_class():
    from gem.envs.game_env.guess_the_number import GuessTheNumberEnv

    return GuessTheNumberEnv


CASES = {
    "textarena": ("textarena:GuessTheNumber-v0", _games, lambda r, a: _replay_textarena("GuessTheNumber-v0", r, a)),
    "gem": ("gem:game:GuessTheNumber-v0", _games, lambda r, a: _replay_gym(_gem_make(), r, a)),
    "gym": ("gym:gem.envs.game_env.guess_the_number:GuessTheNumberEnv", _games,
            lambda r, a: _replay_gym(_gem_class(), r, a)),
    "skyrl": ("skyrl:gsm8k_multi_turn", _gsm, lambda r, a: _replay_skyrl("gsm8k_multi_turn", r, a)),
    "openenv": ("openenv:models.demos.openenv_calculator:CalculatorEnvironment", lambda n: problems(n, 0),
                _replay_openenv),
}


class Recording:
    """The run's engine, with every generation it returned recorded as (prompt ids, token ids)."""

    def __init__(self, engine, log):
        self.engine, self.log = engine, log

    def generate(self, prompts, spec):
        out = self.engine.generate(prompts, spec)
        self.log += [(list(p), list(g[0].tokens)) for p, g in zip(prompts, out)]
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _check_tokens(batches, log):
    rows = [(list(p), list(r), list(m)) for b in batches for p, r, m in
            zip(b.column("prompt_tokens").to_pylist(), b.column("response_tokens").to_pylist(),
                b.column("loss_mask").to_pylist())]
    for prompt, tokens in log:
        def found(row):
            p, r, m = row
            seq, mask, at = p + r, [0] * len(p) + m, len(prompt)
            return seq[:at] == prompt and seq[at:at + len(tokens)] == tokens and all(mask[at:at + len(tokens)])
        assert any(found(row) for row in rows), "a generation is not stored as the engine returned it"
    assert sum(sum(m) for _, _, m in rows) == sum(len(t) for _, t in log)  # the mask marks sampled tokens only


@pytest.mark.parametrize("library", sorted(CASES))
def test_two_iterations_on_the_library_environment(library, qwen2_chat_dir, tmp_path, monkeypatch):
    import models.stages.rollout as rollout_stage
    from tests.hub_runs import iterate
    from tests.stages import tiny_run

    spec, make_rows, replay = CASES[library]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_rows(4)))
    log = []
    engine_for = rollout_stage.engine_for
    monkeypatch.setattr(rollout_stage, "engine_for", lambda cfg, url: Recording(engine_for(cfg, url), log))
    overrides = SMALL + [f"rollout.environment={spec}", f"model.actor_path={qwen2_chat_dir}",
                         f"data.train_prompts={tmp_path / 'train.jsonl'}", f"data.eval_prompts={tmp_path / 'train.jsonl'}"]
    with tiny_run(tmp_path, "configs/tiny_tools.yaml", overrides, library, local_cache=False) as (cfg, run, state):
        iterate(cfg, run, state, 2)
        client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
        logged = [m.value for m in sorted(client.get_metric_history(run.mlflow_run_id, "rollout/reward_mean"),
                                          key=lambda m: m.step)]
    batches = _check_batches(RunLayout(str(tmp_path), library), logged, make_rows(4), replay)
    _check_tokens(batches, log)


def _check_batches(layout: RunLayout, logged, rows, replay) -> list:
    """Each episode's reward in the batch is what the library gives when its turns are replayed into a fresh
    environment of it, and ``rollout/reward_mean`` (``logged``) their mean; the two iterations' batches."""
    batches = [RolloutBatch.read(layout.batch_url(i, "advantages")) for i in range(2)]
    for b, mean in zip(batches, logged):
        rewards = b.column("episode_reward").to_numpy()
        np.testing.assert_allclose(b.column("reward_raw").to_numpy(), rewards, atol=1e-6)
        assert mean == pytest.approx(float(rewards.mean()), abs=1e-5)
        for pid, episode, reward, ended in zip(b.column("prompt_id").to_pylist(), b.column("episode").to_pylist(),
                                               rewards, b.column("is_end").to_pylist()):
            actions = [str(m.get("content") or "") for m in json.loads(episode) if m["role"] == "assistant"]
            if ended:  # the library ended it on its last turn, with the reward it gives
                assert replay(rows[pid], actions) == (pytest.approx(float(reward), abs=1e-6), True)
            else:  # cut here first: its last turn was stepped (max_turns) or not (a turn past max_new_tokens)
                assert float(reward) in [pytest.approx(replay(rows[pid], a)[0], abs=1e-6)
                                         for a in (actions, actions[:-1])]
    assert len(logged) == 2
    return batches


@pytest.mark.parametrize("library", ["textarena", "gem", "gym", "skyrl"])
def test_the_library_environment_through_pyflyte_run(library, qwen2_chat_dir, tmp_path):
    """The same cases as a user runs them: ``pyflyte run`` with ``rollout.environment=<library>:...`` (the engine in
    a task of the workflow, not this process): the library's rewards replayed, in the batch and in MLflow, and the
    trainer scoring the stored tokens as the engine sampled them (a retokenized turn would move the gap)."""
    from tests.integration.flyte_runs import FlyteRun, isolated_env
    from tests.integration.test_algorithms import _metrics

    spec, make_rows, replay = CASES[library]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_rows(4)))
    db = f"sqlite:///{tmp_path}/mlflow.db"
    data = tmp_path / "train.jsonl"
    overrides = SMALL + [f"rollout.environment={spec}", f"model.actor_path={qwen2_chat_dir}",
                         f"data.train_prompts={data}", f"data.eval_prompts={data}", f"run.storage_root={tmp_path}/runs"]
    FlyteRun("workflows/reinforce.py", "reinforce_training", "configs/tiny_tools.yaml", overrides, library,
             isolated_env(tmp_path / "home", {"MLFLOW_TRACKING_URI": db}), tmp_path / "run.log").wait(600)
    layout = RunLayout(str(tmp_path / "runs"), library)
    run_id = layout.read_run_info().mlflow_run_id
    _check_batches(layout, _metrics(tmp_path / "mlflow.db", run_id, "rollout/reward_mean"), make_rows(4), replay)
    assert mlflow.tracking.MlflowClient(db).get_run(run_id).data.metrics["rollout/logprob_gap_max"] < 1e-3
