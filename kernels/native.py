"""C kernels built by the machine's C compiler (``cc``, ``$CC``) on first use into the cache
(``$RLHF_CACHE_DIR/kernels/``, default ``~/.cache/flyte-rlhf``, named by the source's digest) and called through
ctypes: no import that changes the process (numba, which vLLM ships, made vLLM 0.32's CPU worker fail to start in the
same process: its kernel registry scans every module and trips on llvmlite's library wrapper). Every caller keeps a
path in torch for where no compiler builds them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

_LIBS: Dict[str, Optional[ctypes.CDLL]] = {}
_LOCK = threading.Lock()


def _cache() -> str:
    root = os.environ.get("RLHF_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "flyte-rlhf"))
    return os.path.join(root, "kernels")


def _build(name: str, source: str, path: str) -> None:
    """``source`` compiled into the shared library ``path`` (written beside it, then renamed: concurrent builders
    agree)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        src = os.path.join(work, f"{name}.c")
        with open(src, "w") as f:
            f.write(source)
        out = os.path.join(work, "lib.so")
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise OSError("no C compiler (cc, gcc or $CC)")
        subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", out, src], check=True, capture_output=True,
                       timeout=120)
        os.replace(out, path)


def compiled(name: str, source: str, functions: Mapping[str, Tuple[Any, Sequence[Any]]]) -> Optional[ctypes.CDLL]:
    """The library of ``source`` (built on first use, ~0.3 s), its ``functions`` (name: restype, argtypes) declared;
    None where no C compiler builds it."""
    with _LOCK:
        if name not in _LIBS:
            digest = hashlib.sha256((source + platform.machine()).encode()).hexdigest()[:16]
            path = os.path.join(_cache(), f"{name}-{digest}.so")
            try:
                if not os.path.isfile(path):
                    _build(name, source, path)
                lib = ctypes.CDLL(path)
                for fn_name, (restype, argtypes) in functions.items():
                    fn = getattr(lib, fn_name)
                    fn.restype, fn.argtypes = restype, list(argtypes)
            except (OSError, subprocess.SubprocessError):
                lib = None  # every call takes the caller's path in torch
            _LIBS[name] = lib
        return _LIBS[name]


def as_tensor(a: np.ndarray) -> torch.Tensor:
    """A kernel's output ``a`` as a tensor, no copy (a buffer's pages past it were never written, so take no memory),
    an empty one with its stride 1 (torch gives numpy's empty arrays stride 0, which no view takes)."""
    return torch.from_numpy(a) if a.size else torch.zeros(0, dtype=torch.from_numpy(a[:1]).dtype)
