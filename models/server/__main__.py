"""``python -m models.server serve --critic URL --reward-model URL [...]``: run the server.

The bearer token is read from the environment variable named by ``--token-env`` (never
from the command line, where ``ps`` would show it). The socket is bound before the app
starts, so ``--port 0`` picks a free port; one line is printed when the server accepts
requests::

    reward server ready on http://127.0.0.1:8123 (parts: critic, reward_model; auth: on)
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.server", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="load the models and serve /infer, /train, /save, /health",
                       allow_abbrev=False)  # "--token VALUE" must not pass as --token-env
    s.add_argument("--critic", default="", help="committed critic checkpoint URL (token classification)")
    s.add_argument("--reward-model", default="", help="committed reward model URL (sequence classification)")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8123, help="TCP port; 0 picks a free one")
    s.add_argument("--token-env", default="", help="name of the environment variable holding the bearer token")
    s.add_argument("--storage-root", default="", help="fsspec URL under which /save may write (else refused)")
    s.add_argument("--max-batch-size", type=int, default=64, help="most samples per model batch")
    s.add_argument("--max-delay-ms", type=float, default=10.0, help="longest wait to fill a batch")
    s.add_argument("--max-body-bytes", type=int, default=16 << 20, help="largest request body")
    s.add_argument("--max-samples", type=int, default=1024, help="most samples per request")
    s.add_argument("--max-tokens", type=int, default=8192, help="most prompt+response tokens per sample")
    s.add_argument("--lr", type=float, default=5e-5, help="critic AdamW learning rate")
    s.add_argument("--weight-decay", type=float, default=0.0, help="critic AdamW weight decay")
    s.add_argument("--device", default="", help="torch device (default: cuda if available, else cpu)")
    s.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    s.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)")
    s.add_argument("--log-level", default="warning", help="uvicorn log level")
    return parser


def _token(env_name: str) -> Optional[str]:
    if not env_name:
        return None
    value = os.environ.get(env_name, "")
    if not value:
        raise SystemExit(f"--token-env {env_name}: the environment variable is not set or empty")
    return value


def serve(args: argparse.Namespace) -> None:
    import torch
    import uvicorn
    from transformers.utils import logging as hf_logging

    from models.server.app import ServerSettings, create_app
    from models.server.service import RewardCriticService, ServiceConfig

    if not (args.critic or args.reward_model):
        raise SystemExit("serve: give --critic, --reward-model or both")
    token = _token(args.token_env)
    settings = ServerSettings(args.max_batch_size, args.max_delay_ms, args.max_body_bytes, args.max_samples,
                              args.max_tokens, token)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = ServiceConfig(args.critic, args.reward_model, args.storage_root, args.lr, args.weight_decay,
                           device, args.dtype)
    hf_logging.disable_progress_bar()  # no bars on the server's output when loading or saving
    service = RewardCriticService.load(config)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host

    def ready() -> None:
        print(f"reward server ready on http://{shown}:{port} (parts: {', '.join(service.parts)}; "
              f"auth: {'on' if token else 'off'})", flush=True)

    app = create_app(service, settings, on_ready=ready)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="on"))
    server.run(sockets=[sock])


def main(argv: Optional[List[str]] = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main(sys.argv[1:])
