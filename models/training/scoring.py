"""Scoring forwards over a batch in micro-batches: π_old, π_ref log-probs and critic values.

Inputs are micro-batches of :class:`models.data.batch_tensors.ModelInputs`; outputs are flat float32
arrays in row-major response order (row 0's tokens, then row 1's, ...), which is exactly
the values buffer of a ragged Arrow list column.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import numpy as np
import torch

from models.training.policy import CriticValues, PolicyLogprobs, inputs_to, reward_model_scores


def _flat(x: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    return x[mask.bool()].float().cpu().numpy()  # row-major over [B, T]


@torch.no_grad()
def score_microbatches(micro_batches: Iterable, actor: Optional[PolicyLogprobs] = None,
                       reference: Optional[PolicyLogprobs] = None, critic: Optional[CriticValues] = None,
                       reward_model: Optional[torch.nn.Module] = None, temperature: float = 1.0,
                       device: str | torch.device = "cpu") -> Dict[str, np.ndarray]:
    """Run every given model over every micro-batch once.

    Returns ``old_logprobs``, ``ref_logprobs``, ``values`` (flat, per response token),
    ``entropy`` (flat; the policy's, for diagnostics) and ``rm_reward`` (``[B]``) for the
    models given.
    """
    parts: Dict[str, list] = {}
    for inputs in micro_batches:
        inputs = inputs_to(inputs, device)
        mask = inputs.response_mask
        if actor is not None:
            logp, ent = actor(inputs, temperature=temperature, with_entropy=True)
            parts.setdefault("old_logprobs", []).append(_flat(logp, mask))
            parts.setdefault("entropy", []).append(_flat(ent, mask))
        if reference is not None:
            ref, _ = reference(inputs, temperature=temperature, with_entropy=False)
            parts.setdefault("ref_logprobs", []).append(_flat(ref, mask))
        if critic is not None:
            parts.setdefault("values", []).append(_flat(critic(inputs), mask))
        if reward_model is not None:
            parts.setdefault("rm_reward", []).append(reward_model_scores(reward_model, inputs).cpu().numpy())
    return {k: np.concatenate(v) if v else np.zeros(0, np.float32) for k, v in parts.items()}
