"""The resident mode end to end on one GPU, in under 5 minutes (#38): vLLM in bfloat16 with CUDA graphs, the actor
trainer beside it, each update's weights pushed, checked bit for bit and probed before the engine samples again.

    python benchmarks/bench_resident_gpu.py                  # on the GPU (CUDA_VISIBLE_DEVICES picks which)
    python benchmarks/bench_resident_gpu.py --device cpu     # the same steps on the CPU (vLLM's CPU build: eager)
    python benchmarks/bench_resident_gpu.py --fault          # and a run whose engine drops a pushed tensor
    python benchmarks/bench_resident_gpu.py --layout colocated  # vLLM in the actor trainer's rank, sleep mode
    python benchmarks/bench_resident_gpu.py --json rows.json # the figures for benchmarks/RESULTS.md

One ``pyflyte run`` of the tiny GRPO preset (``configs/tiny_grpo.yaml``: its warm-started 2-layer Llama, built
into ``RLHF_CACHE_DIR`` by the first run) with ``run.resident=true`` for ``--iterations`` iterations (default 3):
the engine service runs vLLM in bfloat16 (``rollout.vllm_dtype``) with CUDA graphs (``rollout.enforce_eager:
false``, the default; the CPU has none), the actor trainer one rank (FSDP2 on a GPU) computing in bfloat16 on
float32 master weights (``model.dtype``). Each iteration samples on the engine, scores on the actor trainer
(π_old, π_ref, the reward), updates it, and pushes its weights to the engine (gloo: trainer and engine share the
one GPU), which loads them bucket by bucket, reads sampled elements of every tensor back bit for bit and probes
them before it samples again. Checked, each a row with its target, from the run's own MLflow metrics:

- the run ends and takes at most 300 s on a GPU, everything included (``pyflyte``, the services' start, the
  CUDA graphs' capture; a first run also builds the warm start);
- ``rollout/cuda_graphs`` is 1 on a GPU, 0 on the CPU (vLLM's own compilation config, read in the engine);
- every push carried 2 bytes a parameter (``resident/weights_bytes`` = 2 × ``resident/weights_params``) and was
  read back (``time/weights_read_back_s`` logged for each);
- the probe's gap after each push within its bfloat16 tolerance (``rollout/probe_gap_max``).

With ``--fault`` a second run's engine drops one tensor from every push without a word
(``RLHF_FAULT_DROP_PUSHED``, :func:`models.faults.drop_pushed`): the run must fail its first update naming the
tensor. Also printed: seconds per iteration, the push's seconds and the bucket bytes the engine held.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_resident import metrics  # noqa: E402
from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

DROPPED = "model.layers.1.self_attn.v_proj.weight"
"""The tensor ``--fault``'s engine leaves out (vLLM says nothing: ``qkv_proj`` is part-loaded)."""
BUDGET_S = 300.0


def overrides(root: str, iterations: int, layout: str = "separate") -> List[str]:
    return [f"run.storage_root={root}", "run.resident=true", f"run.resident_layout={layout}",
            f"run.num_iterations={iterations}",
            "run.eval_interval=0", "run.save_interval=100", "run.registered_model_name=",
            "run.checkpoint_artifact_max_mb=0", "rollout.engine=vllm", "rollout.vllm_dtype=bfloat16",
            "rollout.enforce_eager=false", "model.dtype=bfloat16", "actor.nproc_per_node=1"]


def launch(root: str, name: str, iterations: int, env: Dict[str, str], layout: str = "separate"
           ) -> subprocess.CompletedProcess:
    pyflyte = os.path.join(os.path.dirname(sys.executable), "pyflyte")
    return subprocess.run([pyflyte, "run", "workflows/reinforce.py", "reinforce_training", "--preset",
                           "configs/tiny_grpo.yaml", "--overrides", json.dumps(overrides(root, iterations, layout)),
                           "--run_name", name], cwd=REPO, env=env, capture_output=True, text=True)


