"""Does the engine serve the weights the trainer trains? A cheap check after every weight change.

A few fixed token sequences (:func:`probe_sequences`, seeded, from the tokenizer's ids) go through
the engine (``prompt_logprobs``: its log-probs of each token given the ones before, temperature 1)
and through the trainer's own forward (:class:`models.training.policy.PolicyLogprobs` on the checkpoint as
:func:`models.training.lora.load_pretrained` loads it for scoring: full weights, or base + adapter). The
largest absolute difference is the gap. Above the tolerance the engine is restarted from the
checkpoint, with a message; if the gap persists, :class:`EngineMismatchError` stops the run naming
the largest gap and where (sequence, position, token id, both values).

Weights copied into the engine from a trainer's memory (``run.resident``) have no checkpoint to load
or restart from: :func:`reference_logprobs` computes the same reference from the trainer's model in
memory and :func:`verify_reference` checks the engine against it, raising at once.

Catches what a reload can get wrong silently: a stale tied ``lm_head`` (vLLM on CPU), an adapter
the engine applies differently, a merge that changed the model, an architecture the engine
computes differently from transformers. Costs one forward of 4 × 16 tokens on each side, plus
loading the trainer's model once per checkpoint (cached per process).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from models import memory
from models.checkpoint import download_checkpoint

log = logging.getLogger(__name__)

PROBE_SEQUENCES = 4
PROBE_LENGTH = 16
LOW_PRECISION_PROBE_TOLERANCE = 0.5
"""Smallest probe tolerance (nats) when the engine or the trainer computes in bfloat16/float16: rounding
alone moved log-probs by 0.002-0.06 nats between vLLM in bfloat16 and a float32 forward on the test
models (larger logits, larger gaps), and by up to 0.4 nats/token on real ones (docs/howto/train_your_own.md, "Speed")."""


def effective_tolerance(asked: float, engine_dtype: str, trainer_dtype: str) -> float:
    """``asked``, raised to :data:`LOW_PRECISION_PROBE_TOLERANCE` unless engine and trainer both compute in
    float32 (0 stays 0: the probe is off)."""
    exact = engine_dtype == trainer_dtype == "float32"
    return asked if exact or asked == 0 else max(asked, LOW_PRECISION_PROBE_TOLERANCE)


class EngineMismatchError(RuntimeError):
    """The engine's log-probs differ from the trainer's beyond the tolerance, even after a restart."""


@dataclass(frozen=True)
class ProbeResult:
    """Largest and mean |engine − trainer| log-prob over the probe tokens, and where the largest is."""

    gap_max: float
    gap_mean: float
    sequence: int
    position: int
    token: int
    engine: float
    trainer: float
    restarted: bool = False

    def where(self) -> str:
        return (f"sequence {self.sequence}, position {self.position} (token id {self.token}): engine "
                f"{self.engine:.6f} vs trainer {self.trainer:.6f}")


def _vocab_size(checkpoint_dir: str) -> int:
    """Ids the probe draws from: the tokenizer's (the model's padded rows are never real tokens)."""
    from models.checkpoint.local import cached_tokenizer

    return len(cached_tokenizer(checkpoint_dir))


def probe_sequences(vocab_size: int, n: int = PROBE_SEQUENCES, length: int = PROBE_LENGTH) -> List[List[int]]:
    """``n`` fixed pseudo-random sequences of ``length`` token ids in ``[0, vocab_size)`` (seed 0)."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, length).tolist() for _ in range(n)]


Sequences = Tuple[Tuple[int, ...], ...]
Logprobs = Tuple[Tuple[float, ...], ...]


@functools.lru_cache(maxsize=4)
def trainer_logprobs(policy_dir: str, fetch: Callable[[str], str] = download_checkpoint, dtype: str = "float32"
                     ) -> Tuple[Sequences, Logprobs]:
    """``(sequences, log-probs)``: the probe sequences of the policy in ``policy_dir`` (full weights
    or a LoRA adapter, its base fetched with ``fetch``) and the trainer's log-probs of tokens 1.. of
    each, at temperature 1, with the weights loaded in ``dtype`` as ``score`` loads them (cached per
    process, folder and dtype)."""
    return _trainer_logprobs(policy_dir, fetch, dtype)


