"""The services as commands: ``python -m models.hosts serve --critic URL --reward-model URL --storage-root URL
[...]`` (the reward/critic server), ``serve-rollout --checkpoint URL --storage-root URL --engine vllm|hf [...]``
(the rollout server), and a resident run's ``{engine,actor,critic} --launch FILE`` (``FILE``: written by
:mod:`models.hosts.resident`, mode 0600: the run's config, handle and state; the token is derived from the secret in
``RLHF_SERVICE_SECRET``, :mod:`models.service.token`; a trainer may run as every rank of a launch, ``ranks --nproc N
{actor,critic} --launch FILE``, its ranks forked from one process, :mod:`models.hosts.ranks`). A
server's bearer token comes from the environment variable ``--token-env`` names (never the command line, which ``ps``
shows); ``--port 0`` picks a free port. Each prints one line once it listens::

    reward server ready on http://127.0.0.1:8123 (parts: critic, reward_model; auth: on)
    rollout server ready on http://127.0.0.1:8124 (engine: vllm; auth: on)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Callable, List, Optional

from models import console
from models.library_imports import skip_unused_optional_imports
from models.memory import bound_heap, use_huge_pages

RESIDENT = ("engine", "actor", "critic")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.hosts", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="load the models and serve infer, values, train, save, health",
                       allow_abbrev=False)  # "--token VALUE" must not pass as --token-env
    s.add_argument("--critic", dest="critic_url", default="", help="committed critic URL (token classification)")
    s.add_argument("--reward-model", dest="reward_model_url", default="", help="committed reward model URL")
    _common_args(s, port=8123, root="fsspec URL inside which the batches it reads and the critics it saves lie")
    s.add_argument("--max-batch-size", type=int, default=64, help="most samples per model batch")
    s.add_argument("--max-delay-ms", type=float, default=10.0, help="longest wait to fill a batch")
    s.add_argument("--lr", type=float, default=5e-5, help="critic AdamW learning rate")
    s.add_argument("--weight-decay", type=float, default=0.0, help="critic AdamW weight decay")
    s.add_argument("--device", default="", help="torch device (default: cuda if available, else cpu)")
    s.add_argument("--no-pack-sequences", dest="pack_sequences", action="store_false",
                   help="critic forwards on padded rows (default: rows packed end to end where the model allows)")

    r = sub.add_parser("serve-rollout", help="start a generation engine and serve generate, health",
                       allow_abbrev=False)
    r.add_argument("--checkpoint", dest="checkpoint_url", required=True, help="committed policy URL to start from")
    r.add_argument("--engine", default="vllm", choices=("vllm", "hf"), help="generation engine")
    _common_args(r, port=8124, root="fsspec URL inside which the checkpoints the requests name lie", root_required=True)
    r.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM KV-cache space on CPU (GiB)")
    r.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="fraction of GPU memory for vLLM")
    r.add_argument("--max-model-len", type=int, default=0,
                   help="vLLM context length (0: --max-tokens), at most the model's own")
    r.add_argument("--max-num-seqs", type=int, default=0, help="vLLM: most sequences at once (0: vLLM's default)")
    r.add_argument("--max-lora-rank", type=int, default=0, help="vLLM: serve LoRA adapters up to this rank")
    r.add_argument("--seed", type=int, default=0, help="vLLM engine seed (requests carry their own)")
    r.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vLLM workers the engine is split over (GPUs, or groups of CPU cores)")
    r.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas, each in its own process, requests' prompts dealt among them")
    r.add_argument("--enforce-eager", action="store_true",
                   help="vLLM on a GPU: no CUDA graphs, every decode step eager (the CPU is always eager)")
    for name in RESIDENT:
        sub.add_parser(name, help=f"a resident run's {name} service").add_argument(
            "--launch", required=True, help="the launch file written by models.hosts.resident")
    sub.add_parser("ranks", add_help=False, help="--nproc N {actor,critic} --launch FILE: a trainer service's ranks "
                   "forked from one process that imported what they need (models/hosts/ranks.py)")
    return parser


def _common_args(p: argparse.ArgumentParser, port: int, root: str, root_required: bool = False) -> None:
    """Binding, authentication, storage and request limits, the same for both servers."""
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=port, help="TCP port; 0 picks a free one")
    p.add_argument("--token-env", default="", help="name of the environment variable holding the bearer token")
    p.add_argument("--storage-root", default="", required=root_required, help=f"{root} (others are refused)")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="largest request body")
    p.add_argument("--max-samples", type=int, default=1024, help="most samples per request")
    p.add_argument("--max-tokens", type=int, default=8192, help="most prompt+response tokens per sample")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (a critic trains and saves float32 master weights)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)")


def _serve(args: argparse.Namespace, make: Callable[[], Any], line: Callable[[Any], str]) -> None:
    """Serve the host ``make()`` builds on ``--host:--port`` with the token, root and body limit of the command line,
    requests in parallel (the host keeps its own order); ``line``: the ready line's words after the URL."""
    import torch
    from transformers.utils import logging as hf_logging

    from models.service.launch import serve
    from models.service.server import Settings

    token = (os.environ.get(args.token_env) or None) if args.token_env else None  # never the command line: ps
    if args.token_env and token is None:
        raise SystemExit(f"--token-env {args.token_env}: the environment variable is not set or empty")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    host = make()

    def announce(server) -> None:
        print(f"{host.label} ready on {server.url} ({line(host)}; auth: {'on' if token else 'off'})", flush=True)

    try:
        serve(host, Settings(token, args.storage_root, max_body_bytes=args.max_body_bytes, serial=False), announce,
              args.host, args.port)
    finally:
        host.close()


