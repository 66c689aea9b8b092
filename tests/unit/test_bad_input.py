"""Bad input fails ``setup_run`` early — before any model is built, copied or loaded and before
MLflow — with an error of a known type whose message names the problem (file, row, column,
field, numbers, URL). One case per row of ``CASES``.

The guard: ``build_start`` (model building), ``_commit_copy`` (checkpoint copies) and
``tracking.start_run`` raise ``ModelWorkStarted`` here, so a check that came too late shows up
as that error instead of the expected one.
"""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest

from models import storage
from models.checkpoint import CheckpointError
from models.rewards.workers import RewardTimeout
from models.rewards import RewardError
from models.service.client import ServiceError
from models.storage import StorageError
from models.run import setup as run_setup
from models.config import ConfigError
from models.config.io import load_config, to_dict
from models.data.prompts import PromptDataError
from models.run.layout import RunInfo, RunLayout
from tests.processes import free_port
from tests.fault_proxy import FaultProxy
from tests.unit.models.test_checkpoint import tiny_model_and_tokenizer

PROMPTS = ["a b", "b a", "a a b", "b"]


REWARDS = "tests.reward_fns"
"""The reward functions the cases name (a light module, as a user's own would be)."""


class ModelWorkStarted(AssertionError):
    """Raised by the guard: set-up got as far as models or MLflow."""


class HealthStub:
    """The ``health`` op on 127.0.0.1: ``status`` after ``delay_s``; 401 unless the bearer token is ``token``."""

    def __init__(self, status: int = 200, delay_s: float = 0.0, token: str = "", parts=("reward_model",),
                 vocab_size: int = 99):
        body = {"status": "ok", "parts": list(parts), "critic": None, "reward_model": "rm", "vocab_size": vocab_size,
                "device": "cpu", "train_calls": 0, "optimizer_steps": 0, "infer_requests": 0, "infer_samples": 0,
                "infer_batches": 0, "largest_batch": 0}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                time.sleep(delay_s)
                code, data = status, {"result": body} if status == 200 else {"error": "model exploded"}
                if token and self.headers.get("Authorization") != f"Bearer {token}":
                    code, data = 401, {"error": "bearer token missing or wrong", "kind": "Unauthorized"}
                raw = json.dumps(data).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except OSError:  # the client gave up (timeout case)
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def user_actor(tmp_path_factory) -> Path:
    """A user's HF checkpoint (no commit marker): 4-token tokenizer, 8-row embedding."""
    path = tmp_path_factory.mktemp("user") / "actor"
    model, tokenizer = tiny_model_and_tokenizer()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def ws(tmp_path, user_actor, monkeypatch):
    """A workspace: good prompts, the guard, MLflow in the test folder, no server token."""
    def guard(*args, **kwargs):
        raise ModelWorkStarted("set-up reached model or MLflow work before failing")

    monkeypatch.setattr(run_setup, "build_start", guard)
    monkeypatch.setattr(run_setup, "_commit_copy", guard)
    monkeypatch.setattr(run_setup.tracking, "start_run", guard)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.delenv("RLHF_SERVER_TOKEN", raising=False)
    write_lines(tmp_path / "train.jsonl", [json.dumps({"prompt": p}) for p in PROMPTS])
    return tmp_path


def write_lines(path: Path, lines) -> str:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return str(path)


def base(ws: Path, user_actor: Path, train: str = "") -> list:
    return [f"run.storage_root={ws}/runs", f"model.actor_path={user_actor}",
            f"data.train_prompts={train or ws / 'train.jsonl'}"]


def stub(request, **kwargs) -> str:
    server = HealthStub(**kwargs)
    request.addfinalizer(server.close)
    return server.url


def uncommitted_resume_point(ws: Path, user_actor: Path) -> list:
    """A run whose state.json points at a checkpoint without COMMITTED.json."""
    cfg = load_config("tiny_ppo", base(ws, user_actor))
    layout = RunLayout(str(ws / "runs"), "case")
    layout.write_run_info(RunInfo(run_name="case", algorithm="ppo", config=to_dict(cfg), mlflow_run_id=None))
    (Path(layout.actor_url(3))).mkdir(parents=True)
    (Path(layout.actor_url(3)) / "config.json").write_text("{}")
    storage.write_json(layout.state_url, {"iteration": 3, "actor_url": layout.actor_url(3), "critic_url": None,
                                          "extras": {}, "updated_at": "2024-01-01T00:00:00+00:00"})
    return base(ws, user_actor)


