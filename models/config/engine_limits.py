"""The generation engines' limits the config checks against, without importing ``models.engines``:
that package starts both engines' modules, and so torch, while a thin task's pod reads the config and
must start without torch (issue 29). The engines define and enforce the same values
(``models/engines/base.py``, ``models/engines/vllm_engine.py``); ``tests/unit/test_thin_imports.py``
holds the two equal."""

MIN_ENGINE_TEMPERATURE = 0.01
"""``models.engines.MIN_ENGINE_TEMPERATURE``: vLLM samples any temperature in (0, 0.01) at 0.01."""
VLLM_MAX_LORA_RANK = 512
"""``models.engines.VLLM_MAX_LORA_RANK``: the largest ``max_lora_rank`` vLLM accepts."""
