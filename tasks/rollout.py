"""``rollout`` task: sample responses from the current actor and write the iteration's RolloutBatch."""

from __future__ import annotations

from typing import Dict, NamedTuple

from flytekit import task

from models.engines import SamplingSpec, get_engine
from models.faults import pause_point
from models.rollout import sample
from tasks.batch import BatchMetadata, RolloutBatch
from tasks.common import CACHE_VERSION, iteration_indices, load_tokenizer, local_checkpoint, read_prompts, timed
from tasks import decks, secrets
from tasks.config import TrainConfig
from tasks.deploy import deployment_config, resources_for
from tasks.types import PolicyState, RunHandle


class RolloutOutput(NamedTuple):
    batch: RolloutBatch
    stats: Dict[str, float]


def engine_for(cfg: TrainConfig, actor_url: str):
    r = cfg.rollout
    kwargs = dict(dtype=r.vllm_dtype, kv_cache_gib=r.vllm_kv_cache_gib,
                  gpu_memory_utilization=r.vllm_gpu_memory_utilization, seed=cfg.run.seed) \
        if r.engine == "vllm" else dict(dtype=cfg.model.dtype)
    return get_engine(r.engine, local_checkpoint(actor_url), **kwargs)


def sampling_spec(cfg: TrainConfig, tokenizer, seed: int, n: int, temperature: float) -> SamplingSpec:
    r = cfg.rollout
    return SamplingSpec(n=n, temperature=temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                        seed=seed, stop_token_ids=(tokenizer.eos_token_id,), stop_strings=tuple(r.stop_strings))


def run_rollout(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> RolloutOutput:
    stats: Dict[str, float] = {}
    with timed(stats, "time/rollout_s"):
        prompts, ids = read_prompts(run.train_prompts_url)
        idx = iteration_indices(len(prompts), cfg.rollout.prompts_per_iteration, state.iteration, cfg.run.seed)
        tokenizer = load_tokenizer(run.reference_url)
        with timed(stats, "time/engine_load_s"):
            engine = engine_for(cfg, state.actor_url)
        spec = sampling_spec(cfg, tokenizer, cfg.run.seed * 100_003 + state.iteration,
                             cfg.rollout.n_samples_per_prompt, cfg.rollout.temperature)
        cols = sample(engine, tokenizer, [prompts[i] for i in idx], ids[idx], spec)
        pause_point(f"rollout/iter-{state.iteration:06d}")  # tests only: kill the run mid-rollout
        meta = BatchMetadata(iteration=state.iteration, policy_version=state.iteration,
                             algorithm=cfg.run.algorithm, extras={"run_name": run.run_name})
        batch = RolloutBatch.from_columns(meta, **cols.as_dict())
        with timed(stats, "time/rollout_write_s"):
            batch = batch.write(run.layout.batch_url(state.iteration, "rollouts"))
    n_tokens = float(sum(len(r) for r in cols.response_tokens))
    stats["time/generate_s"] = cols.generate_s
    stats["throughput/rollout_tokens_per_s"] = n_tokens / max(cols.generate_s, 1e-9)
    return RolloutOutput(batch, stats)


@task(cache=True, cache_version=CACHE_VERSION, retries=2, enable_deck=True, secret_requests=secrets.requests(secrets.S3),
      **resources_for(deployment_config(), "rollout"))
def rollout(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> RolloutOutput:
    """Sample ``n_samples_per_prompt`` responses per prompt with vLLM (or HF) from the actor."""
    secrets.load(secrets.S3)
    out = run_rollout(cfg, run, state)
    decks.publish("Rollout", out.batch)
    return out
