"""The engine's side of a resident run's weight push (#38): its peak extra memory per push against the model's
size, streamed against the whole state at once, at the engine's dtype.

    python benchmarks/bench_weight_push.py [--shape tiny|0.5b|1b] [--dtype bfloat16] [--engine hf|vllm]
                                           [--bucket-mib 256] [--quick] [--json PATH]

A random Llama of ``--shape`` (``benchmarks/bench_gpu.py``'s shapes) is the trainer's float32 model in this
process; the engine (HF or vLLM at ``--dtype``, started from those weights) runs in a child process behind the
engine service's two push ops, ``connect`` and ``weights``, whose receiving end is the transport's, as
``EngineHost`` serves them. Each push goes over the collective transport (gloo on a CPU, or trainer and engine on
one GPU; NCCL between two GPUs) twice, after a push to warm up: in buckets of ``--bucket-mib`` (the code's default,
256 MiB), and as one bucket holding the whole state (what the engine held before #38, which allocated every flat buffer before the
first broadcast). Per push: the model's bytes at the engine's dtype; the engine process's peak extra memory
during the push (its peak resident set above the set before it, Linux's ``VmHWM`` reset first; on CUDA also
torch's peak allocated above the allocated before); the bucket bytes it held at most
(``resident/receiver_peak_bytes``); the push's seconds (with the read-back's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402


URL_LINE = "engine serving at "


def resident_set() -> int:
    """This process's resident set, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current resident set (Linux: ``5`` to ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_set() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def serve_engine(folder: str, kind: str, dtype: str) -> None:
    """The child: the engine, and its two push ops on a server; prints its URL, then serves until stopped."""
    import torch

    from models.engines import make_engine
    from models.hosts.transports import CollectiveTransport
    from models.service.ops import Host, op
    from models.service.server import Server, Settings

    engine = make_engine(kind, folder, dtype=dtype, max_model_len=64) if kind == "vllm" else \
        make_engine(kind, folder, dtype=dtype)
    cuda = torch.cuda.is_available()

    class PushHost(Host):
        label = "the engine service"

        def __init__(self):
            self.transport = CollectiveTransport(dtype)

        @op
        def connect(self, host: str, gpu: str = "", timeout_s=None):
            return self.transport.connect(host=host, gpu=gpu, timeout_s=timeout_s)

        @op
        def weights(self, version: int, probe, meta=None, body=None) -> Dict[str, float]:
            before = resident_set()
            reset_peak()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            allocated = torch.cuda.memory_allocated() if cuda else 0
            t0 = time.perf_counter()
            out = self.transport.receive(meta or {}, body, engine)(engine)
            out["seconds"] = time.perf_counter() - t0
            out["peak_extra_host"] = float(peak_set() - before)
            if cuda:
                out["peak_extra_cuda"] = float(torch.cuda.max_memory_allocated() - allocated)
            return out

    server = Server(PushHost(), Settings("bench"))
    threading.Thread(target=server.serve, daemon=True).start()
    print(f"{URL_LINE}{server.url}", flush=True)
    sys.stdin.read()  # until the parent closes it
    server.close()
    engine.close()


def build(shape: str, folder: Path):
    """The trainer's float32 model (random, seeded) and its checkpoint folder, with the demos' tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.bench_gpu import SHAPES
    from models.demos.tiny import save_model
    from models.demos.tokenizer import build_char_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], max_position_embeddings=512, tie_word_embeddings=False))
    save_model(model, build_char_tokenizer(), folder)
    return model.float()


def push(client, model, dtype: str, bucket_bytes: int, version: int) -> Dict[str, float]:
    import torch

    from models.hosts.transports import CollectiveTransport
    from models.training.distributed import DistInfo
    from models.training.weight_source import WeightSource

    source = WeightSource(model, DistInfo(0, 1, 0, torch.device("cpu")), prefix="")
    transport = CollectiveTransport(dtype, bucket_bytes=bucket_bytes)
    try:
        t0 = time.perf_counter()
        out = transport.send(client, {"version": version, "probe": []}, None, source)
        out["sender_seconds"] = time.perf_counter() - t0
        return out
    finally:
        transport.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)
    parser.add_argument("--shape", default="0.5b", help="benchmarks/bench_gpu.py's SHAPES (--quick: tiny)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--bucket-mib", type=float, default=256.0)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve_engine(args.serve, args.engine, args.dtype)
        return 0
    import torch

    from models.service.client import ServiceClient

    torch.set_num_threads(args.threads)
    shape = "tiny" if args.quick else args.shape
    folder = Path(tempfile.mkdtemp(prefix="bench-push-")) / "start"
    model = build(shape, folder)
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(folder), "--engine", args.engine,
                              "--dtype", args.dtype], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = ""
        while not line.startswith(URL_LINE):  # vLLM prints its own lines first
            line = child.stdout.readline()
            if not line:
                raise SystemExit("the engine's process ended before it served")
        client = ServiceClient(line[len(URL_LINE):].strip(), "bench", "the engine service")
        threading.Thread(target=child.stdout.read, daemon=True).start()  # the rest, so its pipe never fills
        bucket = int(args.bucket_mib * 2**20)
        push(client, model, args.dtype, bucket, 1)  # warm-up: the channel's and the allocators' first use
        streamed = push(client, model, args.dtype, bucket, 2)
        whole = push(client, model, args.dtype, 1 << 62, 3)
    finally:
        child.stdin.close()
        child.wait(60)
    params, size = streamed["resident/weights_params"], streamed["resident/weights_bytes"]
    out: List[Row] = [row("weight_push", "model at the engine's dtype", size / 2**20, "MiB",
                          f"{shape}: {params / 1e6:.1f}M parameters at {args.dtype} ({args.engine} engine)")]
    for name, r in (("streamed", streamed), ("one bucket", whole)):
        detail = (f"bucket {args.bucket_mib:g} MiB; " if name == "streamed" else "the whole state at once; ") + \
            f"buckets held at most {r['resident/receiver_peak_bytes'] / 2**20:.1f} MiB; push {r['sender_seconds']:.2f} s " \
            f"(read back {r['time/weights_read_back_s']:.2f} s)"
        out.append(row("weight_push", f"engine's peak extra memory per push, {name} / model", r["peak_extra_host"] / size,
                       "x", f"{r['peak_extra_host'] / 2**20:.1f} MiB; {detail}"))
        if "peak_extra_cuda" in r:
            out.append(row("weight_push", f"engine's peak extra GPU memory per push, {name} / model",
                           r["peak_extra_cuda"] / size, "x", f"{r['peak_extra_cuda'] / 2**20:.1f} MiB"))
    out.append(row("weight_push", "bytes sent / (engine dtype bytes x parameters)",
                   size / (params * torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()), "x",
                   "resident/weights_bytes", at_least=1.0))
    print_rows(out)
    write_rows(args.json, out)
    print(json.dumps({"streamed": streamed, "one_bucket": whole}, indent=1, default=float), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
