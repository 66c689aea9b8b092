"""A critic that starts from the actor: the actor's trunk under a fresh value head (``model.critic_path``
empty, PPO). Written as an HF token-classification checkpoint (one label) with the actor's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer
from transformers.utils import logging as hf_logging


def save_tokenizer(tokenizer, out_dir: str | Path) -> Path:
    """Save `tokenizer` to `out_dir` (tokenizer.json + tokenizer_config.json).

    transformers 5 records its own class name ("TokenizersBackend"), which transformers
    4.x cannot resolve; "PreTrainedTokenizerFast" loads the same `tokenizer.json` in both,
    so the config is rewritten to that name for older readers (e.g. GPU images whose vLLM
    pins transformers 4.x).
    """
    out = Path(out_dir)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def critic_from_actor(actor_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Save a critic whose trunk is the actor's and whose value head is fresh (seeded).

    The actor's `model.*` weights load into the token-classification trunk; `lm_head` is
    dropped and the `score` head [1, hidden] is newly initialised.
    """
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "lm_head unexpected, score missing" report is intended
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            critic = AutoModelForTokenClassification.from_pretrained(str(actor_dir), num_labels=1)
    finally:
        hf_logging.set_verbosity(verbosity)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    critic.save_pretrained(out, safe_serialization=True)
    return save_tokenizer(AutoTokenizer.from_pretrained(str(actor_dir)), out)
