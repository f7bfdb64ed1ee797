"""tools/hf_sweep: one line per family and the exit status, from a real run and from
families whose process fails."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "hf_sweep"


def _load() -> ModuleType:
    """The script as a module (it has no .py suffix)."""
    loader = importlib.machinery.SourceFileLoader("hf_sweep", str(SCRIPT))
    spec = importlib.util.spec_from_loader("hf_sweep", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_exact_and_refused_families(tmp_path):
    out = tmp_path / "rows.jsonl"
    run = subprocess.run([sys.executable, str(SCRIPT), "--only", "llama,doge", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "llama: exact"
    assert lines[1].startswith("doge: refused: ") and "attention_mask" in lines[1]
    assert lines[2].startswith("2 families: 1 exact, 1 refused, 0 skipped, 0 DEFECT")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["model_type"], r["status"]) for r in rows] == [("llama", "exact"), ("doge", "refused")]


def _die(mt: str) -> tuple[str, str]:
    os._exit(3)


def _hang(mt: str) -> tuple[str, str]:
    time.sleep(60)
    return "exact", ""


def _wrong(mt: str) -> tuple[str, str]:
    raise AssertionError("tokens differ")


@pytest.mark.parametrize("fake, want", [
    (_die, "llama: DEFECT: process died (exit code 3)"),
    (_hang, "llama: DEFECT: timeout after 0.5 s"),
    (_wrong, "llama: DEFECT: AssertionError: tokens differ"),
])
def test_a_failing_family_is_a_defect_row(monkeypatch, capsys, fake, want):
    sweep = _load()
    monkeypatch.setattr(sweep, "sweep_one", fake)  # the forked child runs the fake
    assert sweep.main(["--only", "llama", "--timeout", "0.5"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == want
    assert lines[1].startswith("1 families: 0 exact, 0 refused, 0 skipped, 1 DEFECT")
