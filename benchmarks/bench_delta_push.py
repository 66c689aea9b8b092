"""Delta pushes against full pushes (#48, ``run.weight_push``): bytes and seconds per push, and the density of each
update (the elements whose bfloat16 value changed), at a real width.

    flock /tmp/heavy.lock python benchmarks/bench_delta_push.py [--layers 8] [--updates 3] [--lr 1e-6]
                                                                 [--dtype bfloat16] [--quick] [--json PATH]

The trainer's float32 model is Qwen3-0.6B's shape (hidden 1024, MLP 3072, 16 query and 8 key-value heads of 128,
vocabulary 151,936, tied head) with random weights at ``--layers`` of its 28 layers (8: 281M parameters, 4.5 GB with
AdamW's state); the engine, the HF engine at ``--dtype`` started from the same weights, runs in a child process
behind the engine service's push ops (``benchmarks/bench_weight_push.py``'s), over the collective transport (gloo).
Each update is an AdamW step at ``--lr`` on a GRPO-shaped loss, ``-mean(adv * log p(token))`` over 4 random
sequences of 64 tokens with advantages of ±1 (no rollout: the gradient's shape, not its content, sets which
bfloat16 values move), then the same weights pushed twice: as a delta against the push the engine holds, then whole.
Per update: the density, the delta's bytes and seconds over the full push's (the sender's wall time, the engine's
receive, load and read-back included). Goals (#48): ≤ 0.05 of the bytes, ≤ 0.2 of the seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_weight_push import URL_LINE  # noqa: E402
from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=512)
"""Qwen3-0.6B's ``config.json`` widths (28 layers there)."""


def build(layers: int, folder: Path, quick: bool):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from models.demos.tiny import save_model
    from models.demos.tokenizer import build_char_tokenizer

    torch.manual_seed(0)
    shape = dict(QWEN3_06B, vocab_size=4096, hidden_size=256, intermediate_size=768, head_dim=32) if quick else \
        QWEN3_06B
    model = Qwen3ForCausalLM(Qwen3Config(**shape, num_hidden_layers=layers))
    save_model(model, build_char_tokenizer(), folder)
    return model.float()


def grpo_like_step(model, opt, gen) -> None:
    """One AdamW step on ``-mean(adv * log p(token_t | tokens_<t))``, random tokens, advantages ±1 per sequence."""
    import torch

    tokens = torch.randint(0, model.config.vocab_size, (4, 64), generator=gen)  # [B, T]
    adv = torch.randint(0, 2, (4, 1), generator=gen).float() * 2 - 1  # [B, 1]
    logits = model(input_ids=tokens).logits[:, :-1]  # [B, T-1, V]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T-1]
    (-(adv * logp).mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed_push(transport, client, model, version: int, plan, shadow) -> Dict[str, float]:
    import torch

    from models.training.distributed import DistInfo
    from models.training.weight_source import WeightSource

    source = WeightSource(model, DistInfo(0, 1, 0, torch.device("cpu")), prefix="")
    t0 = time.perf_counter()
    out = transport.send(client, {"version": version, "probe": []}, None, source, plan, shadow)
    return {**out, "seconds": time.perf_counter() - t0}


def start_engine(folder: Path, dtype: str):
    from models.service.client import ServiceClient

    child = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "bench_weight_push.py"), "--serve",
                              str(folder), "--engine", "hf", "--dtype", dtype], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
    line = ""
    while not line.startswith(URL_LINE):
        line = child.stdout.readline()
        if not line:
            raise SystemExit("the engine's process ended before it served")
    threading.Thread(target=child.stdout.read, daemon=True).start()  # the rest, so its pipe never fills
    return child, ServiceClient(line[len(URL_LINE):].strip(), "bench", "the engine service")


def run(args) -> List[Dict[str, float]]:
    import torch

    from models.hosts.transports import CollectiveTransport
    from models.training.weight_shadow import Shadow

    folder = Path(tempfile.mkdtemp(prefix="bench-delta-")) / "start"
    model = build(args.layers, folder, args.quick)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    child, client = start_engine(folder, args.dtype)
    transport, shadow, rows = CollectiveTransport(args.dtype), Shadow(), []
    try:
        timed_push(transport, client, model, 0, {"id": "f0", "seed": 0, "base": ""}, shadow)  # fills the shadow
        for k in range(1, args.updates + 1):
            grpo_like_step(model, opt, gen)
            delta = timed_push(transport, client, model, k, {"id": f"d{k}", "seed": k, "base": f"f{k - 1}"}, shadow)
            full = timed_push(transport, client, model, k, {"id": f"f{k}", "seed": k, "base": ""}, None)
            rows.append({"density": delta["resident/push_density"], "delta_bytes": delta["resident/weights_bytes"],
                         "full_bytes": full["resident/weights_bytes"], "delta_s": delta["seconds"],
                         "full_s": full["seconds"], "params": full["resident/weights_params"]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        transport.close()
        child.stdin.close()
        child.wait(60)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)
    parser.add_argument("--layers", type=int, default=8, help="of Qwen3-0.6B's 28 (--quick: 2, narrower)")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.quick:
        args.layers, args.updates = 2, 2
    rows = run(args)
    bytes_ratio = max(r["delta_bytes"] / r["full_bytes"] for r in rows)
    seconds_ratio = statistics.median(r["delta_s"] / r["full_s"] for r in rows)
    what = f"{'quick ' if args.quick else ''}Qwen3-0.6B width, {args.layers} layers, {rows[0]['params'] / 1e6:.0f}M " \
           f"parameters, AdamW lr {args.lr:g}, engine {args.dtype}"
    out: List[Row] = [
        row("delta_push", "density per update (changed / all)", max(r["density"] for r in rows), "x",
            f"{what}; per update {[round(r['density'], 5) for r in rows]}"),
        row("delta_push", "delta bytes / full bytes (worst update)", bytes_ratio, "x",
            f"full {rows[0]['full_bytes'] / 2**20:.1f} MiB; delta {[round(r['delta_bytes'] / 2**20, 2) for r in rows]} "
            f"MiB", at_most=0.05),
        row("delta_push", "delta seconds / full seconds (median)", seconds_ratio, "x",
            f"full {[round(r['full_s'], 2) for r in rows]} s, delta {[round(r['delta_s'], 2) for r in rows]} s "
            f"(sender's wall time, the engine's load and read-back included; gloo, one machine)", at_most=0.2),
    ]
    print_rows(out)
    write_rows(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