def _device_for(policy_dir: str, dtype: str) -> str:
    """A GPU when one has room for the weights (the engine holds its share), else the CPU."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    files = [os.path.join(policy_dir, f) for f in os.listdir(policy_dir) if f.endswith(".safetensors")]
    need = sum(os.path.getsize(f) for f in files) * (2 if dtype == "float32" else 1)  # stored float32 at most
    return "cuda" if torch.cuda.mem_get_info()[0] > 1.5 * need else "cpu"


def _trainer_logprobs(policy_dir: str, fetch: Callable[[str], str], dtype: str = "float32"
                      ) -> Tuple[Sequences, Logprobs]:
    import torch
    from transformers import AutoModelForCausalLM

    from models.training.lora import base_url, is_adapter, load_pretrained

    tokenizer_dir = fetch(base_url(policy_dir)) if is_adapter(policy_dir) and not _has_tokenizer(policy_dir) \
        else policy_dir
    seqs = probe_sequences(_vocab_size(tokenizer_dir))
    device = _device_for(tokenizer_dir if is_adapter(policy_dir) else policy_dir, dtype)
    lm = load_pretrained(policy_dir, AutoModelForCausalLM, getattr(torch, dtype), fetch).to(device)
    out = tuple(map(tuple, seqs)), _forward_logprobs(lm, seqs)
    freed = memory.nbytes(lm)
    del lm
    memory.release(freed)  # a whole copy of the weights, loaded in the rollout's process: back to the machine
    return out


def reference_logprobs(model, vocab_size: int) -> Tuple[Sequences, Logprobs]:
    """``(sequences, log-probs)`` as :func:`trainer_logprobs` gives them, from a causal LM in memory
    (the trainer's :class:`models.training.policy.PolicyLogprobs` or the Hugging Face model it wraps)
    in its own dtype and on its own device: the probe sequences of a tokenizer of ``vocab_size`` ids
    (``len(tokenizer)``) and the model's log-probs of tokens 1.. of each, at temperature 1. The
    model's train/eval mode is left as it was."""
    seqs = probe_sequences(vocab_size)
    return tuple(map(tuple, seqs)), _forward_logprobs(model, seqs)


def _forward_logprobs(model, seqs: List[List[int]]) -> Logprobs:
    import pyarrow as pa
    import torch

    from models.data.batch_tensors import model_inputs
    from models.training.policy import PolicyLogprobs, inputs_to

    policy = model if isinstance(model, PolicyLogprobs) else PolicyLogprobs(model)
    device = next(policy.parameters()).device
    table = pa.table({"prompt_tokens": [s[:1] for s in seqs], "response_tokens": [s[1:] for s in seqs]})
    training = policy.training
    try:
        with torch.no_grad():
            inputs = inputs_to(model_inputs(table, 0), device)
            logp, _ = policy.eval()(inputs, temperature=1.0, with_entropy=False)  # [B, L-1]
    finally:
        policy.train(training)
        if hasattr(model, "reshard"):  # an FSDP2 root stays gathered after a forward: no backward follows this one
            model.reshard()
    return tuple(tuple(float(x) for x in row) for row in logp.float().cpu())


def _has_tokenizer(local_dir: str) -> bool:
    return os.path.isfile(os.path.join(local_dir, "tokenizer_config.json"))


def compare(engine, sequences: Sequence[Sequence[int]], reference: Sequence[Sequence[float]]) -> ProbeResult:
    """The engine's log-probs of ``sequences`` against the trainer's ``reference``."""
    return _gaps(sequences, engine.prompt_logprobs([list(s) for s in sequences]), reference)


def _gaps(sequences: Sequence[Sequence[int]], got: Sequence[Sequence[float]],
          reference: Sequence[Sequence[float]]) -> ProbeResult:
    gaps = [np.abs(np.asarray(g, np.float64) - np.asarray(r, np.float64)) for g, r in zip(got, reference)]
    i = int(np.argmax([g.max() for g in gaps]))
    t = int(np.argmax(gaps[i]))
    return ProbeResult(float(gaps[i][t]), float(np.mean(np.concatenate(gaps))), i, t + 1, int(sequences[i][t + 1]),
                       float(got[i][t]), float(reference[i][t]))


def _gap_text(result: ProbeResult, tolerance: float) -> str:
    return f"{result.gap_max:.3g} nats (tolerance {tolerance:g}, rollout.probe_tolerance) at {result.where()}"


def verify(engine, policy_dir: str, tolerance: float, restart: Callable[[], None],
           fetch: Callable[[str], str] = download_checkpoint, what: str = "", dtype: str = "float32") -> ProbeResult:
    """Check that ``engine`` serves the policy in ``policy_dir`` (the trainer's forward in ``dtype``);
    restart it once (``restart``) if not; raise :class:`EngineMismatchError` if that did not help."""
    sequences, reference = trainer_logprobs(policy_dir, fetch, dtype)
    return _verified(engine, sequences, reference, tolerance, restart, lambda missed: missed, what or policy_dir,
                     ("log-probs differ by up to {gap}; restarting the engine from the checkpoint",
                      "log-probs still differ after restarting the engine from the checkpoint: largest gap {gap}"))


_ENDING = (". The engine does not compute this model as the trainer does, so sampling from it would not be on-policy: "
           "try rollout.engine=hf, or another rollout.vllm_dtype")


def _verified(engine, sequences, reference, tolerance: float, restart: Callable[[], None],
              any_rank: Callable[[bool], bool], name: str, texts: Tuple[str, str]) -> ProbeResult:
    """The probe, one restart when ``any_rank(missed)``, and :class:`EngineMismatchError` when it still misses;
    ``texts``: the miss's and the failure's messages, ``{gap}`` where the gap goes."""
    result = compare(engine, sequences, reference)
    if not any_rank(result.gap_max > tolerance):
        return result
    message = f"rollout engine vs trainer on {name}: " + texts[0].format(gap=_gap_text(result, tolerance))
    log.warning(message)
    print(message, flush=True)
    restart()
    again = compare(engine, sequences, reference)
    if any_rank(again.gap_max > tolerance):
        raise EngineMismatchError(f"rollout engine vs trainer on {name}: " +
                                  texts[1].format(gap=_gap_text(again, tolerance)) + _ENDING)
    print(f"rollout engine vs trainer on {name}: {again.gap_max:.3g} nats after the restart", flush=True)
    return dataclasses.replace(again, restarted=True)


def verify_reference(engine, sequences: Sequence[Sequence[int]], reference: Sequence[Sequence[float]],
                     tolerance: float, what: str) -> ProbeResult:
    """Check that ``engine`` serves the weights a trainer holds in memory (``reference``: its
    :func:`reference_logprobs` of ``sequences``) after :meth:`~models.engines.base.SwappableEngine.load_tensors`;
    the gap goes to ``engine.stats.extra["probe_gap_max"]``. No restart: there is no checkpoint of
    these weights to restart from, so a gap over ``tolerance`` raises :class:`EngineMismatchError`
    and the caller stops the run with its message."""
    result = compare(engine, sequences, reference)
    engine.stats.extra["probe_gap_max"] = result.gap_max
    if result.gap_max > tolerance:
        raise EngineMismatchError(
            f"rollout engine vs trainer on {what}: after the trainer's weights were copied into the engine in "
            f"memory, log-probs differ by up to {_gap_text(result, tolerance)}. The engine does not serve the "
            f"weights the trainer holds, so sampling from it would not be on-policy: the run stops")
    return result


def verify_together(engine, sequences: Sequence[Sequence[int]], reference: Sequence[Sequence[float]], tolerance: float,
                    restart: Callable[[], None], any_rank: Callable[[bool], bool], what: str) -> ProbeResult:
    """:func:`verify` for engines in the ranks of one launch (``run.resident_layout=colocated``), against the
    trainer's ``reference`` (its :func:`reference_logprobs` of ``sequences``, from the weights the ranks hold: no
    checkpoint is read). Whether to restart is decided by every rank together: ``any_rank(missed)`` (every rank
    calls it, every rank gets the same answer) is whether any rank's gap is over ``tolerance``; then every rank
    restarts (a tensor-parallel engine's restart runs collectives over the whole world) and probes again, and
    every rank raises :class:`EngineMismatchError` if any rank still misses."""
    return _verified(engine, sequences, reference, tolerance, restart, any_rank, what,
                     ("a rank's log-probs differ by more than the tolerance (this rank: {gap}); every rank restarts "
                      "its engine", "log-probs still differ on some rank after every rank restarted its engine (this "
                      "rank: {gap})"))


_VERIFIED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ensure_serves(engine, key: tuple, policy_dir: str, tolerance: float, restart: Callable[[], None],
                  fetch: Callable[[str], str] = download_checkpoint, what: str = "",
                  dtype: str = "float32") -> Optional[ProbeResult]:
    """:func:`verify` once per engine and served weights ``key`` (None when ``tolerance`` is 0: off);
    the result's gap goes to ``engine.stats.extra["probe_gap_max"]``."""
    if tolerance <= 0:
        return None
    done = _VERIFIED.get(engine)
    if done is not None and done[0] == key:
        return done[1]
    result = verify(engine, policy_dir, tolerance, restart, fetch, what, dtype)
    _VERIFIED[engine] = (key, result)
    engine.stats.extra["probe_gap_max"] = result.gap_max
    return result


def compare_policies(policy_a: str, policy_b: str, fetch: Callable[[str], str] = download_checkpoint) -> ProbeResult:
    """Two checkpoints (full or adapter, same tokenizer) through the trainer's forward on the probe
    sequences: ``trainer`` in the result is ``policy_a``'s log-prob, ``engine`` ``policy_b``'s."""
    sequences, a = trainer_logprobs(policy_a, fetch)
    _, b = _trainer_logprobs(policy_b, fetch)  # not cached: policy_b is often a fresh folder
    return _gaps(sequences, b, a)
