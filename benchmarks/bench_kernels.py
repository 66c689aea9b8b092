"""Benchmarks of the kernels against their plain references; prints figures, asserts nothing.

    python benchmarks/bench_kernels.py [--threads N] [--batch B] [--quick] [--only gae|logprobs] [--json PATH]

- GAE: :func:`kernels.gae.compute_gae` against the reverse loop at B=256, T=1024 and
  B=64, T=8192, for right-padded masks (one span per row) and masks with gaps. "faults"
  is minor page faults per fast call: when glibc hands freed [B, T] buffers back to the
  OS between calls (it does in a small process, depending on its heap history), each call
  pays ~1-2 µs per 4 KiB page it touches again, which can double the fast time.
- Log-probs and entropy at V=32000, T=1024: time against naive ``log_softmax`` + ``gather``
  (best of several runs, in this process), and peak extra memory.

Peak extra memory is measured per variant in a fresh subprocess: it builds the inputs,
resets the kernel's resident-set high-water mark (``echo 5 > /proc/self/clear_refs``),
runs the variant once and reports ``VmHWM − VmRSS before``. That counts every page the
run touched (torch's CPU allocator has no statistics of its own), including allocator
slack, so it is an upper bound on tensor memory.

``--json PATH`` also writes the headline figures as rows for ``run_all.py`` (see
``benchmarks/rows.py``): GAE speed-ups, and for log-probs + entropy with backward the
naive/fast time and memory ratios (> 1: the fast kernel is better).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List

import torch

from kernels.gae import compute_gae, compute_gae_reference
from kernels.logprobs import (
    token_logprobs,
    token_logprobs_and_entropy,
    token_logprobs_and_entropy_from_hidden,
    token_logprobs_and_entropy_from_hidden_reference,
    token_logprobs_and_entropy_reference,
    token_logprobs_reference,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rows import Row, row, write_rows  # noqa: E402

V, T, D = 32000, 1024, 512
HEADER = (f"{'what':>16} {'naive ms':>9} {'fast ms':>9} {'time ratio':>10} "
          f"{'naive MiB':>10} {'fast MiB':>9} {'mem ratio':>9}")


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` runs after a warm-up: the least disturbed by other processes."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def bench_gae(quick: bool, rows: List[Row]) -> None:
    print("\n== GAE: compute_gae vs reverse loop (float32, γ=1, λ=0.95) ==")
    print(f"{'shape':>12} {'mask':>8} {'loop ms':>9} {'fast ms':>9} {'speed-up':>9} {'max |Δ|':>9} {'faults':>7}")
    for B, T_ in [(256, 1024), (64, 8192)]:
        g = torch.Generator().manual_seed(0)
        rewards, values = torch.randn(B, T_, generator=g), torch.randn(B, T_, generator=g)
        lengths = torch.randint(T_ // 4, T_ + 1, (B, 1), generator=g)
        spans = torch.arange(T_) < lengths
        masks = {"padded": spans, "gaps": spans & (torch.rand(B, T_, generator=g) < 0.9)}
        for name, mask in masks.items():
            loop_ms = best_ms(lambda: compute_gae_reference(rewards, values, mask, 1.0, 0.95), 1 if quick else 3)
            repeats, faults = 20 if quick else 200, _minor_faults()
            fast_ms = best_ms(lambda: compute_gae(rewards, values, mask, 1.0, 0.95), repeats)
            faults = (_minor_faults() - faults) / (repeats + 1)
            err = (compute_gae(rewards, values, mask, 1.0, 0.95).advantages
                   - compute_gae_reference(rewards, values, mask, 1.0, 0.95).advantages).abs().max().item()  # fmt: skip
            print(f"{B:>5}x{T_:<6} {name:>8} {loop_ms:9.2f} {fast_ms:9.3f} {loop_ms / fast_ms:8.1f}x {err:9.1e} "
                  f"{faults:7.0f}")  # fmt: skip
            rows.append(row("kernels", f"GAE vs reverse loop, {B}x{T_} {name}", loop_ms / fast_ms, "x",
                            f"loop {loop_ms:.2f} ms, fast {fast_ms:.3f} ms, max |Δ| {err:.1e}"))


def _logit_inputs(batch: int, dtype: torch.dtype, grad: bool):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, T, V, generator=g) * 2).to(dtype).requires_grad_(grad)
    return logits, torch.randint(0, V, (batch, T), generator=g)


def _hidden_inputs(batch: int, grad: bool):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, T, D, generator=g).requires_grad_(grad)
    weight = (torch.randn(V, D, generator=g) / D**0.5).requires_grad_(grad)
    return hidden, weight, torch.randint(0, V, (batch, T), generator=g)


def _run_logits(variant: str, logits, ids):
    fast, backward = not variant.startswith("naive"), variant.endswith("+bwd")
    if "entropy" in variant:
        fn = token_logprobs_and_entropy if fast else token_logprobs_and_entropy_reference
        out = fn(logits, ids)
        loss = out.logp.sum() + out.entropy.sum()
    else:
        loss = (token_logprobs if fast else token_logprobs_reference)(logits, ids).sum()
    if backward:
        torch.autograd.grad(loss, logits)


def _run_hidden(variant: str, hidden, weight, ids):
    naive = variant.startswith("naive")
    fn = token_logprobs_and_entropy_from_hidden_reference if naive else token_logprobs_and_entropy_from_hidden
    out = fn(hidden, weight, ids)
    if variant.endswith("+bwd"):
        torch.autograd.grad(out.logp.sum() + out.entropy.sum(), (hidden, weight))


def _run(variant: str, batch: int, dtype: torch.dtype) -> Callable[[], None]:
    backward = variant.endswith("+bwd")
    if "hidden" in variant:
        hidden, weight, ids = _hidden_inputs(batch, backward)
        return lambda: _run_hidden(variant, hidden, weight, ids)
    logits, ids = _logit_inputs(batch, dtype, backward)
    return lambda: _run_logits(variant, logits, ids)


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def memory_worker(variant: str, batch: int, dtype: str, threads: int) -> None:
    torch.set_num_threads(threads)
    small = torch.randn(2, 8, 64, requires_grad=True)  # warm up libraries on a tiny problem
    _run_logits("fast_entropy+bwd", small, torch.zeros(2, 8, dtype=torch.long))
    _run_logits("naive_entropy+bwd", small, torch.zeros(2, 8, dtype=torch.long))
    run = _run(variant, batch, getattr(torch, dtype))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kb("VmRSS")
    run()
    print(json.dumps({"extra_mb": (_status_kb("VmHWM") - before) / 1024}))


def peak_extra_mb(variant: str, batch: int, dtype: str, threads: int) -> float:
    cmd = [sys.executable, __file__, "--mem-worker", variant, "--batch", str(batch), "--dtype", dtype,
           "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_mb"]


def bench_logprobs(batch: int, threads: int, quick: bool, rows: List[Row]) -> None:
    repeats = 2 if quick else 5
    for dtype in ["float32", "bfloat16"]:
        size_mb = batch * T * V * torch.tensor([], dtype=getattr(torch, dtype)).element_size() / 2**20
        print(f"\n== log-probs from logits [{batch}, {T}, {V}] {dtype} ({size_mb:.0f} MiB of logits) ==")
        print(HEADER)
        for what in ["logp", "entropy", "logp+bwd", "entropy+bwd"]:
            t_naive = best_ms(_run(f"naive_{what}", batch, getattr(torch, dtype)), repeats)
            t_fast = best_ms(_run(f"fast_{what}", batch, getattr(torch, dtype)), repeats)
            m_naive = peak_extra_mb(f"naive_{what}", batch, dtype, threads)
            m_fast = peak_extra_mb(f"fast_{what}", batch, dtype, threads)
            print(f"{what:>16} {t_naive:9.1f} {t_fast:9.1f} {t_fast / t_naive:9.2f}x "
                  f"{m_naive:10.1f} {m_fast:9.1f} {m_fast / m_naive:8.3f}x")  # fmt: skip
            if what == "entropy+bwd":
                rows += _ratio_rows(f"log-probs+entropy fwd+bwd, logits {dtype}", t_naive, t_fast, m_naive, m_fast)
    print(f"\n== log-probs + entropy from hidden [{batch}, {T}, {D}] @ weight [{V}, {D}]ᵀ, float32 ==")
    print(HEADER)
    for what in ["hidden", "hidden+bwd"]:
        t_naive = best_ms(_run(f"naive_{what}", batch, torch.float32), max(1, repeats // 2))
        t_fast = best_ms(_run(f"fast_{what}", batch, torch.float32), max(1, repeats // 2))
        m_naive = peak_extra_mb(f"naive_{what}", batch, "float32", threads)
        m_fast = peak_extra_mb(f"fast_{what}", batch, "float32", threads)
        print(f"{what:>16} {t_naive:9.1f} {t_fast:9.1f} {t_fast / t_naive:9.2f}x "
              f"{m_naive:10.1f} {m_fast:9.1f} {m_fast / m_naive:8.3f}x")  # fmt: skip
        if what == "hidden+bwd":
            rows += _ratio_rows("log-probs+entropy fwd+bwd, from hidden", t_naive, t_fast, m_naive, m_fast)


def _ratio_rows(what: str, t_naive: float, t_fast: float, m_naive: float, m_fast: float) -> List[Row]:
    return [row("kernels", f"{what}: time naive/fast", t_naive / t_fast, "x", f"{t_naive:.1f} ms vs {t_fast:.1f} ms"),
            row("kernels", f"{what}: memory naive/fast", m_naive / m_fast, "x",
                f"{m_naive:.0f} MiB vs {m_fast:.0f} MiB extra")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 1),
                        help="torch intra-op threads (default OMP_NUM_THREADS, else 1: steady on a shared box)")
    parser.add_argument("--batch", type=int, default=1, help="B of the log-prob benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--only", choices=["gae", "logprobs"], help="run one of the two parts")
    parser.add_argument("--json", metavar="PATH", help="also write the headline figures as rows (benchmarks/rows.py)")
    parser.add_argument("--mem-worker", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mem_worker:
        memory_worker(args.mem_worker, args.batch, args.dtype, args.threads)
        return
    torch.set_num_threads(args.threads)
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU capability {cpu}")
    rows: List[Row] = []
    if args.only != "logprobs":
        bench_gae(args.quick, rows)
    if args.only != "gae":
        bench_logprobs(args.batch, args.threads, args.quick, rows)
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
