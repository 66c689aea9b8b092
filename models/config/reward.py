"""The ``reward`` section: where the sequence reward comes from and how it is scaled (docs/rewards.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List

from models.config.checks import ConfigError, check, check_choice
from models.rewards import RewardError, parse_spec

@dataclass(frozen=True)
class RewardConfig:
    """Where the sequence reward comes from (one interface, chosen here) and how it is scaled
    (docs/rewards.md)."""

    source: str = "function"
    """``function`` (``module:function`` rewards), ``model`` (reward-model checkpoint) or ``remote`` (HTTP)."""
    function: str = ""
    """``module:function``, or ``module:factory(key=value, ...)`` for the function a factory returns
    (Python literal arguments, e.g. ``trl.rewards:get_soft_overlong_punishment(max_completion_len=256,
    soft_punish_cache=32)``). Called as ``fn(prompts, responses, **columns) -> list[float]`` (each data
    column a list aligned with the samples; a function takes the columns it names, all with
    ``**kwargs``, none in the two-argument form), or in TRL's keyword form when it names
    ``completions`` or ``completion_ids`` (``prompts=``, ``completions=``, ``completion_ids=`` and every
    column by keyword; None in its result: no reward from it for that sample); docs/rewards.md.
    There is no default: a run scored by functions names at least one (the demo presets name theirs)."""
    functions: List[str] = field(default_factory=list)
    """Several reward functions (each as in ``function``) whose weighted sum is the reward (a function's
    None skipped, as TRL does); each is logged as ``reward/<function name>_mean``."""
    weights: List[float] = field(default_factory=list)
    """One weight per entry of ``functions``; empty: all 1."""
    module_paths: List[str] = field(default_factory=list)
    """Folders searched for the functions' modules before the project's path (the directory
    ``pyflyte run`` starts in is always searched first; on a cluster, e.g. a folder of the image)."""
    timeout_s: float = 300.0
    """Seconds a reward function may take for one batch (its import included when its worker
    starts), at set-up, in ``score`` and in evaluation; then its worker is stopped and the task fails
    naming the function and the samples."""
    num_workers: int = 1
    """Worker processes per reward function; a batch is split into this many contiguous chunks."""
    format_pattern: str = ""
    """Regex for ``models.rewards.verifiers:format_reward`` (whole response, DOTALL); empty: DeepSeek-R1's
    ``<think>...</think><answer>...</answer>``."""
    scale: float = 1.0
    """Factor on the reward (after the normalisation, before the clip)."""
    clip: float = 0.0
    """Clip the reward to ``[-clip, clip]`` after scaling; 0: no clip."""
    normalize: bool = False
    """Subtract the running mean of the raw rewards and divide by their running std (every batch so
    far, this one included; carried across resumes in ``state.json``)."""
    expected_range: List[float] = field(default_factory=lambda: [-10.0, 10.0])
    """``[low, high]`` the raw rewards should lie in: a batch with rewards outside gets a warning
    (and ``reward/raw_out_of_range_frac``), so unbounded rewards are not trained on silently."""
    model_path: str = ""
    """Reward-model checkpoint (sequence-classification head, 1 label) for ``source=model``."""
    remote_url: str = ""
    """Reward server base URL for ``source=remote``."""
    remote_timeout_s: float = 60.0
    """Seconds to wait for one answer of the reward server (and of the critic server,
    ``critic.remote_url``): at set-up (a health check) and for every request."""

    def __post_init__(self) -> None:
        check_choice("reward.source", self.source, ["function", "model", "remote"])
        if self.source == "function":
            for i, spec in enumerate(self.specs):
                try:
                    parse_spec(spec)
                except RewardError as err:
                    raise ConfigError(f"reward.function{'s[%d]' % i if self.functions else ''}={spec!r}: "
                                      f"{err}") from None
        check(not self.weights or len(self.weights) == len(self.functions),
              f"reward.weights has {len(self.weights)} entries for {len(self.functions)} reward.functions")
        check(not self.functions or not self.function,
              "set reward.function or reward.functions, not both")
        if self.source == "model":
            check(bool(self.model_path), "reward.source=model needs reward.model_path")
        if self.source == "remote":
            check(bool(self.remote_url), "reward.source=remote needs reward.remote_url")
        check(self.remote_timeout_s > 0, "reward.remote_timeout_s must be > 0")
        check(self.timeout_s > 0, "reward.timeout_s must be > 0")
        check(self.num_workers >= 1, "reward.num_workers must be >= 1")
        check(self.scale > 0, "reward.scale must be > 0")
        check(self.clip >= 0, "reward.clip must be >= 0 (0 = no clip)")
        check(len(self.expected_range) == 2 and self.expected_range[0] < self.expected_range[1],
              f"reward.expected_range must be [low, high] with low < high, got {self.expected_range}")
        if self.format_pattern:
            try:
                re.compile(self.format_pattern)
            except re.error as err:
                raise ConfigError(f"reward.format_pattern={self.format_pattern!r} is not a regex: {err}")

    @property
    def specs(self) -> List[str]:
        """The reward functions in use: ``functions``, else ``[function]``."""
        return list(self.functions) or ([self.function] if self.function else [])

    @property
    def options(self) -> dict:
        """Settings handed to reward functions that name them as parameters."""
        return {"format_pattern": self.format_pattern} if self.format_pattern else {}