# Each case: (id, overrides(ws, actor, request, monkeypatch) -> list, workflow, error type, message regex).
CASES = [
    ("prompts file missing", lambda w, a, r, m: base(w, a, f"{w}/missing.jsonl"), "ppo", PromptDataError,
     r"missing\.jsonl: file not found"),
    ("prompts file empty", lambda w, a, r, m: base(w, a, write_lines(w / "empty.jsonl", [])), "ppo",
     PromptDataError, r"empty\.jsonl: file is empty"),
    ("wrong prompt column", lambda w, a, r, m: base(w, a, write_lines(w / "t.jsonl", ['{"text": "a b"}'])), "ppo",
     PromptDataError, r"t\.jsonl line 1 \(row 0\): missing column 'prompt' \(available columns: \['text'\]\)"),
    ("prompts not UTF-8", lambda w, a, r, m: base(w, a, write_lines(w / "u.jsonl", [b'{"prompt": "a\xff"}'])),
     "ppo", PromptDataError, r"u\.jsonl line 1 \(row 0\): not valid UTF-8 \(byte 0xff"),
    ("prompt over the character limit", lambda w, a, r, m: base(w, a) + ["data.max_prompt_chars=4"], "ppo",
     PromptDataError, r"line 3 \(row 2\): prompt has 5 characters > max_prompt_chars=4"),
    ("prompt over the token limit", lambda w, a, r, m: base(w, a) + ["data.max_prompt_tokens=2"], "ppo",
     PromptDataError, r"line 3 \(row 2\): prompt has 3 tokens > data\.max_prompt_tokens=2"),
    ("prompt longer than the model's context", lambda w, a, r, m: base(w, a, write_lines(w / "long.jsonl", [
        '{"prompt": "a b"}', '{"prompt": "a b a b a b a b a b"}'])), "ppo", PromptDataError,
     r"long\.jsonl line 2 \(row 1\): prompt has 10 tokens, but the model's context of 16 tokens "
     r"\(max_position_embeddings\) leaves 8 beside rollout\.max_new_tokens=8"),
    ("eval prompts not JSON", lambda w, a, r, m: base(w, a) + [
        f"data.eval_prompts={write_lines(w / 'eval.jsonl', ['{not json'])}"], "ppo", PromptDataError,
     r"eval\.jsonl line 1 \(row 0\): invalid JSON"),
    ("actor path is a file", lambda w, a, r, m: base(w, a / "model.safetensors"), "ppo", ConfigError,
     r"model\.actor_path=.*/actor/model\.safetensors is a file, not a checkpoint folder: give the folder that holds "
     r"its config\.json, \*\.safetensors weights and tokenizer \(its folder .*/actor holds one\)"),
    ("tokenizer larger than the model's vocabulary", lambda w, a, r, m: base(w, shrunk_vocab(a, w)), "ppo",
     ConfigError, r"model\.actor_path .*: the tokenizer has 4 tokens but the model's embedding has 2 rows"),
    ("minibatch not divisible by micro-batch x ranks", lambda w, a, r, m: base(w, a) + [
        "actor.minibatch_size=48"], "ppo", ConfigError,
     r"actor\.minibatch_size=48 must be divisible by actor\.micro_batch_size × ranks = 32 × 2"),
    ("batch not divisible by minibatch", lambda w, a, r, m: base(w, a) + ["rollout.prompts_per_iteration=10"],
     "ppo", ConfigError, r"\(rollout\.prompts_per_iteration × rollout\.n_samples_per_prompt = 40\) must be "
                         r"divisible by actor\.minibatch_size=64"),
    ("group baseline with one sample per prompt", lambda w, a, r, m: base(w, a) + [
        "run.algorithm=grpo", "rollout.n_samples_per_prompt=1", "rollout.prompts_per_iteration=64"], "reinforce",
     ConfigError, r"run\.algorithm=grpo needs a group baseline: rollout\.n_samples_per_prompt must be >= 2 \(got 1\)"),
    ("value out of range", lambda w, a, r, m: base(w, a) + ["actor.clip_eps=1.5"], "ppo", ConfigError,
     r"actor\.clip_eps must be in \(0, 1\)"),
    ("value of the wrong type", lambda w, a, r, m: base(w, a) + ["actor.lr=fast"], "ppo", ConfigError,
     r"actor\.lr must be a number, got 'fast'"),
    ("unknown config key", lambda w, a, r, m: base(w, a) + ["actor.learning_rate=1e-4"], "ppo", ConfigError,
     r"unknown key\(s\) in actor: \['learning_rate'\]"),
    ("algorithm and workflow disagree", lambda w, a, r, m: base(w, a), "reinforce", ConfigError,
     r"run\.algorithm=ppo trains a critic: use workflows/ppo\.py ppo_training"),
    ("option the algorithm does not use", lambda w, a, r, m: base(w, a) + ["run.algorithm=grpo"], "reinforce",
     ConfigError, r"critic\.lr=0\.001 is set, but run\.algorithm=grpo does not use it: only an algorithm with a "
                  r"critic trains one \(used by ppo\); leave it out"),
    ("reward module missing", lambda w, a, r, m: base(w, a) + ["reward.function=no_such_module:score"], "ppo",
     RewardError, r"reward spec 'no_such_module:score': cannot import module 'no_such_module'"),
    ("reward function missing", lambda w, a, r, m: base(w, a) + ["reward.function=models.demos.reverse_task:no_such_fn"], "ppo",
     RewardError, r"module 'models\.demos\.reverse_task' has no attribute 'no_such_fn'"),
    ("reward function raises", lambda w, a, r, m: base(w, a) + [f"reward.function={REWARDS}:reward_raises"],
     "ppo", RewardError, r"reward_raises' raised on a batch of 4 \(first failing sample: 0\): KeyError\('answer'\)"),
    ("reward of the wrong length", lambda w, a, r, m: base(w, a) + [
        f"reward.function={REWARDS}:reward_wrong_length"], "ppo", RewardError,
     r"reward_wrong_length' returned 1 values for 4 samples"),
    ("reward NaN", lambda w, a, r, m: base(w, a) + [f"reward.function={REWARDS}:reward_nan"], "ppo", RewardError,
     r"reward_nan': sample 0 got non-finite value nan"),
    ("reward inf", lambda w, a, r, m: base(w, a) + [f"reward.function={REWARDS}:reward_inf"], "ppo", RewardError,
     r"reward_inf': sample 3 got non-finite value inf"),
    ("reward server unreachable", lambda w, a, r, m: base(w, a) + [
        "reward.source=remote", f"reward.remote_url=http://127.0.0.1:{free_port()}"], "ppo", ServiceError,
     r"reward server at http://127\.0\.0\.1:\d+ does not answer \(health: connection refused, 4 attempts\)"),
    ("reward server slow", lambda w, a, r, m: base(w, a) + [
        "reward.source=remote", f"reward.remote_url={stub(r, delay_s=3)}", "reward.remote_timeout_s=0.3"], "ppo",
     ServiceError, r"reward server at http://127\.0\.0\.1:\d+: health timed out after 0\.3 s"),
    ("reward server answers 500", lambda w, a, r, m: base(w, a) + [
        "reward.source=remote", f"reward.remote_url={stub(r, status=500)}"], "ppo", ServiceError,
     r": health returned 500 after 4 attempts: Error: model exploded"),
    ("reward server answers 401", lambda w, a, r, m: with_env(m, "RLHF_SERVER_TOKEN", "wrong-token") + base(w, a) + [
        "reward.source=remote", f"reward.remote_url={stub(r, token='right-token')}"], "ppo", ServiceError,
     r": health returned 401: Unauthorized: bearer token missing or wrong"),
    ("reward server without a reward model", lambda w, a, r, m: base(w, a) + [
        "reward.source=remote", f"reward.remote_url={stub(r, parts=('critic',))}"], "ppo", ConfigError,
     r"reward server http://127\.0\.0\.1:\d+ serves \['critic'\], not a reward_model"),
    ("critic server unreachable", lambda w, a, r, m: base(w, a) + [
        f"reward.function={REWARDS}:reward_zero", f"critic.remote_url=http://127.0.0.1:{free_port()}"], "ppo",
     ServiceError,
     r"reward server at http://127\.0\.0\.1:\d+ does not answer"),
    ("storage unreachable", lambda w, a, r, m: s3_endpoint(m, f"http://127.0.0.1:{free_port()}") + base(w, a) + [
        "run.storage_root=s3://rlhf-test/runs"], "ppo", StorageError,
     r"write failed for s3://rlhf-test/runs/case/\.write-check-\w+ after 4 attempt"),
    ("storage root is a file", lambda w, a, r, m: base(w, a) + [
        f"run.storage_root={write_lines(w / 'runs-file', ['x'])}"], "ppo", NotADirectoryError,
     r"write: .*/runs-file/case/\.write-check-\w+: .*/runs-file is a file, not a folder"),
    ("storage without permission", lambda w, a, r, m: s3_endpoint(m, denying_proxy(r)) + base(w, a) + [
        "run.storage_root=s3://rlhf-test/runs"], "ppo", PermissionError,
     r"permission denied for s3://rlhf-test/runs/case/\.write-check-\w+"),
    ("reward hangs at set-up", lambda w, a, r, m: base(w, a) + [f"reward.function={REWARDS}:reward_hangs",
                                                              "reward.timeout_s=3"], "ppo", RewardTimeout,
     r"reward 'tests\.reward_fns:reward_hangs' did not return within 3 s on samples 0-3 of a batch of 4; its "
     r"worker process was stopped"),
    ("reward module hangs on import", lambda w, a, r, m: base(w, a) + [
        f"reward.module_paths=[{hanging_module(w)}]", "reward.function=hangs_on_import:score", "reward.timeout_s=3"],
     "ppo", RewardTimeout, r"reward 'hangs_on_import:score' did not return within 3 s while importing it"),
    ("reward returns a string", lambda w, a, r, m: base(w, a) + [f"reward.function={REWARDS}:reward_string"],
     "ppo", RewardError, r"reward_string' returned str '0\.5', expected a list of 4 floats \(one per sample\)"),
    ("reward takes a column the data lacks", lambda w, a, r, m: base(w, a) + [
        f"reward.function={REWARDS}:wants_missing_column"], "ppo", RewardError,
     r"wants_missing_column' takes \['solution'\], which the prompt data does not have as column\(s\) "
     r"\(its columns: \[\]\)"),
    ("reward fits no accepted form", lambda w, a, r, m: base(w, a) + [f"reward.function={REWARDS}:one_argument"],
     "ppo", RewardError, r"reward 'tests\.reward_fns:one_argument'\(responses\) fits no accepted form: fn\(prompts, "
     r"responses, \*\*columns\) \(positional.*or TRL's keyword form fn\(completions, \*\*kwargs\)"),
    ("prompt template names a missing column", lambda w, a, r, m: base(w, a) + [
        "data.prompt_template='{prompt} {hint}'"], "ppo", PromptDataError,
     r"train\.jsonl line 1 \(row 0\): prompt_template names column 'hint', which this row lacks"),
    ("chat template the tokenizer lacks", lambda w, a, r, m: base(w, a) + ["data.apply_chat_template=true"],
     "ppo", PromptDataError, r"the tokenizer has no chat template, but data\.apply_chat_template"),
    ("conversation column malformed", lambda w, a, r, m: base(w, a, write_lines(w / "m.jsonl", [
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
        '{"messages": [{"role": "robot", "content": "a"}]}', '{"messages": "a b"}'])) + [
        "data.messages_column=messages"], "ppo", PromptDataError,
     r"(?s)m\.jsonl line 1 \(row 0\): 'messages' ends with an assistant message.*line 2 \(row 1\): 'messages'\[0\] "
     r"has role 'robot'.*line 3 \(row 2\): 'messages' is str, not a non-empty list"),
    ("characters the tokenizer cannot represent", lambda w, a, r, m: base(w, a, write_lines(w / "x.jsonl", [
        '{"prompt": "a b"}', '{"prompt": "a é"}', '{"prompt": "b \\ud83d\\ude00"}'])), "ppo", PromptDataError,
     r"(?s)2 problem\(s\).*x\.jsonl line 2 \(row 1\): characters the tokenizer cannot represent \(they would "
     r"become '\[UNK\]'\): 'é' U\+00E9.*line 3 \(row 2\): .*U\+1F600.*data\.allow_unknown_chars=true"),
    ("reasoning-gym task unknown", lambda w, a, r, m: base(w, a, "") + [
        "data.train_prompts=", "data.source=reasoning_gym", "data.reasoning_gym.task=chain_summ",
        "reward.function=models.data.reasoning_gym:reasoning_gym_reward"], "ppo", PromptDataError,
     r"reasoning-gym has no task 'chain_summ' \(did you mean \['chain_sum'"),
    ("registered model name MLflow refuses", lambda w, a, r, m: base(w, a) + [
        "run.registered_model_name=my team/policy:v1"], "ppo", ConfigError,
     r"run\.registered_model_name='my team/policy:v1' is not a name the MLflow Model Registry accepts \(it may not "
     r"contain '/' or ':'\): e\.g\. 'my team-policy-v1'"),
    ("no model named", lambda w, a, r, m: base(w, a) + ["model.actor_path=", "model.builder="], "ppo", ConfigError,
     r"model\.actor_path is empty and model\.builder names no builder: set model\.actor_path"),
    ("no reward function named", lambda w, a, r, m: base(w, a) + ["reward.function="], "ppo", ConfigError,
     r"reward\.function is empty: name the function that scores a response"),
    ("eval prompts missing beside the demo's prompts", lambda w, a, r, m: [
        f"run.storage_root={w}/runs", f"data.eval_prompts={w}/held-out.jsonl"], "ppo", PromptDataError,
     r"held-out\.jsonl: file not found \(data\.eval_prompts\)"),
    ("resume point not committed", lambda w, a, r, m: uncommitted_resume_point(w, a), "ppo", CheckpointError,
     r"state\.json points at .*/runs/case/iter-000003/actor, which is not committed"),
]


