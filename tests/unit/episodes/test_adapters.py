"""Adapters of other libraries' environments (``models/environments/adapters/``): the spec's forms, a
missing library as one line naming the extra, what this machine cannot give refused with its reason,
and scripted episodes through the episode loop where the library's own game decides: its observation is
the next user turn (masked), its reward and its end are the episode's, a verifiers ToolEnv runs its tool
and its rubric scores the answer."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from models.config import ConfigError
from models.config.rollout import RolloutConfig
from models.engines.base import Generation, SamplingSpec
from models.environments.adapters import EnvironmentUnavailable, check_environment, environment_factory, spec_error
from models.environments.episodes import EpisodeLimits, run_episodes
from models.environments.tools import HermesParser


@pytest.mark.parametrize("spec", ["models.demos.tool_tasks:ArithmeticEnv", "verifiers:vf-wordle", "gem:game:Sudoku-v0",
                                  "textarena:GuessTheNumber-v0", "openenv:pkg.mod:Env", "openenv:http://h:8000",
                                  "gym:pkg.mod:make", "skyrl:gsm8k"])
def test_valid_specs(spec):
    assert spec_error(spec) == ""
    assert RolloutConfig(environment=spec).environment == spec


@pytest.mark.parametrize("spec, says", [("textarena:", "textarena:ENV_ID"), ("gym:make", "gym:module:factory"),
                                        ("openenv:http://", "names no host"), ("a:b:c", "LIBRARY")])
def test_bad_specs_are_refused_by_the_config(spec, says):
    with pytest.raises(ConfigError, match="rollout.environment") as err:
        RolloutConfig(environment=spec)
    assert says in str(err.value)


def test_a_missing_library_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # as if not installed: its import raises ImportError
    with pytest.raises(EnvironmentUnavailable) as err:
        environment_factory("textarena:GuessTheNumber-v0")
    assert "pip install '.[envs]'" in str(err.value) and "'textarena'" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.slow  # imports the libraries (seconds each)
@pytest.mark.parametrize("spec, says", [
    ("gem:math:GSM8K", "downloads the dataset 'axon-rl/GSM-8k' from the Hugging Face hub"),
    ("skyrl:search", "retrieval server"),
    ("skyrl:text2sql", "SQLite databases"),
    ("verifiers:no_such_environment", "no verifiers environment module 'no_such_environment' is installed"),
    ("textarena:TicTacToe-v0", "not a single-player game"),
    ("openenv:http://127.0.0.1:9", "does not answer GET /schema"),
])
def test_what_this_machine_cannot_give_is_refused_with_the_reason(spec, says):
    with pytest.raises(EnvironmentUnavailable, match="rollout.environment") as err:
        check_environment(spec, [{"prompt": "Play.", "seed": 0}])
    assert says in str(err.value)


class Script:
    """An engine that answers turn t of every episode with ``turns[t]`` (text, then ``<|im_end|>``)."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.calls = tok, turns, 0

    def generate(self, prompts, spec):
        end = self.tok.convert_tokens_to_ids("<|im_end|>")
        ids = self.tok(self.turns[self.calls], add_special_tokens=False)["input_ids"] + [end]
        self.calls += 1
        return [[Generation(ids, [-0.5] * len(ids), True)] for _ in prompts]


def _run(tok, spec, rows, turns):
    with ThreadPoolExecutor(2) as pool:
        return run_episodes(Script(tok, turns), tok, [environment_factory(spec)(r) for r in rows],
                            SamplingSpec(max_new_tokens=64), EpisodeLimits(max_turns=4, max_episode_tokens=600),
                            HermesParser(), pool)


@pytest.fixture(scope="module")
def tok(qwen2_chat_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen2_chat_dir)


@pytest.mark.slow
def test_a_textarena_game_decides_the_episode(tok):
    import textarena as ta

    env = ta.make("GuessTheNumber-v0-raw")
    env.reset(num_players=1, seed=11)
    target = env.game_number  # the game the adapter plays for seed 11 (TextArena seeds it)
    wrong = 1 if target != 1 else 2
    (ep,) = _run(tok, "textarena:GuessTheNumber-v0", [{"prompt": "Play.", "seed": 11}], [f"[{wrong}]", f"[{target}]"])
    assert (ep.turns, ep.done, ep.reward) == (2, True, 1.0)
    hint = "lower" if wrong > target else "higher"
    observed = tok.decode([t for t, m in zip(ep.response_ids, ep.loss_mask) if not m])
    assert observed == f"\n<|im_start|>user\n[GAME] The target number is {hint}.<|im_end|>\n<|im_start|>assistant\n"
    assert ep.messages[0]["content"].startswith("You are Player 0. You are playing Guess The Number.")


@pytest.mark.slow
def test_a_gem_game_gives_its_own_rewards(tok):
    # GEM's reward for a turn without a \\boxed{} guess is its format error (-0.1), which ends the game
    (ep,) = _run(tok, "gem:game:GuessTheNumber-v0", [{"prompt": "Play.", "seed": 3}], ["no guess"])
    assert (ep.turns, ep.done, ep.reward) == (1, True, pytest.approx(-0.1))


@pytest.mark.slow
def test_a_verifiers_tool_env_runs_its_tool_and_its_rubric_scores(tok):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48213*9127"}}\n</tool_call>'
    rows = [{"prompt": "What is 48213*9127?", "answer": str(48213 * 9127)}, {"prompt": "What is 2*3?", "answer": "6"}]
    right, wrong = _run(tok, "verifiers:models.demos.verifiers_calculator", rows, [call, str(48213 * 9127)])
    assert (right.turns, right.done, right.reward) == (2, True, 1.0)
    assert (wrong.turns, wrong.done, wrong.reward) == (2, True, 0.0)  # 2*3 is not 440040051
    assert [m["role"] for m in right.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert right.messages[3]["content"] == "440040051"  # verifiers ran the calculator
    observed = tok.decode([t for t, m in zip(right.response_ids, right.loss_mask) if not m])
    assert "<tool_response>\n440040051\n</tool_response>" in observed
