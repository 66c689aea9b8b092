"""Load benchmark of the reward/critic server: concurrent clients, throughput, latency, integrity.

    python benchmarks/bench_server.py [--seconds 60] [--clients 16] [--critic URL] [--reward-model URL]

Starts ``python -m models.hosts serve`` on 127.0.0.1 (a free port; tiny random models
unless checkpoints are given), then:

1. reference: every distinct request (``--variants`` per client, 1-4 samples each, distinct
   token contents) is sent once, alone, and its answer cached;
2. load: ``--clients`` threads send their requests in a loop for ``--seconds``; every answer
   is compared with the cached one (same sample count, same value count per sample, values
   and reward within 1e-4: batching pads rows, which may move the last float bits).

Prints requests/s, samples/s, latency p50/p90/p99 and the server's batch counters; exits 1
if any response was lost (error, timeout) or mixed (differs from its reference). Loopback
only; the run is bounded by ``--seconds`` plus the client timeout.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.service.client import ServiceClient  # noqa: E402
from tests.processes import server_process  # noqa: E402
from tests.unit.hosts.tiny_checkpoints import commit_tiny_models, samples  # noqa: E402

Request = Tuple[List[List[int]], List[List[int]]]


def matches(got, ref, atol: float = 1e-4) -> bool:
    """Same samples, same value counts, values and rewards within ``atol``."""
    if len(got) != len(ref):
        return False
    for g, r in zip(got, ref):
        if (g["values"] is None) != (r["values"] is None) or (g["reward"] is None) != (r["reward"] is None):
            return False
        if g["values"] is not None and (len(g["values"]) != len(r["values"])
                                        or not np.allclose(g["values"], r["values"], atol=atol, rtol=0)):
            return False
        if g["reward"] is not None and abs(g["reward"] - r["reward"]) > atol:
            return False
    return True


def infer(client: ServiceClient, prompts, responses):
    return client.infer(samples=[{"prompt_tokens": p, "response_tokens": r} for p, r in zip(prompts, responses)])


def client_loop(client: ServiceClient, requests: List[Request], refs: list, deadline: float, out: dict) -> None:
    i = 0
    while time.monotonic() < deadline:
        prompts, responses = requests[i % len(requests)]
        t0 = time.perf_counter()
        try:
            got = infer(client, prompts, responses)
        except Exception as err:  # noqa: BLE001 - every failure is a lost response
            out["lost"] += 1
            out["errors"].append(str(err))
        else:
            out["latency_s"].append(time.perf_counter() - t0)
            out["samples"] += len(prompts)
            if not matches(got, refs[i % len(requests)]):
                out["mixed"] += 1
        i += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the load phase")
    parser.add_argument("--clients", type=int, default=16, help="concurrent client threads")
    parser.add_argument("--variants", type=int, default=8, help="distinct requests per client")
    parser.add_argument("--critic", default="", help="committed critic URL (default: a tiny random one)")
    parser.add_argument("--reward-model", default="", help="committed reward model URL (default: tiny)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-delay-ms", type=float, default=10.0)
    parser.add_argument("--server-threads", type=int, default=0, help="torch threads of the server (0: default)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="client timeout per request")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-server-"))
    models = {"critic": args.critic, "reward_model": args.reward_model}
    if not (args.critic or args.reward_model):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        models = commit_tiny_models(tmp)
    token = secrets.token_urlsafe(16)
    server_args = ["--token-env", "BENCH_SERVER_TOKEN", "--max-batch-size", str(args.max_batch_size),
                   "--max-delay-ms", str(args.max_delay_ms), "--threads", str(args.server_threads)]
    for flag, url in (("--critic", models["critic"]), ("--reward-model", models["reward_model"])):
        server_args += [flag, url] if url else []
    server = server_process(server_args, env={"BENCH_SERVER_TOKEN": token}, log_path=tmp / "server.log").start()
    url = server.url
    try:
        requests = [[samples(1 + (c + k) % 4, seed=10_000 + 100 * c + k) for k in range(args.variants)]
                    for c in range(args.clients)]
        assert len({repr(r) for per in requests for r in per}) == args.clients * args.variants, "requests not distinct"
        ref_client = ServiceClient(url, token, "reward server", timeout_s=args.timeout_s)
        refs = [[infer(ref_client, *r) for r in per] for per in requests]
        before = ref_client.health()
        outs = [{"lost": 0, "mixed": 0, "samples": 0, "latency_s": [], "errors": []} for _ in range(args.clients)]
        t0 = time.monotonic()
        deadline = t0 + args.seconds
        threads = [threading.Thread(target=client_loop, daemon=True,
                                    args=(ServiceClient(url, token, "reward server", timeout_s=args.timeout_s),
                                          requests[c], refs[c], deadline, outs[c]))
                   for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0) + args.timeout_s + 5)
        wall = time.monotonic() - t0
        hung = sum(t.is_alive() for t in threads)
        after = ref_client.health()
    finally:
        server.stop()

    lat = np.array([x for o in outs for x in o["latency_s"]]) * 1e3  # ms
    ok, lost, mixed = len(lat), sum(o["lost"] for o in outs) + hung, sum(o["mixed"] for o in outs)
    n_samples = sum(o["samples"] for o in outs)
    batches = after["infer_batches"] - before["infer_batches"]
    print(f"server {url}: parts {', '.join(after['parts'])}; max batch {args.max_batch_size}, "
          f"max delay {args.max_delay_ms:g} ms; {args.clients} clients x {args.variants} distinct requests; "
          f"{wall:.1f} s")
    print(f"requests: {ok + lost} ({ok / wall:.1f}/s answered), samples: {n_samples} ({n_samples / wall:.1f}/s)")
    if ok:
        p50, p90, p99 = np.percentile(lat, [50, 90, 99])
        print(f"latency ms: p50 {p50:.1f}  p90 {p90:.1f}  p99 {p99:.1f}  max {lat.max():.1f}")
    print(f"server batches: {batches} for {after['infer_requests'] - before['infer_requests']} requests "
          f"(mean {(after['infer_samples'] - before['infer_samples']) / max(batches, 1):.1f} samples, "
          f"largest {after['largest_batch']})")
    print(f"lost: {lost}  mixed: {mixed}")
    for err in sorted({e for o in outs for e in o["errors"]})[:5]:
        print(f"  error: {err}")
    failed = bool(lost or mixed or not ok)
    if failed:
        print(f"server log and models kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