def _config(cls, args: argparse.Namespace, **given):
    """``cls`` (a host's config) from the options of the same names."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}, **given)


def serve(args: argparse.Namespace) -> None:
    import torch

    from models.hosts.reward_critic import RewardCriticHost, ServiceConfig

    if not (args.critic_url or args.reward_model_url):
        raise SystemExit("serve: give --critic, --reward-model or both")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _serve(args, lambda: RewardCriticHost.load(_config(ServiceConfig, args)),
           lambda host: f"parts: {', '.join(host.parts)}")


def serve_rollout(args: argparse.Namespace) -> None:
    from models.hosts.rollout import RolloutHost, RolloutServiceConfig

    def make() -> RolloutHost:
        try:
            return RolloutHost(_config(RolloutServiceConfig, args))
        except ValueError as err:  # bad settings, or a checkpoint that is not committed
            raise SystemExit(f"serve-rollout: {err}") from err

    _serve(args, make, lambda host: f"engine: {args.engine}")


def resident(args: argparse.Namespace) -> None:
    from models.hosts.resident import serve_launch

    serve_launch(args.command, args.launch)


def prepare() -> None:
    """What a service's process sets before torch, transformers and vLLM load."""
    console.quiet_libraries()  # RLHF_VERBOSE=1: all their output
    skip_unused_optional_imports()  # transformers without scikit-learn (models/library_imports.py)
    use_huge_pages()  # before torch allocates (models/memory.py)
    # Large allocations in their own mappings, given back when freed, as a trainer rank's: an engine service frees
    # its weights and KV cache from each rollout to the push (models/engines/in_rank.py), and under glibc's dynamic
    # threshold the layers' blocks (up to 32 MiB) stayed in its arenas: 1 GiB of the 2.4 GB of float32 weights at
    # Qwen3-0.6B's shape.
    bound_heap()


def main(argv: Optional[List[str]] = None) -> None:
    prepare()
    if argv and argv[0] == "ranks":
        from models.hosts.ranks import main as ranks

        return ranks(argv[1:])
    args = _parser().parse_args(argv)
    {"serve": serve, "serve-rollout": serve_rollout, **dict.fromkeys(RESIDENT, resident)}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
