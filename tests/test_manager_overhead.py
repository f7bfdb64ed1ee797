"""``kvstore bench manager``: workloads, the driver and the worker protocol."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvstore.benchmarks import manager
from kvstore.benchmarks.manager import (
    KvstoreSide,
    Worker,
    cache_layer_tree,
    drive,
    ideal_hit_rate,
    make_specs,
)


def test_workloads_are_seeded_and_in_range() -> None:
    a, b = make_specs("shared-prefix", 40, seed=3), make_specs("shared-prefix", 40, seed=3)
    assert a == b
    assert make_specs("shared-prefix", 40, seed=4) != a
    for s in a:
        assert 500 <= len(s.prompt) <= 2000
        assert 100 <= len(s.outputs) <= 300
    # Requests share system prompts, so an infinite cache serves some of every later prompt.
    assert 0.0 < ideal_hit_rate(a) <= ideal_hit_rate(a, None) < 1.0
    for name in ("chat", "few-shot"):
        specs = make_specs(name, 20)
        assert specs and ideal_hit_rate(specs, None) > 0.0


def test_the_seed_draws_the_workload(capsys) -> None:
    """--seed reaches the workload: the ideal hit rate printed is that of the seeded draw."""
    from kvstore.cli import main

    assert main(["bench", "manager", "--quick", "--requests", "12", "--scenarios",
                 "full/roomy", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    specs = make_specs("shared-prefix", 12, seed=5)
    assert specs != make_specs("shared-prefix", 12)
    assert "(seed 5)" in out and f"hit rate {ideal_hit_rate(specs):.4f} whole" in out


@pytest.mark.parametrize("layout", ["full", "hybrid", "gemma3"])
def test_drive_finishes_every_request_without_leaks(layout: str) -> None:
    specs = make_specs("shared-prefix", 12)
    # A pool this small forces preemptions; drive raises if any block leaks.
    num_blocks = {"full": 260, "hybrid": 520, "gemma3": 1600}[layout]
    res = drive(KvstoreSide(layout, num_blocks, {}), specs, layout, num_blocks, max_running=8,
                budget_tokens=2048)
    assert res.finished == len(specs)
    assert res.calls["admit"] >= len(specs)
    assert res.calls["decode"] > 0 and res.calls["free"] >= len(specs)
    assert 0.0 <= res.hit_rate <= ideal_hit_rate(specs, None) + 1e-9
    assert res.manager_s >= res.hash_s > 0.0


def test_chat_turns_hit_earlier_turns_outputs() -> None:
    specs = make_specs("chat", 15)
    res = drive(KvstoreSide("full", 4000, {}), specs, "chat", 4000)
    assert res.finished == len(specs) and res.hit_rate > 0.3


def test_a_missing_option_is_an_error_not_a_silent_default() -> None:
    with pytest.raises(TypeError, match="no_such_option"):
        KvstoreSide("full", 100, {"no_such_option": True})


def test_worker_runs_a_scenario_on_a_cache_layer_tree(tmp_path: Path) -> None:
    import json
    from dataclasses import asdict

    root = Path(manager.__file__).resolve().parent.parent
    tree = cache_layer_tree(root / "kvstore", tmp_path / "tree")
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps([asdict(s) for s in make_specs("shared-prefix", 6)]))
    worker = Worker("this", "kvstore", sys.executable, str(tree), specs)
    try:
        assert str(tree) in worker.where
        res = worker.result("hybrid/roomy", 2000)
        assert res.finished == 6
        bad = worker.ask({"scenario": "nope/roomy", "num_blocks": 2000, "options": {}})
        assert "error" in bad
    finally:
        worker.close()


def test_vllm_that_cannot_import_its_manager_is_a_usage_error(tmp_path: Path, capsys,
                                                              monkeypatch) -> None:
    """--vllm: an interpreter whose vLLM lacks a working v1 KVCacheManager is refused before
    any replay, naming the import that failed."""
    from kvstore.cli import main

    (tmp_path / "vllm" / "v1").mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "v1" / "__init__.py").write_text("raise ImportError('broken build')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(manager, "make_specs", lambda *a, **k: pytest.fail("ran the replay"))
    with pytest.raises(SystemExit) as e:
        main(["bench", "manager", "--vllm", sys.executable])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "vllm.v1.core.kv_cache_manager" in err and "broken build" in err
