"""Weights into a running engine from memory (``SwappableEngine.load_tensors``), checked the same way
on every engine: the HF engine (unit tests), vLLM on the tiny actor, on the tied Qwen2 chat checkpoint
and split over two workers (integration tests), each reusing an engine its file already started.

"Serves B" is checked against two independent references: the trainer's forward on B's Hugging Face
model in memory (:func:`models.training.probe.reference_logprobs`, within the probe tolerance) and
the same engine's log-probs when it served B loaded from B's folder (within 1e-5)."""

from __future__ import annotations

from typing import Dict, Tuple

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.engines import EngineLoadError, pack_weights, unpack_weights
from models.training.probe import EngineMismatchError, probe_sequences, reference_logprobs, verify_reference

FOLDER_TOL = 1e-5
"""The same weights from a folder or from memory: the same copy into the engine, so equal up to float noise."""


def sent_state(ckpt: str) -> Tuple[Dict[str, torch.Tensor], torch.nn.Module]:
    """The trainer's ``state_dict()`` of the HF model of ``ckpt`` (tied keys included) as the engine
    receives it, through :func:`pack_weights`/:func:`unpack_weights`, and the model."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return unpack_weights(pack_weights(model.state_dict())), model


def _worst(got, want) -> float:
    return max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))


def check_serves_tensors(engine, served: str, other: str, tol: float) -> None:
    """``engine`` serves ``served`` (loaded from its folder). ``other``'s state from memory makes it serve
    ``other``; ``served``'s state brings back what the folder gave; bad states are refused before
    anything is copied; two reloads counted."""
    vocab = len(AutoTokenizer.from_pretrained(served))
    sequences = probe_sequences(vocab)
    from_folder = engine.prompt_logprobs(sequences)
    reloads = engine.stats.reloads
    other_state, other_model = sent_state(other)
    served_state, served_model = sent_state(served)
    served_ref = reference_logprobs(served_model, vocab)
    assert verify_reference(engine, *served_ref, tol, "served").gap_max < tol

    engine.load_tensors(other_state)
    other_ref = reference_logprobs(other_model, vocab)
    assert verify_reference(engine, *other_ref, tol, "other").gap_max < tol
    with pytest.raises(EngineMismatchError, match=r"on served: after the trainer's weights were copied into the "
                                                  r"engine in memory, log-probs differ by up to \d.*tolerance .*"
                                                  r"rollout\.probe_tolerance\) at sequence \d"):
        verify_reference(engine, *served_ref, tol, "served")  # the two are told apart
    assert engine.stats.extra["probe_gap_max"] > tol

    engine.load_tensors(served_state)
    assert _worst(engine.prompt_logprobs(sequences), from_folder) <= FOLDER_TOL
    assert verify_reference(engine, *served_ref, tol, "served").gap_max < tol
    assert engine.stats.reloads == reloads + 2
    check_refuses_bad_states(engine, other_state, sequences, from_folder)


def check_refuses_bad_states(engine, state: Dict[str, torch.Tensor], sequences, serving) -> None:
    """A state with a wrong shape or an unknown name raises :class:`EngineLoadError` naming it, and the
    engine keeps serving what it served (``serving``: its log-probs of ``sequences`` before)."""
    name = next(k for k in state if k.endswith("mlp.down_proj.weight"))
    narrow = {**state, name: state[name][:, :-1]}
    with pytest.raises(EngineLoadError, match=rf"do not fit the served model: tensor shapes differ: .*{name} "):
        engine.load_tensors(narrow)
    extra = {**state, "model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}
    with pytest.raises(EngineLoadError, match=r"unexpected \['model.layers.0.mlp.extra_proj.weight'\]"):
        engine.load_tensors(extra)
    missing = {k: v for k, v in state.items() if k != name}
    with pytest.raises(EngineLoadError, match=rf"missing \['{name}'\]"):
        engine.load_tensors(missing)
    assert _worst(engine.prompt_logprobs(sequences), serving) <= FOLDER_TOL  # nothing was copied


def check_reads_back_what_was_pushed(engine, served: str, other: str, dtype: str) -> None:
    """``engine`` serves ``served``; a push of ``other``'s tensors at ``dtype`` (the engine's) is read back bit for
    bit at sampled elements of every tensor. Claimed against ``served``'s (an engine that kept the previous
    weights), the read-back names a tensor; a push whose loader skips one tensor without a word, as vLLM's may
    (``models.faults.drop_pushed``), passes the load and fails the read-back naming that tensor. Ends serving
    ``served``."""
    from models.engines.weight_stream import PushError, bits, check_read_back
    from models.environ import environment
    from models.faults import DROP_PUSHED_ENV

    cast = getattr(torch, dtype)
    other_state = {k: v.to(cast) for k, v in engine._layout.fit(sent_state(other)[0]).items()}
    served_state = {k: v.to(cast) for k, v in engine._layout.fit(sent_state(served)[0]).items()}
    gen = torch.Generator().manual_seed(0)
    where = {k: sorted(torch.randint(0, v.numel(), (8,), generator=gen).tolist()) for k, v in other_state.items()}
    header = {"tensors": [[k, dtype, list(v.shape), 0, 0, 8] for k, v in other_state.items()]}
    dtypes = {k: dtype for k in other_state}

    def sent(state):
        return {k: list(zip(where[k], bits(state[k].reshape(-1)[where[k]]).tolist())) for k in state}

    engine.load_tensors(other_state)
    check_read_back(header, sent(other_state), engine.read_back(where, dtypes), "pushed")
    with pytest.raises(PushError, match=r"stale: the engine holds other weights than were sent in '.+': element \d+ "
                                        r"holds bits 0x[0-9a-f]+ where the trainer sent 0x[0-9a-f]+"):
        check_read_back(header, sent(served_state), engine.read_back(where, dtypes), "stale")
    name = next(k for k in served_state if k.endswith("layers.1.self_attn.v_proj.weight"))
    with environment({DROP_PUSHED_ENV: name}):
        engine.load_tensors(served_state)  # the loader says nothing
    with pytest.raises(PushError, match=rf"dropped: the engine holds other weights than were sent in '{name}'"):
        check_read_back(header, sent(served_state), engine.read_back(where, dtypes), "dropped")
    engine.load_tensors(served_state)
    check_read_back(header, sent(served_state), engine.read_back(where, dtypes), "served")
