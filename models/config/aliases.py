"""Keys and values the config accepted before the demos became builders (2026-11-25), mapped onto today's,
so presets, overrides and the ``run.json`` of runs started before keep working (docs/presets.md).

- ``model.demo_task`` picks the demo's builder, ``model.builder``; ``model.tiny_hidden_size``,
  ``model.tiny_num_layers``, ``model.tiny_num_heads``, ``model.warm_start_steps``,
  ``data.num_demo_train_prompts`` and ``data.num_demo_eval_prompts`` become its arguments. A config
  with ``model.actor_path`` builds nothing, so they are dropped there, as they were ignored before.
- ``reward.function`` and ``reward.functions`` are one setting in two forms: a preset layer or an
  override that writes one drops what an earlier layer wrote of the other.
- ``model.builder`` is written one way (``module:function(key=value, ...)``, arguments in their order),
  so a resumed run compares it with the stored one by value.
- A stored config's ``reward.function`` beside ``reward.functions`` is the old default, dropped.

Removal: the project's own presets and code use none of the old keys; this module serves stored runs and
users' presets only. Remove it (and its call in ``models/config/io.py``) once no run started before
2026-11-25 is resumed or retrained any more, and at the latest with the first release after 2027-05-25,
naming the old keys in that release's notes.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from models.config import ConfigError
from models.rewards import RewardError, parse_spec

DEMO_BUILDERS = {"reverse": "models.demos.builders:reverse_demo", "math": "models.demos.builders:math_demo"}
"""``model.demo_task``'s values and the builders they name."""
BUILDER_ARGS = {("model", "tiny_hidden_size"): "hidden_size", ("model", "tiny_num_layers"): "num_layers",
                ("model", "tiny_num_heads"): "num_heads", ("model", "warm_start_steps"): "warm_start_steps",
                ("data", "num_demo_train_prompts"): "num_train_prompts",
                ("data", "num_demo_eval_prompts"): "num_eval_prompts"}
"""Old keys and the builder argument each now sets."""
TAKES_ONLY = {DEMO_BUILDERS["math"]: ("warm_start_steps", "num_train_prompts", "num_eval_prompts")}
"""Demo builders that take only some of those (the math demo has its own shape: the ``tiny_*`` keys never
applied to it)."""
OLD_DEFAULT_REWARD = "models.demos.reverse_task:reverse_reward"
"""``reward.function``'s default until 2026-11-25, stored in every run's ``run.json`` of that time."""
ONE_SETTING = {"reward": ("function", "functions")}


def upgrade(data: Mapping[str, Any], stored: bool = False) -> Dict[str, Any]:
    """``data`` (the config's sections as nested mappings; ``stored``: a run's ``run.json``) with the old
    keys and values mapped onto today's."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    reward = out.get("reward") if isinstance(out.get("reward"), dict) else {}
    if stored and reward.get("functions") and reward.get("function") == OLD_DEFAULT_REWARD:
        reward.pop("function")
    model = out.setdefault("model", {})
    if not isinstance(model, dict):
        return out  # from_dict names the problem
    task = model.pop("demo_task", None)
    args = {arg: out[section].pop(key) for (section, key), arg in BUILDER_ARGS.items()
            if isinstance(out.get(section), dict) and key in out[section]}
    if not model.get("actor_path") and (task is not None or args or model.get("builder")):
        model["builder"] = _builder(model.get("builder", ""), task, args)
    return out


def _builder(spec: str, task: Any, args: Dict[str, Any]) -> str:
    """``model.builder`` with the demo ``task`` (None: the spec's, else the reversal demo's) and ``args``,
    written one way (``module:function(a=1, b=2)``), so a spec compares equal to the same spec stored."""
    if task is not None and task not in DEMO_BUILDERS:
        raise ConfigError(f"model.demo_task={task!r} is not one of {list(DEMO_BUILDERS)} (it names the demo's "
                          f"builder, model.builder: docs/presets.md)")
    try:
        parsed = parse_spec(spec or DEMO_BUILDERS[task or "reverse"])
    except RewardError as err:
        raise ConfigError(f"model.builder={spec!r}: {err}") from None
    head, given, kwargs = f"{parsed.module}:{parsed.attr}", list(parsed.args), dict(parsed.kwargs)
    if task is not None and head != DEMO_BUILDERS[task]:
        head, given, kwargs = DEMO_BUILDERS[task], [], {}
    takes = TAKES_ONLY.get(head)
    kwargs.update({k: v for k, v in args.items() if takes is None or k in takes})
    written = [repr(v) for v in given] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{head}({', '.join(written)})" if written else head


def one_setting(merged: Dict[str, Any], written: Mapping[str, Any]) -> None:
    """Of two keys that are one setting (``reward.function`` / ``reward.functions``), drop from ``merged``
    the one ``written`` (a later layer) does not write when it writes the other."""
    for section, keys in ONE_SETTING.items():
        layer, node = written.get(section), merged.get(section)
        if not (isinstance(layer, Mapping) and isinstance(node, dict)):
            continue
        for key, other in (keys, keys[::-1]):
            if key in layer and other not in layer:
                node.pop(other, None)
