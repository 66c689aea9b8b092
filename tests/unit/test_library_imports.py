"""A process that runs a task loads transformers' models without scikit-learn (``models/library_imports.py``):
MLflow installs scikit-learn, and transformers imports it with its generation code unless told it is absent.
Checked in a fresh interpreter, entered as every task's process enters (``import tasks``). The map of top-level
names to distributions transformers builds at import comes from the machine's cache, equal to the one computed,
and computed again when the installed distributions change; so do torch inductor's digests of triton's and torch's
sources, seeded as soon as its code cache loads."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pickle
import subprocess
import sys

import pytest

from models.library_imports import _cached_import_structure, _original_packages_distributions, \
    cached_packages_distributions, distributions_digest, seed_inductor_source_keys

PROBE = """
import json, os, sys
import tasks
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.generation import candidate_generator
from transformers.utils import is_sklearn_available
loaded = "sklearn" in sys.modules
import sklearn.metrics  # anyone else's import of it is untouched
import importlib.metadata
from transformers.utils import import_utils
computed = {k: list(v) for k, v in importlib.metadata.packages_distributions.__wrapped__().items()}
structure = import_utils.create_import_structure_from_path  # read from the cache once it is there
models = os.path.join(os.path.dirname(import_utils.__file__), "..", "models")
cached = structure(models)
import_utils.create_import_structure_from_path = structure.__wrapped__  # transformers' own, its recursion too
same = cached == structure.__wrapped__.__wrapped__(models)  # lru_cache's function: computed afresh, no cache
import_utils.create_import_structure_from_path = structure
import pickle
from models.library_imports import distributions_digest
fresh = "torch._inductor.codecache" not in sys.modules
folder = os.path.join(os.environ["RLHF_CACHE_DIR"], "python")
for name, value in (("triton_key", "seeded triton"), ("torch_key", b"seeded torch")):
    with open(os.path.join(folder, f"inductor_{name}-{distributions_digest()}.pickle"), "wb") as f:
        pickle.dump(value, f)
from torch._inductor import codecache
print(json.dumps({"inductor_keys_seeded": fresh and (codecache.triton_key(), codecache.torch_key()) == (
                      "seeded triton", b"seeded torch"),
                  "mapping_as_computed": import_utils.PACKAGE_DISTRIBUTION_MAPPING == computed,
                  "structure_as_computed": same, "loaded": loaded,
                  "transformers_sees_it": is_sklearn_available(),
                  "roc_curve": hasattr(candidate_generator, "roc_curve"),
                  "imported_later": "sklearn" in sys.modules}))
"""


@pytest.mark.slow  # a fresh interpreter importing flytekit, torch and transformers
def test_a_tasks_process_loads_transformers_models_without_sklearn(tmp_path):
    assert importlib.util.find_spec("sklearn") is not None  # installed (by MLflow): transformers would import it
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, "RLHF_CACHE_DIR": str(tmp_path)})
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "inductor_keys_seeded": True, "mapping_as_computed": True, "structure_as_computed": True, "loaded": False, "transformers_sees_it": False,
        "roc_curve": False, "imported_later": True}


def _refused():
    raise AssertionError("computed again: the cache was not read")


@pytest.mark.slow  # importlib maps the venv three times (about 1 s of CPU each)
def test_packages_distributions_is_read_from_the_cache_until_a_distribution_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    computed = {k: list(v) for k, v in _original_packages_distributions().items()}
    assert cached_packages_distributions(_original_packages_distributions) == computed  # written
    assert cached_packages_distributions(_refused) == computed  # read back: not computed

    site = tmp_path / "site"  # a distribution installed: another digest, computed again, and it is there
    info = site / "flyte_rlhf_probe-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flyte-rlhf-probe\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("rlhf_probe_module\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.metadata.FastPath.__new__.cache_clear()  # importlib's own cache of sys.path folders
    with pytest.raises(AssertionError, match="computed again"):
        cached_packages_distributions(_refused)
    assert cached_packages_distributions(_original_packages_distributions)["rlhf_probe_module"] == ["flyte-rlhf-probe"]
    assert cached_packages_distributions(_refused)["rlhf_probe_module"] == ["flyte-rlhf-probe"]

    monkeypatch.setenv("RLHF_CACHE_DIR", "/proc/no-cache-here")  # unwritable: computed, nothing fails
    assert cached_packages_distributions(_original_packages_distributions) == computed | {
        "rlhf_probe_module": ["flyte-rlhf-probe"]}


def test_the_import_structure_is_read_from_the_cache_and_holds_plain_data_only(tmp_path, monkeypatch):
    """transformers' folder scan runs once per folder and set of distributions; its recursion is not cached apart;
    a cached file that names a class (not plain data) is computed again, not loaded."""
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def scan(path):
        calls.append(path)
        if path == "top":  # transformers' own recursion goes through the module's global: the cached one
            return {"sub": cached("sub"), frozenset({"torch"}): {"m": {"A", "B"}}}
        return {frozenset(): {"n": {"C"}}}

    cached = _cached_import_structure(scan)
    want = {"sub": {frozenset(): {"n": {"C"}}}, frozenset({"torch"}): {"m": {"A", "B"}}}
    assert cached("top") == want and calls == ["top", "sub"]
    assert _cached_import_structure(_refused)("top") == want  # another process: read back
    for f in (tmp_path / "cache" / "python").glob("transformers_import_structure-*"):
        f.write_bytes(pickle.dumps({"sub": tmp_path}))  # a class to load: refused, computed again
    assert _cached_import_structure(scan)("top") == want and calls == ["top", "sub"] * 2


def test_inductors_source_keys_are_computed_once_per_install_then_read(tmp_path, monkeypatch):
    """torch's own one-value caches (``prefetchable_cache``, as ``triton_key`` and ``torch_key`` are): on a miss the key
    is computed (once) and written; in a later process it is read and set without computing; one the process already
    computed is left alone; a module without the keys (another torch) is left alone."""
    import types

    from torch.utils._functools import prefetchable_cache

    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path))
    calls = []

    def codecache():
        module = types.ModuleType("codecache")
        module.triton_key = prefetchable_cache(lambda: calls.append("triton") or "digest of triton")
        module.torch_key = prefetchable_cache(lambda: calls.append("torch") or b"digest of torch")
        return module

    first = codecache()
    seed_inductor_source_keys(first)  # computed and written
    assert calls == ["triton", "torch"] and (first.triton_key(), first.torch_key()) == ("digest of triton",
                                                                                         b"digest of torch")
    assert sorted(p.name for p in (tmp_path / "python").iterdir()) == [
        f"inductor_torch_key-{distributions_digest()}.pickle", f"inductor_triton_key-{distributions_digest()}.pickle"]
    later = codecache()
    seed_inductor_source_keys(later)  # read: nothing computed
    assert (later.triton_key(), later.torch_key()) == ("digest of triton", b"digest of torch") and len(calls) == 2
    own = codecache()
    assert own.torch_key() == b"digest of torch" and len(calls) == 3  # this process computed it before
    seed_inductor_source_keys(own)  # the other is set, this one kept
    assert own.triton_key() == "digest of triton" and len(calls) == 3
    seed_inductor_source_keys(types.ModuleType("codecache"))
