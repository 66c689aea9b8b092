"""The documentation site: `mkdocs build --strict` passes, and fails on what a reader would trip over
(a broken link between pages, a link to code that does not exist, a page left out of the nav); the
configuration reference is what the config's field docstrings generate; nothing points outside the
repository (the original design, once kept beside the repository, is docs/design.md now)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from models.config import reference as config_reference

ROOT = pathlib.Path(__file__).resolve().parents[2]


def mkdocs_build(root: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(site)], cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def site_copy(tmp_path) -> pathlib.Path:
    """The site's sources in a scratch folder, with the code folders its links reach."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", root)
    shutil.copytree(ROOT / "docs", root / "docs")
    for name in ("tasks", "models", "kernels", "workflows", "configs", "benchmarks", "tests"):
        os.symlink(ROOT / name, root / name)
    return root


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    proc = mkdocs_build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Quick start" in home and "Configuration reference" in home  # the nav is there
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


@pytest.mark.parametrize("line, expected", [
    ("[gone](no_such_page.md)", "no_such_page.md"),
    ("[code](../tasks/no_such_module.py)", "../tasks/no_such_module.py"),
])
@pytest.mark.slow
def test_a_broken_link_fails_the_build(site_copy, tmp_path, line, expected):
    page = site_copy / "docs" / "design.md"
    page.write_text(page.read_text() + f"\n{line}\n")
    proc = mkdocs_build(site_copy, tmp_path / "site")
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_page_outside_the_nav_fails_the_build(site_copy, tmp_path):
    (site_copy / "docs" / "orphan.md").write_text("# Nobody links here\n")
    proc = mkdocs_build(site_copy, tmp_path / "site")
    assert proc.returncode != 0 and "orphan.md" in proc.stdout + proc.stderr


def test_the_config_reference_is_generated_from_the_docstrings():
    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert page == config_reference.markdown(), \
        "docs/reference/config.md is stale: run python -m models.config.reference docs/reference/config.md"


def test_every_config_key_is_documented_with_its_default():
    assert config_reference.missing_docstrings() == []
    rows = {key: (tp, default, doc) for key, tp, default, doc in config_reference.rows(
        type(config_reference.TrainConfig().actor), "actor.")}
    # Hand-checked against models/config/actor.py: a nested section's keys are dotted, defaults are shown as written.
    assert rows["actor.lora.rank"][:2] == ("int", "`0`")
    assert rows["actor.old_logprobs"][1] == '`"recompute"`'
    assert rows["actor.old_logprobs"][2].startswith("π_old:")


def test_nothing_points_outside_the_repository():
    """The original design lived outside the repository; it is docs/design.md now."""
    hits = []
    paths = [ROOT / "README.md"] + [p for folder in ("tasks", "models", "kernels", "workflows", "docs", "tests",
                                                     "benchmarks", "configs") for p in (ROOT / folder).rglob("*")]
    for path in paths:
        if path.suffix in (".py", ".md", ".yaml") and path != pathlib.Path(__file__):
            text = path.read_text(errors="replace")
            hits += [f"{path.relative_to(ROOT)}: {word}" for word in ("../shared", "DESIGN.md") if word in text]
    assert hits == []


def test_every_link_of_the_readme_reaches_a_file():
    """The README is the front door on GitHub, outside the site: its relative links are checked here."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text)
    assert len(targets) > 10
    assert [t for t in targets if "://" not in t and not (ROOT / t).exists()] == []
