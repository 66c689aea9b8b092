"""Rollout: vLLM vs Hugging Face ``generate`` tokens/s, and new weights into a running engine.

    python benchmarks/bench_rollout.py [--quick] [--threads N] [--json PATH]

Both parts use random-init Llama checkpoints built by ``models/demos/tiny.py`` with the character
tokenizer's vocabulary: 8 layers x 512 hidden (8 heads of 64, MLP 1536, 27M parameters),
float32; quick: 4 x 256.

1. Generation: :class:`models.engines.VLLMEngine` (in-process, ``enforce_eager``) and
   :class:`models.engines.HFEngine` sample 256 reversal-task prompts x exactly 128 new tokens
   (``min_new_tokens = max_new_tokens``, so stop tokens cannot end a response early and both
   sides do the same work; quick: 32 x 32) after a warm-up; tokens/s of one timed run each.
2. Weights: ``load_weights`` with another checkpoint of the same shape (vLLM
   ``reload_weights`` + ``reset_prefix_cache``, behind the layout check) vs a fresh
   ``VLLMEngine`` start on it (engine start + warm-up generate); medians. The reload counts
   only if the engine then serves the new weights: its greedy tokens and log-probs on 16
   prompts must equal those of a fresh engine on the new checkpoint.

torch runs with ``--threads`` threads on both sides (set before vLLM starts: its CPU backend
refuses ``torch.set_num_threads`` afterwards); the count each side ran with is printed.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

if TYPE_CHECKING:
    from models.engines import GenerationEngine, VLLMEngine


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    prompts: int
    new_tokens: int
    reloads: int
    starts: int


FULL = Size(layers=8, hidden=512, prompts=256, new_tokens=128, reloads=5, starts=3)
QUICK = Size(layers=4, hidden=256, prompts=32, new_tokens=32, reloads=3, starts=1)
CHECK_PROMPTS, CHECK_TOKENS = 16, 16


def build_checkpoints(size: Size, root: Path) -> Tuple[str, str, List[List[int]]]:
    """Two random actors of one shape (seeds 0 and 1) and the prompts as token ids."""
    from transformers.utils import logging as hf_logging

    from models.demos.reverse_task import PromptGenerator, ReverseTaskConfig
    from models.demos.tiny import TinyModelConfig, build_actor, save_model
    from models.demos.tokenizer import build_char_tokenizer

    hf_logging.disable_progress_bar()
    tok = build_char_tokenizer()
    dirs = []
    for seed in (0, 1):
        cfg = TinyModelConfig(hidden_size=size.hidden, num_layers=size.layers, num_heads=size.hidden // 64,
                              num_kv_heads=size.hidden // 64, intermediate_size=3 * size.hidden,
                              max_position_embeddings=256, seed=seed)
        dirs.append(str(save_model(build_actor(cfg, tok), tok, root / f"actor-{seed}")))
    prompts = tok(PromptGenerator(ReverseTaskConfig(), "train", seed=0).prompts(size.prompts)).input_ids
    return dirs[0], dirs[1], prompts


def tokens_per_s(engine: "GenerationEngine", prompts: List[List[int]], new_tokens: int) -> Tuple[float, float]:
    """(tokens/s, seconds) of one sampled run; every response must be exactly ``new_tokens`` long."""
    from models.engines import SamplingSpec

    spec = SamplingSpec(temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, seed=0)
    engine.generate(prompts[:8], spec)  # warm-up
    t0 = time.perf_counter()
    out = engine.generate(prompts, spec)
    seconds = time.perf_counter() - t0
    lengths = {len(g.tokens) for gens in out for g in gens}
    if lengths != {new_tokens}:
        raise RuntimeError(f"{type(engine).__name__} gave response lengths {sorted(lengths)}, not {new_tokens}")
    return len(prompts) * new_tokens / seconds, seconds


def greedy(engine: "GenerationEngine", prompts: List[List[int]]) -> Tuple[List[List[int]], List[float]]:
    from models.engines import SamplingSpec

    out = engine.generate(prompts, SamplingSpec(temperature=0.0, max_new_tokens=CHECK_TOKENS))
    return [g[0].tokens for g in out], [lp for g in out for lp in g[0].logprobs]


def bench_generate(size: Size, ckpt: str, prompts: List[List[int]]) -> Tuple[Row, "VLLMEngine"]:
    """The tokens/s row, and the vLLM engine (serving ``ckpt``) for the weights part."""
    import torch

    from models.engines import HFEngine, VLLMEngine

    hf = HFEngine(ckpt)
    hf_tps, hf_s = tokens_per_s(hf, prompts, size.new_tokens)
    hf_threads = torch.get_num_threads()
    hf.close()
    del hf
    gc.collect()
    engine = VLLMEngine(ckpt, kv_cache_gib=2)
    vllm_tps, vllm_s = tokens_per_s(engine, prompts, size.new_tokens)
    vllm_threads = torch.get_num_threads()
    detail = (f"{size.layers}x{size.hidden}, {len(prompts)} prompts x {size.new_tokens} tokens: vLLM {vllm_tps:.0f} "
              f"tok/s ({vllm_s:.1f} s, {vllm_threads} threads), HF {hf_tps:.0f} tok/s ({hf_s:.1f} s, "
              f"{hf_threads} threads)")
    return row("rollout", "vLLM vs HF generate tokens/s", vllm_tps / hf_tps, "x", detail), engine


def bench_weights(size: Size, engine: "VLLMEngine", old: str, new: str, prompts: List[List[int]]) -> List[Row]:
    """In-place reload vs fresh start, and whether the reloaded engine serves ``new``."""
    from models.engines import VLLMEngine

    check = prompts[:CHECK_PROMPTS]
    old_tokens, _ = greedy(engine, check)  # also fills the prefix cache with old-weight blocks
    reload_s = []
    for i in range(size.reloads):  # new, old, new, ...: always a different checkpoint; ends on new
        t0 = time.perf_counter()
        engine.load_weights(new if i % 2 == 0 else old)
        reload_s.append(time.perf_counter() - t0)
    if size.reloads % 2 == 0:
        engine.load_weights(new)
    in_place = engine.stats.restarts == 0
    reloaded = greedy(engine, check)
    engine.close()
    del engine
    gc.collect()
    start_s, fresh = [], None
    for _ in range(size.starts):
        t0 = time.perf_counter()
        started = VLLMEngine(new, kv_cache_gib=2)
        start_s.append(time.perf_counter() - t0)
        if fresh is None:
            fresh = greedy(started, check)
        started.close()
        del started
        gc.collect()
    same_tokens = reloaded[0] == fresh[0]
    logp_err = max(abs(a - b) for a, b in zip(reloaded[1], fresh[1])) if same_tokens else float("inf")
    changed = sum(a != b for o, r in zip(old_tokens, reloaded[0]) for a, b in zip(o, r))
    serves_new = in_place and same_tokens and logp_err <= 1e-4 and changed > 0  # changed: the check can tell
    reload_med, start_med = statistics.median(reload_s), statistics.median(start_s)
    ratio = start_med / reload_med
    verdict = "serves the new weights" if serves_new else "DOES NOT serve the new weights (or restarted)"
    rows = [
        row("rollout", "weights: in-place reload vs engine restart", ratio if serves_new else None, "x",
            f"reload {reload_med * 1e3:.0f} ms (median of {size.reloads}), restart {start_med:.1f} s "
            f"(median of {size.starts}); {verdict}", at_least=20),
        row("rollout", "reloaded vs fresh engine: max |Δ log-prob|", logp_err, "nats",
            f"{CHECK_PROMPTS} prompts x {CHECK_TOKENS} greedy tokens, tokens equal: {same_tokens}; "
            f"{changed} of {CHECK_PROMPTS * CHECK_TOKENS} tokens differ from the old weights' ones", at_most=1e-4),
    ]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)  # before vLLM: its CPU worker freezes the count
    size = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as root:
        old, new, prompts = build_checkpoints(size, Path(root))
        gen_row, engine = bench_generate(size, old, prompts)
        rows = [gen_row] + bench_weights(size, engine, old, new, prompts)
    print_rows(rows)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
