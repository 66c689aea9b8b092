"""Where the server may write: every save URL must lie strictly inside the storage root.

Both URLs are normalised before comparing (``file://`` stripped, local paths made absolute
with symlinks resolved, object-store keys collapsed with ``posixpath.normpath``); any
``..`` segment is refused outright, as is a different scheme or bucket. A relative local
path is taken relative to the root, so ``save("iter-3/critic")`` lands in
``{root}/iter-3/critic``.
"""

from __future__ import annotations

import os
import posixpath
from typing import Optional, Tuple


class SaveRefused(PermissionError):
    """A save URL outside the storage root, or saving disabled (HTTP 403)."""


def _split(url: str) -> Tuple[str, str]:
    """``(scheme, path)``; a plain path and ``file://`` are both scheme ``file``."""
    if "://" not in url:
        return "file", url
    scheme, path = url.split("://", 1)
    return scheme.lower(), path


def _normal_local(path: str, root: Optional[str] = None) -> str:
    if root is not None and not os.path.isabs(path):
        path = os.path.join(root, path)
    return os.path.realpath(os.path.abspath(path))


def check_save_url(url: str, root: Optional[str]) -> str:
    """The normalised form of ``url`` if it is strictly inside ``root``; else :class:`SaveRefused`.

    Example: ``check_save_url("/runs/r1/critic", "/runs") == "/runs/r1/critic"``;
    ``check_save_url("/runs/../etc", "/runs")`` and ``check_save_url("s3://b/x", "/runs")`` raise.
    """
    if not root:
        raise SaveRefused("saving is disabled: the server was started without --storage-root")
    scheme, path = _split(url)
    root_scheme, root_path = _split(root)
    if ".." in path.replace("\\", "/").split("/"):
        raise SaveRefused(f"save URL {url!r} contains '..'; give a path inside the storage root {root}")
    if scheme != root_scheme:
        raise SaveRefused(f"save URL {url!r} is outside the storage root {root} "
                          f"(scheme {scheme}:// is not {root_scheme}://)")
    if scheme == "file":
        base = _normal_local(root_path)
        target = _normal_local(path, root=base)
        inside = os.path.commonpath([base, target]) == base and target != base
    else:
        base = posixpath.normpath("/" + root_path.strip("/"))
        target = posixpath.normpath("/" + path.strip("/"))
        inside = target.startswith(base.rstrip("/") + "/")
        target = f"{scheme}://{target.lstrip('/')}"
    if not inside:
        raise SaveRefused(f"save URL {url!r} is outside the storage root {root} "
                          f"(a save must go to a folder strictly inside it)")
    return target
