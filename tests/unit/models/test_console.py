"""models/console.py in a fresh interpreter: library chatter off by default, everything back with
RLHF_VERBOSE=1, and the project's own warnings (and vLLM's unloaded-weight reports) never hidden."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from models import console

pytestmark = pytest.mark.slow  # starts interpreters (make test-unit leaves it to make test)

ROOT = Path(__file__).resolve().parents[3]

PROBE = r'''
import json, logging, os, sys, warnings
import tasks  # what every task process does first
import transformers  # a library loaded after the switch
from transformers.utils import logging as hf_logging

def library_warning(category):
    # as a library module would: the warning is attributed to module "somelib.sub"
    g = {"__name__": "somelib.sub", "warnings": warnings, "category": category}
    exec("warnings.warn('library says', category)", g)

with warnings.catch_warnings(record=True) as caught:
    warnings.filters[:] = warnings.filters  # keep the filters quiet_libraries installed
    library_warning(DeprecationWarning)
    library_warning(FutureWarning)
    g = {"__name__": "models.something", "warnings": warnings}
    exec("warnings.warn('ours', DeprecationWarning)", g)
    library_warning(UserWarning)
out = {
    "env": {k: os.environ.get(k) for k in ("VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY",
                                          "HF_HUB_DISABLE_PROGRESS_BARS", "TORCH_CPP_LOG_LEVEL")},
    "tqdm_disable": os.environ.get("TQDM_DISABLE"),
    # a bar that does not pass ``disable`` itself, as vLLM's and a user's: tqdm reads TQDM_DISABLE
    "tqdm_bar_disabled": __import__("tqdm").tqdm(range(1), file=sys.stderr).disable,
    "caught": sorted(f"{w.category.__name__}:{w.message}" for w in caught),
    "hf_progress": hf_logging.is_progress_bar_enabled(),
    "hf_verbosity": hf_logging.get_verbosity(),
    "vllm_level": logging.getLogger("vllm").level,
    "ours_warns": logging.getLogger("models.engines.base").isEnabledFor(logging.WARNING),
}
print("RESULT " + json.dumps(out))
'''


def probe(**env_extra) -> dict:
    env = {k: v for k, v in os.environ.items()  # this pytest process imported tasks: start clean
           if k not in console.QUIET_ENV and k not in ("PYTHONWARNINGS", "TQDM_DISABLE", console.VERBOSE_ENV)}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_quiet_by_default_but_not_for_our_own_warnings():
    got = probe()
    assert got["env"] == {"VLLM_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error",
                          "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    # Library deprecations are dropped; ours and a library's UserWarning (maybe real) are not.
    assert got["caught"] == ["DeprecationWarning:ours", "UserWarning:library says"]
    assert got["hf_progress"] is False and got["hf_verbosity"] == 40  # logging.ERROR
    assert got["ours_warns"] is True


def test_rlhf_verbose_leaves_every_library_alone():
    got = probe(RLHF_VERBOSE="1")
    assert got["env"] == dict.fromkeys(got["env"])  # nothing set
    assert "DeprecationWarning:library says" in got["caught"] or "FutureWarning:library says" in got["caught"]
    assert got["hf_progress"] is True and got["vllm_level"] == 0


def test_a_value_the_user_exported_wins():
    assert probe(VLLM_LOGGING_LEVEL="INFO")["env"]["VLLM_LOGGING_LEVEL"] == "INFO"


def test_importing_the_project_leaves_tqdm_alone():
    """A user's own tqdm bars (and vLLM's ``LLM.generate`` bar, which divides by zero under a global
    ``TQDM_DISABLE=1``) keep working after ``import tasks`` / ``import workflows``."""
    got = probe()
    assert got["tqdm_disable"] is None and got["tqdm_bar_disabled"] is False


ELASTIC_ON_CTRL_C = r'''
import tasks
from torch.distributed.elastic.agent.server import api as agent
from torch.distributed.elastic.multiprocessing import api as procs
agent.logger.warning("Received %s death signal, shutting down workers", "SIGINT")  # as torch logs Ctrl-C
procs.logger.warning("Closing process %s via signal %s", 4242, "SIGINT")
agent.logger.warning("a worker failed")  # any other warning stays
'''


@pytest.mark.parametrize("verbose", [False, True])
def test_ctrl_c_during_an_update_is_said_once_not_by_torch_elastic_too(verbose):
    env = {k: v for k, v in os.environ.items() if k != console.VERBOSE_ENV}
    env.update(PYTHONPATH=str(ROOT), **({console.VERBOSE_ENV: "1"} if verbose else {}))
    err = subprocess.run([sys.executable, "-c", ELASTIC_ON_CTRL_C], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300, check=True).stderr
    assert "a worker failed" in err
    assert ("death signal" in err, "Closing process 4242 via signal SIGINT" in err) == (verbose, verbose)


def test_the_tool_demo_builder_saves_its_model_without_a_bar(tmp_path):
    """``make demo TASK=tools`` builds its model with ``python -m models.demos.tool_demo`` before the run, a
    process that imports nothing of ``tasks``: its ``save_pretrained`` printed transformers' "Writing
    model shards" bar."""
    env = {k: v for k, v in os.environ.items()  # a user's shell: none of the quieting variables
           if k not in console.QUIET_ENV and k not in ("PYTHONWARNINGS", "TQDM_DISABLE", console.VERBOSE_ENV)}
    env.update(PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "models.demos.tool_demo", "--steps", "0", "--out", str(tmp_path / "demo"),
                           "--cache-dir", str(tmp_path / "cache")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "demo" / "actor").glob("*.safetensors"))  # it did save the model
    assert "Writing model shards" not in proc.stderr + proc.stdout
    assert not re.search(r"\d+%\|", proc.stderr), proc.stderr[-2000:]  # nor any other bar
