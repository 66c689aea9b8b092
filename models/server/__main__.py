"""``python -m models.server serve --critic URL --reward-model URL [...]``: run the reward/critic server;
``python -m models.server serve-rollout --checkpoint URL --engine vllm|hf [...]``: the rollout server.

The bearer token is read from the environment variable named by ``--token-env`` (never
from the command line, where ``ps`` would show it). The socket is bound before the app
starts, so ``--port 0`` picks a free port; one line is printed when the server accepts
requests::

    reward server ready on http://127.0.0.1:8123 (parts: critic, reward_model; auth: on)
    rollout server ready on http://127.0.0.1:8124 (engine: vllm; auth: on)
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import List, Optional, Tuple

from models import console


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.server", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="load the models and serve /infer, /train, /save, /health",
                       allow_abbrev=False)  # "--token VALUE" must not pass as --token-env
    s.add_argument("--critic", default="", help="committed critic checkpoint URL (token classification)")
    s.add_argument("--reward-model", default="", help="committed reward model URL (sequence classification)")
    _common_args(s, port=8123)
    s.add_argument("--storage-root", default="", help="fsspec URL under which /save may write (else refused)")
    s.add_argument("--max-batch-size", type=int, default=64, help="most samples per model batch")
    s.add_argument("--max-delay-ms", type=float, default=10.0, help="longest wait to fill a batch")
    s.add_argument("--lr", type=float, default=5e-5, help="critic AdamW learning rate")
    s.add_argument("--weight-decay", type=float, default=0.0, help="critic AdamW weight decay")
    s.add_argument("--device", default="", help="torch device (default: cuda if available, else cpu)")
    s.add_argument("--no-pack-sequences", action="store_true",
                   help="critic forwards on padded rows (default: rows packed end to end where the model allows)")

    r = sub.add_parser("serve-rollout", help="start a generation engine and serve /generate, /health",
                       allow_abbrev=False)
    r.add_argument("--checkpoint", required=True, help="committed policy checkpoint URL the engine starts from")
    r.add_argument("--engine", default="vllm", choices=("vllm", "hf"), help="generation engine")
    _common_args(r, port=8124)
    r.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM KV-cache space on CPU (GiB)")
    r.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="fraction of GPU memory for vLLM")
    r.add_argument("--max-model-len", type=int, default=0, help="vLLM context length (0: the model's own)")
    r.add_argument("--max-lora-rank", type=int, default=0, help="vLLM: serve LoRA adapters up to this rank")
    r.add_argument("--seed", type=int, default=0, help="vLLM engine seed (requests carry their own)")
    r.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vLLM workers the engine is split over (GPUs, or groups of CPU cores)")
    r.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas, each in its own process, requests' prompts dealt among them")
    return parser


def _common_args(p: argparse.ArgumentParser, port: int) -> None:
    """Binding, authentication and request limits, the same for both servers."""
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=port, help="TCP port; 0 picks a free one")
    p.add_argument("--token-env", default="", help="name of the environment variable holding the bearer token")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="largest request body")
    p.add_argument("--max-samples", type=int, default=1024, help="most samples per request")
    p.add_argument("--max-tokens", type=int, default=8192, help="most prompt+response tokens per sample")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (a critic trains and saves float32 master weights)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level")


def _token(env_name: str) -> Optional[str]:
    if not env_name:
        return None
    value = os.environ.get(env_name, "")
    if not value:
        raise SystemExit(f"--token-env {env_name}: the environment variable is not set or empty")
    return value


def _settings(args: argparse.Namespace, **batching):
    """The token and limits of the command line, as :class:`ServerSettings`; sets this process's
    torch threads and keeps progress bars off the server's output."""
    import torch
    from transformers.utils import logging as hf_logging

    from models.server.app import ServerSettings

    token = _token(args.token_env)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    return ServerSettings(max_body_bytes=args.max_body_bytes, max_samples_per_request=args.max_samples,
                          max_tokens_per_sample=args.max_tokens, token=token, **batching)


def _bind(host: str, port: int) -> Tuple[socket.socket, str]:
    """A listening socket (bound before the app starts, so port 0 works) and the URL it serves."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    host, port = sock.getsockname()[:2]
    return sock, f"http://{f'[{host}]' if family == socket.AF_INET6 else host}:{port}"


def _run(app, sock: socket.socket, log_level: str) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on"))
    server.run(sockets=[sock])


def serve(args: argparse.Namespace) -> None:
    import torch

    from models.server.app import create_app
    from models.server.service import RewardCriticService, ServiceConfig

    if not (args.critic or args.reward_model):
        raise SystemExit("serve: give --critic, --reward-model or both")
    settings = _settings(args, max_batch_size=args.max_batch_size, max_delay_ms=args.max_delay_ms)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = ServiceConfig(args.critic, args.reward_model, args.storage_root, args.lr, args.weight_decay,
                           device, args.dtype, pack_sequences=not args.no_pack_sequences)
    service = RewardCriticService.load(config)
    sock, url = _bind(args.host, args.port)

    def ready() -> None:
        print(f"reward server ready on {url} (parts: {', '.join(service.parts)}; "
              f"auth: {'on' if settings.token else 'off'})", flush=True)

    _run(create_app(service, settings, on_ready=ready), sock, args.log_level)


def serve_rollout(args: argparse.Namespace) -> None:
    from models.server.rollout_app import create_rollout_app
    from models.server.rollout_service import RolloutService, RolloutServiceConfig

    settings = _settings(args)
    try:
        service = RolloutService(RolloutServiceConfig(
            args.checkpoint, args.engine, args.dtype, args.kv_cache_gib, args.gpu_memory_utilization,
            args.max_model_len, args.max_lora_rank, args.seed, args.threads, args.tensor_parallel_size,
            args.data_parallel_size))
    except ValueError as err:  # bad settings, or a checkpoint that is not committed
        raise SystemExit(f"serve-rollout: {err}") from err
    sock, url = _bind(args.host, args.port)

    def ready() -> None:
        print(f"rollout server ready on {url} (engine: {args.engine}; auth: {'on' if settings.token else 'off'})",
              flush=True)

    try:
        _run(create_rollout_app(service, settings, on_ready=ready), sock, args.log_level)
    finally:
        service.close()


def main(argv: Optional[List[str]] = None) -> None:
    console.quiet_libraries()  # before torch, transformers and vLLM load (RLHF_VERBOSE=1: all their output)
    args = _parser().parse_args(argv)
    {"serve": serve, "serve-rollout": serve_rollout}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
