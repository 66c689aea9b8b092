"""MkDocs hook: links from a page to the project's code (``../models/config/__init__.py``).

Such links are right on GitHub, where the Markdown is read next to the code, but point outside
the site. Here each one is checked (a link to a file that does not exist is a warning, which
``mkdocs build --strict`` turns into a failure) and pointed at ``repo_url`` (``/blob/main/...``),
or left as plain text where no ``repo_url`` is set.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re

log = logging.getLogger("mkdocs.hooks.source_links")

_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")


def _repo_target(page_src: str, target: str, docs_dir: str, root: str) -> str | None:
    """The repository path a relative link reaches, when it leaves docs/; else None."""
    if re.match(r"^[a-z]+:|^#|^/", target):
        return None
    path = target.split("#", 1)[0]
    resolved = os.path.normpath(os.path.join(docs_dir, os.path.dirname(page_src), path))
    if resolved == docs_dir or resolved.startswith(docs_dir + os.sep):
        return None
    return os.path.relpath(resolved, root)


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_dir = os.path.abspath(config["docs_dir"])
    root = os.path.dirname(docs_dir)
    repo_url = (config.get("repo_url") or "").rstrip("/")

    def rewrite(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        rel = _repo_target(page.file.src_path, target, docs_dir, root)
        if rel is None:
            return m.group(0)
        if rel.startswith("..") or not os.path.exists(os.path.join(root, rel)):
            log.warning("%s links to %s, which is not in the repository", page.file.src_path, target)
            return text
        rel = posixpath.join(*rel.split(os.sep))
        return f"[{text}]({repo_url}/blob/main/{rel})" if repo_url else text

    return _LINK.sub(rewrite, markdown)
