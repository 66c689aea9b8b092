"""What the libraries import into every process that runs a task, and do not need to.

transformers imports scikit-learn whenever it is installed (MLflow installs it) as soon as anything loads
``transformers.generation`` (``AutoModelForCausalLM``, any ``*ForCausalLM``, the tokenizers' auto classes): about
4 s of CPU in each process on the 2-core machine, paid by ``pyflyte``, every pod's ``pyflyte-execute``, every
elastic worker and every service, for a ROC curve of assisted generation's candidate confidence, which no task uses.
:func:`skip_unused_optional_imports` makes transformers see scikit-learn as absent in this process (and only for
transformers: ``import sklearn`` elsewhere is untouched). What of transformers uses it goes without: assisted
generation skips its confidence-threshold tuning, and ``transformers.data.metrics``' GLUE metrics fail when called
(a NameError, not transformers' "requires scikit-learn"). Installed by ``tasks/__init__.py`` and
``models/hosts/__main__.py`` before any model loads; a process that imported transformers' generation code before
the call keeps what it has.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Optional

SKLEARN_USERS = ("transformers.generation.candidate_generator", "transformers.data.metrics")
"""transformers' modules that import scikit-learn at import time when ``is_sklearn_available()``."""


def _sklearn_absent() -> bool:
    return False


class _TransformersWithoutSklearn(importlib.abc.MetaPathFinder):
    """Just before one of :data:`SKLEARN_USERS` executes, transformers' ``is_sklearn_available`` answers False.
    Finds nothing itself: the import goes on through the other finders."""

    def find_spec(self, fullname: str, path=None, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname in SKLEARN_USERS and "sklearn" not in sys.modules:
            for name in ("transformers.utils", "transformers.utils.import_utils"):
                module = sys.modules.get(name)
                if module is not None:
                    module.is_sklearn_available = _sklearn_absent
        return None


def skip_unused_optional_imports() -> None:
    """Install the finder (once per process)."""
    if not any(isinstance(f, _TransformersWithoutSklearn) for f in sys.meta_path):
        sys.meta_path.insert(0, _TransformersWithoutSklearn())
