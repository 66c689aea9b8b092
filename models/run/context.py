"""Set-up checks (before any model loads) of the run's context against the actor checkpoint's ``config.json``: the
room a prompt has beside the generation budget, the first prompts an environment writes, and the KV cache of a CPU
vLLM engine against one sequence of the run's context (:mod:`models.engines.context`).

The engine's ``max_model_len`` is :attr:`~models.config.TrainConfig.engine_context` (``data.max_prompt_tokens``
plus ``rollout.max_new_tokens``, or ``rollout.max_episode_tokens`` for episodes) capped at the checkpoint's
``max_position_embeddings``; every prompt is checked at set-up against both the prompt budget and the room the
checkpoint's limit leaves, so no sequence the run produces is longer than the engine's context."""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Tuple

from models.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)


def generation_budget(cfg: TrainConfig) -> Tuple[str, int]:
    """The setting that bounds what follows a prompt, and its value: ``rollout.max_new_tokens``, or with
    ``rollout.environment`` ``rollout.max_episode_tokens``."""
    r = cfg.rollout
    return ("rollout.max_episode_tokens", r.max_episode_tokens) if r.environment else \
        ("rollout.max_new_tokens", r.max_new_tokens)


def prompt_room(cfg: TrainConfig, actor_config: Dict[str, Any]) -> Optional[int]:
    """Tokens a prompt may take in the actor's context (``max_position_embeddings``) beside the generation budget;
    None when the checkpoint does not say. A budget that leaves no room is a :class:`ConfigError`."""
    from models.engines.context import checkpoint_context

    limit = checkpoint_context(actor_config)
    if limit is None:
        return None
    name, budget = generation_budget(cfg)
    if limit <= budget:
        raise ConfigError(f"{name}={budget} leaves no room for a prompt in the actor's context of {limit} tokens "
                          f"(its config.json max_position_embeddings)")
    return limit - budget


def engines_per_rollout(cfg: TrainConfig) -> int:
    """Engines an iteration's samples are dealt over: the colocated actor's engine groups, else the replicas."""
    if cfg.run.resident and cfg.run.resident_layout == "colocated":
        return cfg.actor.nnodes * cfg.actor.nproc_per_node // cfg.rollout.tensor_parallel_size
    return cfg.rollout.data_parallel_size


def _on_cpu(cfg: TrainConfig) -> bool:
    import torch

    colocated = cfg.run.resident and cfg.run.resident_layout == "colocated"
    gpus = cfg.resources.actor_gpu if colocated else cfg.resources.rollout_gpu
    return gpus == 0 and not torch.cuda.is_available()


def check_engine_memory(cfg: TrainConfig, actor_config: Dict[str, Any]):
    """A CPU vLLM engine's KV cache (``rollout.vllm_kv_cache_gib``) against the run's context: a
    :class:`ConfigError` with the size needed when one sequence does not fit; else the fit
    (:class:`models.engines.context.KVFit`), logged beside the samples each engine gets at once. None where the
    cache is not this config's to size (the HF engine, a rollout server, a GPU)."""
    r = cfg.rollout
    if r.engine != "vllm" or r.remote_url or not _on_cpu(cfg):
        return None
    from models.engines.context import kv_fit, kv_shortfall, model_len

    length = model_len(cfg.engine_context, actor_config)
    fit = kv_fit(actor_config, r.vllm_dtype, length, r.vllm_kv_cache_gib, r.tensor_parallel_size)
    name, budget = generation_budget(cfg)
    problem = kv_shortfall(fit, "rollout.vllm_kv_cache_gib", f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}"
                                                             f" + {name}={budget}, at most the checkpoint's limit")
    if problem:
        raise ConfigError(problem)
    per_engine = math.ceil(r.samples_per_iteration / engines_per_rollout(cfg))
    log.info("vLLM context %d tokens; KV cache of %g GiB holds %d such sequences at once, an iteration sends "
             "%d to each engine%s", length, fit.space_bytes / 2**30, fit.sequences, per_engine,
             "" if fit.sequences >= per_engine else " (the rest wait their turn)")
    return fit


FIRST_PROMPTS_CHECKED = 256
"""Rows whose first prompt set-up renders when there are more: those of the longest texts (an environment writes a
row's first prompt from its text; the episode loop still refuses any first prompt over the budget as it starts)."""


def check_first_prompts(cfg: TrainConfig, data, tokenizer, room: Optional[int]) -> None:
    """With ``rollout.environment``: rows' first prompts as their environment writes them (its messages and tools
    through the chat template, as :func:`models.environments.episodes.run_episodes` renders them; the data's own
    check saw only the row's text) against ``data.max_prompt_tokens`` and the ``room`` the actor's context leaves.
    Every row up to :data:`FIRST_PROMPTS_CHECKED`, else that many of the longest texts (starting an environment
    per row can cost milliseconds). A :class:`ConfigError` listing them."""
    if not cfg.rollout.environment:
        return
    from models.environments.chat_tokens import ChatTokens
    from models.environments.episodes import load_environment, tool_schemas

    env_cls, limit = load_environment(cfg.rollout.environment), cfg.data.max_prompt_tokens
    rows = list(zip(data.prompts, data.row_columns()))
    order = sorted(range(len(rows)), key=lambda i: -len(str(rows[i][0])))[:FIRST_PROMPTS_CHECKED]
    bad: List[str] = []
    for i in sorted(order):
        env = env_cls({"prompt": rows[i][0], **rows[i][1]})
        messages = list(env.start())  # before the tools: an adapter may learn them as it starts
        n = len(ChatTokens(tokenizer, tool_schemas(env) or None).first_prompt(messages))
        if n > limit or (room is not None and n > room):
            bad.append(f"row {int(data.row_ids[i])}: {n} tokens")
    if bad:
        name, budget = generation_budget(cfg)
        context = f", or {room} beside {name}={budget} in the actor's context" if room is not None else ""
        raise ConfigError(f"rollout.environment={cfg.rollout.environment}: {len(bad)} first prompts (the "
                          f"environment's messages and tools through the chat template) are longer than "
                          f"data.max_prompt_tokens={limit}{context}: {'; '.join(bad[:5])}")