def checked_run(root: str, iterations: int, env: Dict[str, str], gpu: bool, layout: str = "separate") -> List[Row]:
    t0 = time.perf_counter()
    done = launch(root, "resident-gpu", iterations, env, layout)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"the resident run failed ({wall:.0f} s):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")

    def m(key: str) -> List[float]:
        return metrics(root, "resident-gpu", key)

    colocated = layout == "colocated"  # the weights loaded in the rank's process: the bytes each engine took
    sent = m("resident/weights_loaded_bytes" if colocated else "resident/weights_bytes")
    params, read = m("resident/weights_params"), m("time/weights_read_back_s")
    graphs, gaps = m("rollout/cuda_graphs"), m("rollout/probe_gap_max")
    per_iteration = m("time/iteration_s")
    push, held = m("time/weights_to_engine_s"), m("resident/receiver_peak_bytes")
    where = "GPU" if gpu else "CPU"
    exact = sum(b == 2 * p for b, p in zip(sent, params)) if len(read) == len(sent) else 0
    rows = [row("resident_gpu", "colocated: weight bytes between processes, most per update",
                max(m("resident/weights_bytes") or [0.0]), "B", f"sleep {[round(x, 4) for x in m('resident/sleep_s')[:3]]} s, "
                f"wake {[round(x, 4) for x in m('resident/wake_s')[:3]]} s (vLLM's sleep mode on a GPU)", at_most=0.0)] if colocated else []
    return rows + [
        row("resident_gpu", f"resident run of {iterations} iterations, end to end ({where}, {layout})", wall, "s",
            f"median {statistics.median(per_iteration[1:] or per_iteration):.1f} s per iteration after the first",
            at_most=BUDGET_S if gpu else None),
        row("resident_gpu", "vLLM replays CUDA graphs (rollout/cuda_graphs)", min(graphs) if graphs else None, "",
            f"{len(graphs)} rollouts; expected {1 if gpu else 0} on the {where}", at_least=1.0 if gpu else None),
        row("resident_gpu", "pushes at 2 bytes a parameter, each read back", float(exact), "pushes",
            f"{[int(b) for b in sent[:3]]} bytes for {[int(p) for p in params[:3]]} parameters; read back in "
            f"{[round(s, 3) for s in read[:3]]} s", at_least=float(iterations)),
        row("resident_gpu", "probe gap after each push (bfloat16 engine)", max(gaps) if gaps else None, "nats",
            "rollout/probe_gap_max, within LOW_PRECISION_PROBE_TOLERANCE", at_most=0.5),
        row("resident_gpu", "push trainer -> engine per update", statistics.median(push) if push else None, "s",
            f"the engine held {max(held or [0]) / 2**20:.2f} MiB of buckets at most"),
    ]


def fault_run(root: str, env: Dict[str, str], layout: str = "separate") -> Row:
    t0 = time.perf_counter()
    done = launch(root, "resident-gpu-fault", 1, {**env, "RLHF_FAULT_DROP_PUSHED": DROPPED}, layout)
    out = done.stdout + done.stderr
    named = f"the engine holds other weights than were sent in '{DROPPED}'" in out
    return row("resident_gpu", "a push the engine's loader left a tensor out of fails, naming it",
               float(done.returncode != 0 and named), "", f"exit {done.returncode} after {time.perf_counter() - t0:.0f} s"
               + ("" if named else f"; output ends: {out[-600:]!r}"), at_least=1.0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--fault", action="store_true", help="also a run whose engine drops a pushed tensor")
    parser.add_argument("--root", default="", help="run folder (default: a temporary one)")
    parser.add_argument("--layout", choices=("separate", "colocated"), default="separate",
                        help="run.resident_layout: an engine service, or the engine in the actor trainer's rank")
    args = parser.parse_args(argv)
    import torch

    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        rows = [row("resident_gpu", "resident run on one GPU", None, "s", "skipped: no GPU (--device cpu runs it here)")]
        print_rows(rows)
        write_rows(args.json, rows)
        return 0
    root = args.root or tempfile.mkdtemp(prefix="bench-resident-gpu-")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(REPO)}
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    rows = checked_run(root, args.iterations, env, gpu, args.layout)
    if args.fault:
        rows.append(fault_run(root, env, args.layout))
    print_rows(rows)
    write_rows(args.json, rows)
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
