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
The same holds for the import structure transformers reads from the ``__all__`` of each of its ~3,000 model files as
it is imported (``create_import_structure_from_path``: about 1.4 s of CPU a process here), kept per folder.

torch's inductor keys its compile caches by a digest of triton's sources and its 500 MB ``libtriton.so`` and one of
torch's own sources (``torch._inductor.codecache.triton_key`` and ``torch_key``), computed in each process at its first
compile: about 2 s of CPU here (more under load) in every process that compiles anything, which each vLLM engine does
when it first returns log-probabilities (its sampler's ``batched_count_greater_than`` is compiled). The two digests are
kept in the same cache, per set of installed distributions (:func:`seed_inductor_source_keys`): a reinstalled triton or
torch is a new digest; a source edited in place without a reinstall is not seen (as with the other two caches).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import io
import json
import os
import pickle
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

SKLEARN_USERS = ("transformers.generation.candidate_generator", "transformers.data.metrics")
"""transformers' modules that import scikit-learn at import time when ``is_sklearn_available()``."""


def _sklearn_absent() -> bool:
    return False


INDUCTOR_CODECACHE = "torch._inductor.codecache"
INDUCTOR_SOURCE_KEYS = ("triton_key", "torch_key")
"""The functions of :data:`INDUCTOR_CODECACHE` whose values (digests of installed sources) the machine's cache keeps."""


class _SeedAfterExec(importlib.abc.Loader):
    """``loader``, then :func:`seed_inductor_source_keys` on the module it executed."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        seed_inductor_source_keys(module)


class _TransformersWithoutSklearn(importlib.abc.MetaPathFinder):
    """Just before one of :data:`SKLEARN_USERS` executes, transformers' ``is_sklearn_available`` answers False; as
    soon as transformers' ``import_utils`` is loaded (before ``transformers/__init__`` maps its models), its
    ``create_import_structure_from_path`` is read from the machine's cache; once torch's inductor code cache is loaded,
    its source keys are seeded from the machine's cache. Finds nothing itself but the code cache's spec (the path
    finder's, with its loader wrapped): the import goes on through the other finders."""

    def find_spec(self, fullname: str, path=None, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname == INDUCTOR_CODECACHE:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _SeedAfterExec(spec.loader)
            return spec
        if fullname in SKLEARN_USERS and "sklearn" not in sys.modules:
            for name in ("transformers.utils", "transformers.utils.import_utils"):
                module = sys.modules.get(name)
                if module is not None:
                    module.is_sklearn_available = _sklearn_absent
        if fullname.startswith("transformers."):
            utils = sys.modules.get("transformers.utils.import_utils")
            original = getattr(utils, "create_import_structure_from_path", None)
            if original is not None and not hasattr(original, "_flyte_rlhf"):
                utils.create_import_structure_from_path = _cached_import_structure(original)
        return None


def distributions_digest() -> str:
    """A digest of the distributions importable now: each ``sys.path`` folder's ``*.dist-info`` and ``*.egg-info``
    entries with their modification times (the interpreter's version with them). Kept in the process while no
    ``sys.path`` folder changes (an install adds or removes an entry, which moves its folder's time)."""
    folders = []
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        try:
            folders.append((folder, os.stat(folder).st_mtime_ns))
        except OSError:  # gone
            continue
    key = tuple(folders)
    if key not in _DIGESTS:
        digest = hashlib.sha256(sys.version.encode())
        for folder, _ in folders:
            try:
                with os.scandir(folder) as entries:
                    found = sorted((e.name, e.stat().st_mtime_ns) for e in entries
                                   if e.name.endswith((".dist-info", ".egg-info")))
            except OSError:  # not a folder (a zip), or gone
                continue
            if found:
                digest.update(repr((folder, found)).encode())
        _DIGESTS[key] = digest.hexdigest()[:32]
    return _DIGESTS[key]


_DIGESTS: Dict[tuple, str] = {}


def disk_cached(name: str, compute: Callable[[], Any], encode: Callable[[Any], bytes],
                decode: Callable[[bytes], Any]) -> Any:
    """``compute()``, kept in this machine's cache as ``RLHF_CACHE_DIR/python/{name}`` (``encode(value)`` written,
    ``decode(bytes)`` read): read when there (a missing, damaged or unloadable file is computed again), else
    computed and written there, whole or not at all (a temporary file renamed; removed if the write fails)."""
    from models.environ import cache_dir

    path = os.path.join(cache_dir(), "python", name)
    try:
        with open(path, "rb") as f:
            return decode(f.read())
    except Exception:  # noqa: BLE001 -- missing, damaged, or naming what is not there: computed again
        pass
    found = compute()
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(encode(found))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    return found


class _Restricted(pickle.Unpickler):
    """Loads plain data (dicts, lists, sets, frozensets, strings, numbers) and the classes of ``modules`` (prefixes of
    module names) only: a cached file naming any other class is refused."""

    def __init__(self, data: bytes, modules: Tuple[str, ...]):
        super().__init__(io.BytesIO(data))
        self.modules = modules

    def find_class(self, module: str, name: str):
        if self.modules and module.startswith(self.modules):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}: not a class a cached file may name")


def pickle_cached(name: str, compute: Callable[[], Any], modules: Tuple[str, ...] = ()) -> Any:
    """:func:`disk_cached` as a pickle that may name the classes of ``modules`` only (none: plain data)."""
    return disk_cached(name, compute, lambda value: pickle.dumps(value, protocol=4),
                       lambda data: _Restricted(data, modules).load())


def cached_packages_distributions(compute=None) -> Dict[str, List[str]]:
    """``importlib.metadata.packages_distributions()`` (or ``compute()``), read from this machine's cache when the
    same distributions were mapped before, else computed and written there."""
    compute = compute or _original_packages_distributions
    return disk_cached(f"packages_distributions-{distributions_digest()}.json",
                       lambda: {name: list(dists) for name, dists in compute().items()},
                       lambda value: json.dumps(value).encode(), json.loads)


def _cached_import_structure(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """transformers' ``create_import_structure_from_path`` for a folder, from this machine's cache (keyed by the
    folder and the installed distributions); its recursion into subfolders runs the original."""
    computing = threading.local()

    def create_import_structure_from_path(module_path):
        if getattr(computing, "on", False):
            return original(module_path)

        def compute():
            computing.on = True
            try:
                return original(module_path)
            finally:
                computing.on = False

        key = hashlib.sha256(f"{distributions_digest()} {os.path.abspath(str(module_path))}".encode()).hexdigest()
        return pickle_cached(f"transformers_import_structure-{key[:32]}.pickle", compute)

    create_import_structure_from_path._flyte_rlhf = True
    create_import_structure_from_path.__wrapped__ = original
    return create_import_structure_from_path


def seed_inductor_source_keys(codecache) -> None:
    """Set ``codecache``'s :data:`INDUCTOR_SOURCE_KEYS` (torch's prefetchable caches of one value) from the machine's
    cache, one file each per set of installed distributions; a key not yet there is computed now (once per machine
    and install) and written. A key this process already computed is left as it is."""
    for name in INDUCTOR_SOURCE_KEYS:
        key = getattr(codecache, name, None)
        if key is None or not hasattr(key, "set"):  # another torch: nothing to seed
            continue
        computed = []

        def compute(key=key):
            computed.append(True)
            return key()  # kept in the process by torch's own cache too

        value = pickle_cached(f"inductor_{name}-{distributions_digest()}.pickle", compute)
        if not computed:
            with contextlib.suppress(RuntimeError):  # already set in this process
                key.set(value)


_original_packages_distributions = importlib.metadata.packages_distributions


def skip_unused_optional_imports() -> None:
    """Install the finder and the cached ``packages_distributions`` (once per process)."""
    if not any(isinstance(f, _TransformersWithoutSklearn) for f in sys.meta_path):
        sys.meta_path.insert(0, _TransformersWithoutSklearn())
        if INDUCTOR_CODECACHE in sys.modules:  # loaded before: its keys now, unless computed already
            seed_inductor_source_keys(sys.modules[INDUCTOR_CODECACHE])
    if importlib.metadata.packages_distributions is _original_packages_distributions:
        def packages_distributions() -> Dict[str, List[str]]:
            return cached_packages_distributions(_original_packages_distributions)

        packages_distributions.__wrapped__ = _original_packages_distributions
        importlib.metadata.packages_distributions = packages_distributions
