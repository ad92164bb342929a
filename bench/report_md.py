"""Markdown pieces for bench.report: a section's shape, tables, and numbers as the docs print them.

Nothing here reads a file; the renderers (bench/report_engine.py, bench/report_cluster.py) get each result as the
dict its benchmark wrote and return markdown lines built from these helpers.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Section:
    """One heading of docs/benchmarks.md: the result files it shows, and how."""
    title: str
    module: str  # the bench module whose docstring's first paragraph says what the benchmark measures
    files: tuple[str, ...]  # names under bench/results/; a section is shown when at least one is there
    render: Callable[[dict[str, dict]], list[str]]  # {file: result} of those present -> markdown lines

    @property
    def anchor(self) -> str:
        """GitHub's anchor of the section's heading."""
        return re.sub(r"[^a-z0-9 _-]", "", self.title.lower()).replace(" ", "-")


@dataclasses.dataclass(frozen=True)
class Headline:
    """One row of the README's table of headline figures."""
    label: str
    file: str  # the result it is read from
    value: Callable[[dict], str]
    section: str  # the title of its section in docs/benchmarks.md


def table(head: list[str], rows: list[list]) -> list[str]:
    """A markdown table; cells are str()-ed, `|` inside a cell escaped."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return [line(head), "|" + "---|" * len(head)] + [line(r) for r in rows] + [""]


def num(x: float | None, digits: int = 0) -> str:
    """x with thousands separators and `digits` decimals; '-' for None."""
    return "-" if x is None else f"{x:,.{digits}f}"


def sig(x: float, figures: int = 2) -> str:
    """x to `figures` significant figures (0.31, 14, 1.2)."""
    return f"{float(f'{x:.{figures}g}'):g}"


def ms(seconds: float | None, digits: int = 0) -> str:
    """Seconds shown in milliseconds."""
    return "-" if seconds is None else num(1e3 * seconds, digits)


def pct(fraction: float, digits: int = 0) -> str:
    return f"{100 * fraction:.{digits}f}%"


def spread(d: dict, digits: int = 2, low: str = "min", high: str = "max") -> str:
    """A ratio's {median, min, max} (or other bounds) dict as 'median (min-max)', e.g. '1.26x (1.02-1.33)'."""
    return f"{d['median']:.{digits}f}x ({d[low]:.{digits}f}-{d[high]:.{digits}f})"


def median(xs) -> float:
    return statistics.median(xs)


def first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph, its lines joined."""
    para = (doc or "").strip().split("\n\n")[0]
    return " ".join(para.split())