# Cases that start reward worker processes or wait out retries and timeouts (seconds each): integration,
# so `make test-unit` leaves them to `make test`.
INTEGRATION_CASES = {"reward module missing", "reward function missing", "reward function raises",
                     "reward of the wrong length", "reward NaN", "reward inf", "reward server unreachable",
                     "reward server answers 500", "critic server unreachable", "storage unreachable",
                     "reward hangs at set-up", "reward module hangs on import", "reward returns a string",
                     "reward takes a column the data lacks", "reward fits no accepted form"}


def hanging_module(ws: Path) -> Path:
    """A folder holding a reward module whose import never returns."""
    folder = ws / "user-rewards"
    folder.mkdir(exist_ok=True)
    (folder / "hangs_on_import.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    return folder


def shrunk_vocab(actor: Path, ws: Path) -> Path:
    """A copy of the user checkpoint whose config says the embedding has 2 rows."""
    import shutil

    path = ws / "small-vocab"
    shutil.copytree(actor, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, vocab_size=2)))
    return path


def with_env(monkeypatch, key: str, value: str) -> list:
    monkeypatch.setenv(key, value)
    return []


def s3_endpoint(monkeypatch, url: str) -> list:
    from tests.conftest import _clear_s3fs_cache

    for key, value in {"AWS_ENDPOINT_URL": url, "FSSPEC_S3_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(key, value)
    _clear_s3fs_cache()
    return []


def denying_proxy(request) -> str:
    proxy = FaultProxy("http://127.0.0.1:9", mode="403", fail_first=10**6).start()
    request.addfinalizer(proxy.close)
    return proxy.url


def test_at_least_fifteen_cases():
    assert len(CASES) >= 15 and len({c[0] for c in CASES}) == len(CASES)
    assert INTEGRATION_CASES <= {c[0] for c in CASES}  # a renamed case is not left in the fast tier by mistake


@pytest.mark.parametrize("make, workflow, error, message", [
    pytest.param(*c[1:], id=c[0], marks=pytest.mark.integration if c[0] in INTEGRATION_CASES else ()) for c in CASES])
def test_bad_input_fails_early_naming_the_problem(ws, user_actor, request, monkeypatch, make, workflow, error,
                                                  message):
    overrides = make(ws, user_actor, request, monkeypatch)
    run_json = ws / "runs" / "case" / "run.json"
    existed = run_json.exists()  # only the resume case has a run already
    with pytest.raises(error, match=message):
        run_setup.setup_run("tiny_ppo", overrides, "case", workflow)
    assert run_json.exists() == existed
