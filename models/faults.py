"""Fault injection for the reliability tests: no-ops unless their environment variable is set.

The tests kill a run at a chosen point and check it resumes as if nothing happened, or spoil an
update and check the run stops, or slow an engine replica down, or make an engine's loader skip a weight, or
fail one rank of a service, or start a run's keeper late; and a benchmark can make generation the slower side.
Eight hooks:

- ``RLHF_FAULT_PAUSE="<point>:<seconds>"`` — :func:`pause_point` with a name containing
  ``<point>`` announces itself (``{RLHF_FAULT_DIR}/paused``, holding the point's name) and
  sleeps, so the test can SIGKILL the run right there. Points: ``rollout/iter-000001``
  (responses sampled, batch not written), ``actor_update/iter-000001`` (elastic workers
  trained, checkpoint not saved), ``commit/<checkpoint URL>`` (files in place under the
  checkpoint's URL, ``COMMITTED.json`` not written).
- ``RLHF_FAULT_KILL_RANK="<rank>@step=<k>[:<signal>]"`` — :func:`maybe_kill_rank`: that rank of the
  elastic update ``os._exit(1)``s before optimiser step ``k`` (or sends itself ``<signal>``, e.g.
  ``SIGKILL`` as the kernel's OOM killer would), once per ``RLHF_FAULT_DIR`` (a marker file is made
  first, so the restarted worker group runs through).
- ``RLHF_FAULT_NAN_ADVANTAGES="<iteration>:<rows>[,<iteration>:<rows>...]"`` —
  :func:`nan_advantages`: the actor update of that iteration sees NaN advantages, on the first
  ``<rows>`` rows of rank 0 or, with ``all``, on every row of every rank.
- ``RLHF_FAULT_SLOW_REPLICA="<replica>:<seconds per prompt>"`` — :func:`slow_replica`: that engine
  replica (``rollout.data_parallel_size``) sleeps that long per prompt of every chunk it is given, a
  straggler for the dispatch test (read in the replica's process, so set it before the replicas start).
- ``RLHF_FAULT_SLOW_ENGINE="<seconds per prompt>"`` — :func:`slow_engine`: every sampling call of an engine
  (:func:`models.engines.rollout.sample`, and the producer's partial rollouts: the synchronous and asynchronous
  paths alike) sleeps that long per prompt after generating, an engine on hardware of its own that is slower
  than the trainer (it takes no CPU from the trainer, as a GPU engine takes none).
  ``benchmarks/bench_async.py --slow-engine`` and ``benchmarks/bench_async_pods.py --slow-engine`` set it for
  every run they compare.
- ``RLHF_FAULT_DROP_PUSHED="<tensor name>"`` — :func:`drop_pushed`: an engine's loader leaves that tensor of a
  resident push out without a word (as vLLM's does with, say, v missing from ``qkv_proj``), for the push's
  read-back to catch (read where the loader runs: a vLLM worker's process inherits it from the engine's).
- ``RLHF_FAULT_FAIL_RANK="<rank>:<op>"`` — :func:`fail_on_rank`: that rank of a resident trainer
  service raises in its next ``<op>`` (``score``, ``update``, ``values``) before the op's first
  collective, while the other ranks go on into it, once the test armed it (the file
  ``{RLHF_FAULT_DIR}/fail-<op>``, removed as it fires).
- ``RLHF_FAULT_SLOW_KEEPER="<seconds>"`` — :func:`slow_keeper`: a run's keeper (``models/run/keeper_process.py``)
  reads what its process says that much later, as on a loaded machine where its interpreter starts after the
  process said which run it holds and was killed.

Nothing here runs in a normal run: every hook returns at once when its variable is unset.
"""

from __future__ import annotations

import os
import signal
import time

PAUSE_ENV = "RLHF_FAULT_PAUSE"
KILL_RANK_ENV = "RLHF_FAULT_KILL_RANK"
NAN_ADVANTAGES_ENV = "RLHF_FAULT_NAN_ADVANTAGES"
SLOW_REPLICA_ENV = "RLHF_FAULT_SLOW_REPLICA"
SLOW_ENGINE_ENV = "RLHF_FAULT_SLOW_ENGINE"
DROP_PUSHED_ENV = "RLHF_FAULT_DROP_PUSHED"
FAIL_RANK_ENV = "RLHF_FAULT_FAIL_RANK"
SLOW_KEEPER_ENV = "RLHF_FAULT_SLOW_KEEPER"
DIR_ENV = "RLHF_FAULT_DIR"


