"""A process that runs a task loads transformers' models without scikit-learn (``models/library_imports.py``):
MLflow installs scikit-learn, and transformers imports it with its generation code unless told it is absent.
Checked in a fresh interpreter, entered as every task's process enters (``import tasks``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter importing flytekit, torch and transformers

PROBE = """
import json, sys
import tasks
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.generation import candidate_generator
from transformers.utils import is_sklearn_available
loaded = "sklearn" in sys.modules
import sklearn.metrics  # anyone else's import of it is untouched
print(json.dumps({"loaded": loaded, "transformers_sees_it": is_sklearn_available(),
                  "roc_curve": hasattr(candidate_generator, "roc_curve"), "imported_later": "sklearn" in sys.modules}))
"""


def test_a_tasks_process_loads_transformers_models_without_sklearn():
    assert importlib.util.find_spec("sklearn") is not None  # installed (by MLflow): transformers would import it
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "loaded": False, "transformers_sees_it": False, "roc_curve": False, "imported_later": True}
