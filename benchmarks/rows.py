"""The benchmark contract: each ``bench_*.py`` given ``--json PATH`` writes a JSON list of rows,
which ``run_all.py`` collects into one table.

A row: ``{"section", "figure", "value", "unit", "target", "ok", "detail"}``; ``target`` is a
string such as ``">= 20"`` or None, ``ok`` is whether ``value`` meets it (None without one).
Ratios measured in one run are the figures to quote: absolute times vary on shared machines.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class Row:
    """One figure of the table."""

    section: str
    """Which part of the system, e.g. ``"rollout"``."""
    figure: str
    """What is measured, e.g. ``"vLLM vs HF generate tokens/s"``."""
    value: Optional[float]
    """The measurement (None: could not be measured, see ``detail``)."""
    unit: str
    """``"x"`` for ratios, ``"GB/s"``, ``"s"``, ..."""
    target: Optional[str] = None
    """``">= 20"`` or ``"<= 0.5"``; None for figures without a target."""
    ok: Optional[bool] = None
    """Whether ``value`` meets ``target``; None without a target."""
    detail: str = ""
    """The absolute numbers behind a ratio, sizes, caveats."""


def row(section: str, figure: str, value: Optional[float], unit: str, detail: str = "",
        at_least: Optional[float] = None, at_most: Optional[float] = None) -> Row:
    """A :class:`Row`, its ``target`` and ``ok`` filled in from ``at_least`` / ``at_most``."""
    if at_least is not None and at_most is not None:
        raise ValueError("give at_least or at_most, not both")
    if at_least is None and at_most is None:
        return Row(section, figure, value, unit, None, None, detail)
    bound = at_least if at_least is not None else at_most
    target = f"{'>=' if at_least is not None else '<='} {bound:g}"
    ok = value is not None and (value >= bound if at_least is not None else value <= bound)
    return Row(section, figure, value, unit, target, ok, detail)


def exit_status(rows: Iterable[Row]) -> int:
    """A benchmark's exit status: 1 when a figure misses its target (a side that did not run is such a row), else 0."""
    return 1 if any(r.ok is False for r in rows) else 0


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """``--json PATH``, ``--quick`` and ``--threads N`` (default: ``OMP_NUM_THREADS``, which
    ``run_all.py`` sets for every script, else 1)."""
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH (see benchmarks/rows.py)")
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds, not minutes")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 1),
                        help="torch intra-op threads, the same on both sides of every comparison")


def write_rows(path: Optional[str], rows: Iterable[Row]) -> None:
    """Write ``rows`` as a JSON list to ``path`` (nothing when ``path`` is None)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)


def print_rows(rows: Iterable[Row]) -> None:
    """One line per row, for a script run on its own."""
    for r in rows:
        value = "n/a" if r.value is None else f"{r.value:.3g}"
        verdict = "" if r.ok is None else ("  ok" if r.ok else "  MISSED")
        print(f"{r.section:>10} | {r.figure:<44} {value:>8} {r.unit:<5} {r.target or '':>7}{verdict}  {r.detail}")
