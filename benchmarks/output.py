"""Writing benchmark results: CSV, JSON and figures (matplotlib, headless)."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


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
    """``obj`` as indented JSON (values JSON cannot hold are written as strings)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the headless Agg backend (no display is ever needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
