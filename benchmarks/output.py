"""Benchmark results (CSV, JSON, headless figures, run record, run folder) and shared argparse types."""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
import textwrap
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn


@dataclass(frozen=True)
class RunInfo:
    """What made a set of results: version, time, command line, parsed arguments, seed."""

    version: str
    timestamp: str  # ISO 8601, local time with its UTC offset
    command: str
    arguments: dict[str, Any]
    seed: int | None

    @classmethod
    def now(cls, arguments: Mapping[str, Any], seed: int | None = None) -> RunInfo:
        """The record of this process's run, starting now."""
        from kvstore import __version__

        return cls(__version__, datetime.now().astimezone().isoformat(timespec="seconds"),
                   shlex.join(sys.argv), dict(arguments), seed)


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Rows of mappings as CSV; the columns are the union of their keys, in first-seen order."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON (other values as strings), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Save a matplotlib figure (laid out tight) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the headless Agg backend (no display is ever needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def mark_x(ax: Any, xs: Sequence[float], label: Callable[[float], str], max_labels: int = 12) -> None:
    """A log x axis with a tick at each of `xs`, at most `max_labels` of them labelled by `label`."""
    ticks = sorted(set(xs))
    step = -(-len(ticks) // max_labels)
    ax.set_xscale("log")
    ax.set_xticks(ticks, [label(x) if i % step == 0 else "" for i, x in enumerate(ticks)],
                  rotation=45, ha="right", fontsize=7)
    ax.minorticks_off()


def short_count(n: float) -> str:
    """``10k``, ``2.5M``, ``1G``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"


def run_folder(out: Path, in_place: bool = False) -> Path:
    """The folder a run writes into, created: `out` itself with `in_place`, else a fresh
    ``out/YYYYMMDD-HHMMSS`` (``-2``, ``-3``... when taken)."""
    out.mkdir(parents=True, exist_ok=True)
    if in_place:
        return out
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for k in range(1, 1000):
        path = out / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            pass
    raise FileExistsError(f"no free run folder name under {out} for {stamp}")


def out_folder(text: str) -> Path:
    """argparse type: an output folder, not a file nor under one (see also `check_folder`)."""
    path = Path(text).expanduser()
    found = next((p for p in (path, *path.parents) if p.exists()), path)
    if found.exists() and not found.is_dir():
        what = "is a file" if found == path else f"is under {found}, which is a file"
        raise argparse.ArgumentTypeError(f"{text} {what}; give a folder")
    return path


def out_file(text: str) -> Path:
    """argparse type: an output file, not a folder, whose folder `out_folder` accepts."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    out_folder(str(path.parent))
    return path


def check_folder(path: Path, error: Callable[[str], NoReturn], flag: str = "--out") -> None:
    """Before a run's work: a usage error (`error`) naming `flag` unless the folder `path` can
    be created (it is, then the new folders are removed again)."""
    new = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        error(f"argument {flag}: cannot create the folder {path}: {e.strerror or e}")
    for p in new:  # deepest first
        p.rmdir()


def name_list(known: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma list of names among `known`, duplicates dropped."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",")]
        if not any(names):
            raise argparse.ArgumentTypeError(f"no names given; known: {', '.join(known)}")
        if "" in names:
            raise argparse.ArgumentTypeError(f"an empty name in {text!r}")
        bad = [n for n in names if n not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))}; known: "
                                             f"{', '.join(known)}")
        return list(dict.fromkeys(names))
    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse type: an int >= `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


positive_int = int_at_least(1)  # argparse type: an int >= 1
non_negative_int = int_at_least(0)  # argparse type: an int >= 0


def text_table(head: Sequence[str], rows: Iterable[Sequence[Any]], left: Container[int] = (0,),
               width: int = 80) -> str:
    """`rows` under `head` as aligned plain text: the columns in `left` left-aligned, the others
    right-aligned; a first cell too long for `width` gets a line of its own."""
    cells = [[str(c) for c in head], *([str(c) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    widths[0] = max(len(head[0]), min(widths[0], width - sum(widths[1:]) - len(widths) + 1))
    lines = []
    for r in cells:
        if len(r[0]) > widths[0]:
            lines.append(r[0])
            r = ["", *r[1:]]
        lines.append(" ".join(c.ljust(w) if i in left else c.rjust(w)
                              for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    return "\n".join(lines)


def wrap(text: str, width: int = 80) -> str:
    """`text` in lines of at most `width` columns, the later ones indented by two."""
    return textwrap.fill(text, width, subsequent_indent="  ", break_on_hyphens=False,
                         break_long_words=False)


def fmt(x: float | None, spec: str = ".1f") -> str:
    """`x` formatted by `spec`, ``-`` for None."""
    return "-" if x is None else format(x, spec)
