"""AdamW carried across iterations: the optimizer state committed beside the checkpoint an update starts
from is loaded before it trains and committed beside the checkpoint it writes
(``actor.keep_optimizer_state``, ``critic.keep_optimizer_state``; :mod:`models.training.optimizer_state`)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from models.training import optimizer_state
from models.training.files import optimizer_url
from models.timing import timed
from models.training.distributed import DistInfo
from models.training.update import make_optimizer


def carried_optimizer(model, lr: float, weight_decay: float, from_url: str, keep: bool, times: Dict[str, float],
                      role: str, info: Optional[DistInfo] = None) -> Tuple[torch.optim.Optimizer, int]:
    """AdamW for ``model`` and the optimizer steps it has already taken: with ``keep``, its state is
    the one committed beside ``from_url`` (the checkpoint this update starts from) when there is
    one that fits; else fresh (0 steps)."""
    optimizer = make_optimizer(model, lr, weight_decay)
    if not keep:
        return optimizer, 0
    with timed(times, f"time/{role}_optimizer_state_s"):
        return optimizer, optimizer_state.load(model, optimizer, optimizer_url(from_url), info, role) or 0


def commit_optimizer(model, optimizer: torch.optim.Optimizer, checkpoint_url: str, keep: bool,
                     times: Dict[str, float], role: str, info: DistInfo, sharded: bool = False) -> None:
    """With ``keep``, commit the optimizer's state beside the checkpoint it trained (every rank calls;
    the counterpart of :func:`carried_optimizer`)."""
    if keep:
        with timed(times, f"time/{role}_optimizer_state_s"):
            optimizer_state.save(model, optimizer, optimizer_url(checkpoint_url), info, sharded)