def _fault_dir() -> str:
    path = os.environ.get(DIR_ENV)
    if not path:
        raise RuntimeError(f"{PAUSE_ENV}/{KILL_RANK_ENV} need {DIR_ENV} (a folder for the fault markers)")
    os.makedirs(path, exist_ok=True)
    return path


def pause_point(name: str) -> None:
    """Sleep here if ``RLHF_FAULT_PAUSE`` names this point (after writing the ``paused`` marker)."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    point, _, seconds = spec.rpartition(":")
    if point and point in name:
        with open(os.path.join(_fault_dir(), "paused"), "w") as f:
            f.write(name)
        time.sleep(float(seconds))


def maybe_kill_rank(rank: int, step: int) -> None:
    """Exit this process abruptly (or by the signal it names) if ``RLHF_FAULT_KILL_RANK`` is
    ``{rank}@step={step}[:<signal>]`` (first time only)."""
    spec, _, sig = os.environ.get(KILL_RANK_ENV, "").partition(":")
    if not spec or spec != f"{rank}@step={step}":
        return
    marker = os.path.join(_fault_dir(), f"killed-rank-{rank}-step-{step}")
    if os.path.exists(marker):
        return
    open(marker, "w").close()
    if sig:
        os.kill(os.getpid(), getattr(signal, sig))
        time.sleep(60)  # a signal this process handles: it is not to go on
    os._exit(1)  # no cleanup, no exception: as if the process were killed


def nan_advantages(adv, iteration: int, rank: int):
    """``adv`` [N, T] with NaN planted as ``RLHF_FAULT_NAN_ADVANTAGES`` asks for this iteration and rank."""
    spec = dict(part.split(":", 1) for part in os.environ.get(NAN_ADVANTAGES_ENV, "").split(",") if ":" in part)
    rows = spec.get(str(iteration))
    if rows is None or (rows != "all" and rank != 0):
        return adv
    adv = adv.clone()
    adv[: None if rows == "all" else int(rows)] = float("nan")
    return adv


def slow_replica(replica: int, prompts: int) -> None:
    """Sleep ``prompts`` × the seconds ``RLHF_FAULT_SLOW_REPLICA`` gives if it names engine replica ``replica``."""
    spec = os.environ.get(SLOW_REPLICA_ENV)
    if not spec:
        return
    which, _, seconds = spec.partition(":")
    if int(which) == replica:
        time.sleep(prompts * float(seconds))


def slow_keeper() -> None:
    """Sleep the seconds ``RLHF_FAULT_SLOW_KEEPER`` gives."""
    seconds = os.environ.get(SLOW_KEEPER_ENV)
    if seconds:
        time.sleep(float(seconds))


def slow_engine(prompts: int) -> None:
    """Sleep ``prompts`` × the seconds ``RLHF_FAULT_SLOW_ENGINE`` gives."""
    seconds = os.environ.get(SLOW_ENGINE_ENV)
    if seconds:
        time.sleep(prompts * float(seconds))


def drop_pushed(tensors):
    """``tensors`` (a chunk of a push, name → tensor) less the one ``RLHF_FAULT_DROP_PUSHED`` names."""
    name = os.environ.get(DROP_PUSHED_ENV)
    return tensors if not name or name not in tensors else {k: v for k, v in tensors.items() if k != name}


def fail_on_rank(op: str, rank: int) -> None:
    """Raise if ``RLHF_FAULT_FAIL_RANK`` is ``{rank}:{op}`` and the test armed it (see the module docstring)."""
    spec = os.environ.get(FAIL_RANK_ENV)
    if not spec or spec != f"{rank}:{op}":
        return
    armed = os.path.join(_fault_dir(), f"fail-{op}")
    if not os.path.exists(armed):
        return
    os.remove(armed)
    raise RuntimeError(f"injected fault ({FAIL_RANK_ENV}): rank {rank} fails {op} before its first collective")
