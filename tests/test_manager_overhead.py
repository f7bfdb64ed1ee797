"""The hot-path benchmark (benchmarks/hot_path.py): workload, driver and worker protocol."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvstore.benchmarks import hot_path
from kvstore.benchmarks.hot_path import (
    KvstoreSide,
    Worker,
    cache_layer_tree,
    drive,
    ideal_hit_rate,
    make_workload,
)


def test_workload_is_seeded_and_in_range() -> None:
    a, b = make_workload(40, seed=3), make_workload(40, seed=3)
    assert a == b
    assert make_workload(40, seed=4) != a
    for s in a:
        assert 500 <= len(s.prompt) <= 2000
        assert 100 <= len(s.outputs) <= 300
    # Requests share system prompts, so an infinite cache serves some of every later prompt.
    assert 0.0 < ideal_hit_rate(a) <= ideal_hit_rate(a, None) < 1.0


@pytest.mark.parametrize("layout", ["full", "hybrid", "gemma3"])
def test_drive_finishes_every_request_without_leaks(layout: str) -> None:
    specs = make_workload(12)
    # A pool this small forces preemptions; drive raises if any block leaks.
    num_blocks = {"full": 260, "hybrid": 520, "gemma3": 1600}[layout]
    res = drive(KvstoreSide(layout, num_blocks), specs, layout, num_blocks, max_running=8,
                budget_tokens=2048)
    assert res.finished == len(specs)
    assert res.admit_n >= len(specs)
    assert res.decode_n > 0 and res.free_n >= len(specs)
    assert 0.0 <= res.hit_rate <= ideal_hit_rate(specs, None) + 1e-9
    assert res.manager_s >= res.hash_s > 0.0


def test_worker_runs_a_scenario_on_a_cache_layer_tree(tmp_path: Path) -> None:
    root = Path(hot_path.__file__).resolve().parent.parent
    tree = cache_layer_tree(root / "kvstore", tmp_path / "tree")
    worker = Worker("this", "kvstore", sys.executable, str(tree))
    try:
        assert worker.where.startswith(str(tree))
        out = worker.ask({"cmd": "scenario", "layout": "hybrid", "regime": "roomy",
                          "num_blocks": 2000, "num_requests": 6})
        assert "error" not in out and out["finished"] == 6
        bad = worker.ask({"cmd": "scenario", "layout": "nope", "regime": "roomy",
                          "num_blocks": 2000, "num_requests": 6})
        assert "error" in bad
    finally:
        worker.close()
