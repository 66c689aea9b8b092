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

transformers also maps every importable top-level name to its distributions as it is imported
(``importlib.metadata.packages_distributions()``, reading the file list of each of the ~350 installed distributions:
0.8 s of CPU a process here). :func:`cached_packages_distributions` answers it from a file of this machine's cache
(``RLHF_CACHE_DIR/python``), one per set of installed distributions: the file's name is a digest of every
``*.dist-info`` and ``*.egg-info`` folder on ``sys.path`` with its modification time, so installing, upgrading or
removing a distribution is a new digest and a new computation; an unwritable cache only costs the computation.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.metadata
import json
import os
import sys
from typing import Dict, List, Optional

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


def distributions_digest() -> str:
    """A digest of the distributions importable now: each ``sys.path`` folder's ``*.dist-info`` and ``*.egg-info``
    entries with their modification times (the interpreter's version with them)."""
    digest = hashlib.sha256(sys.version.encode())
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        try:
            with os.scandir(folder) as entries:
                found = sorted((e.name, e.stat().st_mtime_ns) for e in entries
                               if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:  # not a folder (a zip), or gone
            continue
        if found:
            digest.update(repr((folder, found)).encode())
    return digest.hexdigest()[:32]


def cached_packages_distributions(compute=None) -> Dict[str, List[str]]:
    """``importlib.metadata.packages_distributions()`` (or ``compute()``), read from this machine's cache when the
    same distributions were mapped before, else computed and written there."""
    from models.environ import cache_dir

    compute = compute or _original_packages_distributions
    path = os.path.join(cache_dir(), "python", f"packages_distributions-{distributions_digest()}.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    found = {name: list(dists) for name, dists in compute().items()}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(found, f)
        os.replace(tmp, path)
    except OSError:
        pass
    return found


_original_packages_distributions = importlib.metadata.packages_distributions


def skip_unused_optional_imports() -> None:
    """Install the finder and the cached ``packages_distributions`` (once per process)."""
    if not any(isinstance(f, _TransformersWithoutSklearn) for f in sys.meta_path):
        sys.meta_path.insert(0, _TransformersWithoutSklearn())
    if importlib.metadata.packages_distributions is _original_packages_distributions:
        def packages_distributions() -> Dict[str, List[str]]:
            return cached_packages_distributions(_original_packages_distributions)

        packages_distributions.__wrapped__ = _original_packages_distributions
        importlib.metadata.packages_distributions = packages_distributions
