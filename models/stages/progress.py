"""The one line a commit prints per iteration: reward, KL, length, the actor's loss and the time taken."""

from __future__ import annotations

from typing import Dict

from models.config import TrainConfig


def progress_line(cfg: TrainConfig, i: int, m: Dict[str, float]) -> str:
    phases = sum(v for k, v in m.items() if k in ("time/rollout_s", "time/score_s", "time/advantages_s",
                                                   "time/actor_update_s", "time/critic_update_s"))
    wall = f"{m['time/iteration_s']:.1f} s wall, " if "time/iteration_s" in m else ""
    return (f"[{cfg.run.algorithm}] iter {i + 1}/{cfg.run.num_iterations}  "
            f"reward {m.get('rollout/reward_mean', float('nan')):.3f}  "
            f"kl {m.get('rollout/init_policy_kl', float('nan')):.3f}  "
            f"len {m.get('rollout/response_length_mean', float('nan')):.1f}  "
            f"{_actor(m)}{_gap(m)}{_async(m)}({wall}{phases:.1f} s in tasks)")


def _actor(m: Dict[str, float]) -> str:
    """The actor's loss and clip fraction, or that it took no step (no token or no advantage to learn from)."""
    skipped = f"{m['actor/skipped_steps']:.0f} skipped  " if m.get("actor/skipped_steps") else ""
    if m.get("actor/steps") == 0:
        return "actor: no step (no advantage or token to learn from)  "
    return f"actor_loss {m.get('actor/loss', float('nan')):+.3f}  clip {m.get('actor/clip_frac', float('nan')):.2f}  " \
           f"{skipped}"


def _gap(m: Dict[str, float]) -> str:
    """Sampler vs trainer: the batch's largest log-prob gap (π_old recomputed), else the probe's. A batch sampled by
    an older actor (``rollout.policy_lag`` or an asynchronous token's lag above 0) differs from π_old by the policy's
    change since, not by the engine's numerics: its gap reads ``shift``, the probe's gap (the engine against the
    trainer on the weights pushed) beside it."""
    lagged = m.get("rollout/policy_lag", 0) > 0 or m.get("async/staleness_p100", 0) > 0
    out = ""
    if "rollout/logprob_gap_max" in m:
        out = f"{'shift' if lagged else 'gap'} {m['rollout/logprob_gap_max']:.1e}  "
        if not lagged:
            return out
    if "rollout/probe_gap_max" in m:
        out += f"probe gap {m['rollout/probe_gap_max']:.1e}  "
    return out


def _async(m: Dict[str, float]) -> str:
    """Asynchronous training (``run.max_staleness`` ≥ 2): the tokens' lag, drops and who waited."""
    if "async/staleness_p100" not in m:
        return ""
    kept = m.get("async/reweighted_samples", 0)  # run.stale_samples=reweight: stale samples trained
    return (f"lag p50 {m['async/staleness_p50']:.0f} max {m['async/staleness_p100']:.0f}  "
            f"dropped {m.get('async/dropped_samples', 0):.0f}  " + (f"reweighted {kept:.0f}  " if kept else "") +
            f"partial {m.get('async/partial_fraction', 0):.2f}  "
            f"idle engine {m.get('async/engine_idle_fraction', 0):.0%} trainer "
            f"{m.get('async/trainer_idle_fraction', 0):.0%}  ")
