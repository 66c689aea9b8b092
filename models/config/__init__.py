"""Typed training configuration: frozen dataclasses, checked on construction.

One :class:`TrainConfig` (``train.py``) describes a whole run; each of its sections is a module of this
package (``run.py``, ``model.py``, ``data.py``, ``rollout.py``, ``reward.py``, ``kl.py`` with ``advantage``,
``actor.py`` with ``lora`` and ``guard``, ``critic.py``, ``resources.py``), and ``checks.py`` holds
:class:`ConfigError`. Presets live in ``configs/*.yaml``; entry points load a preset and apply
``section.field=value`` overrides (:mod:`models.config.io`). The package also holds
:mod:`models.config.reference` (the docs page generated from the field docstrings). Nothing changes a
config at run time, and nothing is written back into one after construction: what depends on several
sections (the KL a run uses) is computed (``TrainConfig.kl_placement``). Defaults follow the anchors
(NeMo-Aligner, OpenRLHF, TRL): γ=1, λ=0.95, ε=0.2, value clip 0.2, fixed KL β=0.01.
"""

from models.config.actor import LLAMA_PROJECTIONS, ActorConfig, LoraConfig, StepGuardConfig
from models.config.checks import ConfigError
from models.config.critic import CriticConfig
from models.config.data import DataConfig, ReasoningGymConfig
from models.config.kl import DEFAULT_KL_ESTIMATOR, AdvantageConfig, KLConfig
from models.config.model import ModelConfig
from models.config.resources import TASKS_WITH_RESOURCES, ResourcesConfig
from models.config.reward import RewardConfig
from models.config.rollout import MIN_TRAIN_TEMPERATURE, RolloutConfig
from models.config.run import REGISTERED_NAME_FORBIDDEN, RunConfig
from models.config.train import TrainConfig

__all__ = [
    "ActorConfig", "AdvantageConfig", "ConfigError", "CriticConfig", "DataConfig", "DEFAULT_KL_ESTIMATOR",
    "KLConfig", "LLAMA_PROJECTIONS", "LoraConfig", "MIN_TRAIN_TEMPERATURE",
    "ModelConfig", "ReasoningGymConfig", "REGISTERED_NAME_FORBIDDEN", "ResourcesConfig", "RewardConfig",
    "RolloutConfig", "RunConfig", "StepGuardConfig", "TASKS_WITH_RESOURCES", "TrainConfig",
]
