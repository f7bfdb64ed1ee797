"""The Mooncake pool replay against its oracle, the sweep, and the bench / viz commands."""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import shlex
from datetime import datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore
from kvstore.benchmarks import sweep
from kvstore.benchmarks.bench import add_bench_parser, load_bench_workload, print_table
from kvstore.benchmarks.replay import pool_replay, run_mooncake_replay
from kvstore.benchmarks.sweep import (
    DEFAULT_POLICIES,
    MODEL_SHAPES,
    POLICIES,
    default_budgets,
    format_bytes,
    parse_pool_sizes,
    parse_size,
    run_point,
    run_sweep,
)
from kvstore.benchmarks.traces import MooncakeRequest, mooncake_lru_replay
from kvstore.benchmarks.viz import add_viz_parser, demo_scenario, run_viz

BT = 512


def _req(ts: int, ids: list[int], input_length: int | None = None, out: int = 10) -> MooncakeRequest:
    n = input_length if input_length is not None else len(ids) * BT - 100
    return MooncakeRequest(ts, n, out, tuple(ids))


HAND_TRACE = [
    _req(0, [0, 1, 2]),
    _req(1, [0, 1, 3, 4]),
    _req(2, [0, 5]),
    _req(3, [0, 1, 2, 6, 7]),
    _req(4, [8, 9, 10, 11, 12, 13]),  # longer than a 4-block pool
    _req(5, [0, 1, 3]),
    _req(6, [8, 9]),
    _req(7, [0, 1, 2, 6], input_length=4 * BT),  # whole prompt cached: hit capped at input
]


def _same(pool: dict, oracle: dict) -> None:
    assert pool["per_request_hit_tokens"] == oracle["per_request_hit_tokens"]
    assert pool["hit_tokens"] == oracle["hit_tokens"]
    assert pool["hit_blocks"] == oracle["hit_blocks"]
    assert pool["evictions"] == oracle["evictions"]
    assert pool["token_hit_rate"] == oracle["token_hit_rate"]
    assert pool["link_breaks"] == 0


@pytest.mark.parametrize("cap", [None, 0, 1, 2, 3, 4, 5, 8, 100])
def test_pool_replay_equals_oracle_on_hand_trace(cap):
    _same(pool_replay(HAND_TRACE, cap), mooncake_lru_replay(HAND_TRACE, cap))


def test_pool_replay_hand_values():
    """Unbounded: each request hits its longest previously seen prefix, in whole blocks."""
    res = pool_replay(HAND_TRACE, None)
    assert res["per_request_hit_tokens"] == [0, 2 * BT, BT, 3 * BT, 0, 3 * BT - 100, 2 * BT - 100,
                                             4 * BT]
    assert res["evictions"] == 0
    # A 5-block pool: request 4 keeps only its first 5 blocks, freed deepest first, so
    # request 5 evicts 12, 11, 10 and request 6 still hits 8 and 9.
    small = pool_replay(HAND_TRACE, 5)
    assert small["per_request_hit_tokens"][6] == 2 * BT - 100
    # A 3-block pool: request 5 evicts all of 8, 9, 10.
    assert pool_replay(HAND_TRACE, 3)["per_request_hit_tokens"][6] == 0


def _random_trace(rng: random.Random, n: int) -> list[MooncakeRequest]:
    """Prefix-chained ids: each request walks a random path of a growing tree."""
    children: dict[int | None, list[int]] = {}
    next_id = 0
    rows = []
    for i in range(n):
        parent, ids = None, []
        depth = rng.randint(1, 9)
        for _ in range(depth):
            kids = children.setdefault(parent, [])
            if kids and rng.random() < 0.7:
                h = rng.choice(kids)
            else:
                h = next_id
                next_id += 1
                kids.append(h)
            ids.append(h)
            parent = h
        length = (len(ids) - 1) * BT + rng.randint(1, BT)
        rows.append(MooncakeRequest(rng.randint(0, 50) if rng.random() < 0.3 else i,
                                    length, rng.randint(1, 300), tuple(ids)))
    return rows


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 60),
       cap=st.one_of(st.none(), st.integers(0, 40)))
def test_pool_replay_equals_oracle_on_random_traces(seed, n, cap):
    rows = _random_trace(random.Random(seed), n)
    _same(pool_replay(rows, cap), mooncake_lru_replay(rows, cap))


def test_pool_capped_at_distinct_ids_is_exact():
    rows = _random_trace(random.Random(7), 200)
    distinct = len({h for r in rows for h in r.hash_ids})
    big = pool_replay(rows, distinct * 10)
    assert big["pool_blocks"] == distinct and big["evictions"] == 0
    _same(big, mooncake_lru_replay(rows, distinct * 10))


def test_pool_replay_counts_a_continued_partial_block():
    # Turn 2 repeats turn 1's input (1.5 blocks) + output (100) + more: its block 1 holds
    # turn 1's partial block (256 tokens), now full, under a new id.
    t1 = MooncakeRequest(0, BT + 256, 100, (0, 1))
    t2 = MooncakeRequest(1, 3 * BT, 50, (0, 2, 3))
    res = pool_replay([t1, t2], None)
    assert res["partial_tail_tokens"] == 256
    assert res["token_hit_rate_with_tails"] == (BT + 256) / (BT + 256 + 3 * BT)
    assert pool_replay([t1, MooncakeRequest(1, BT + 356, 50, (0, 2))], None)["partial_tail_tokens"] == 0


def test_run_mooncake_replay_writes_figure(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = _random_trace(random.Random(1), 80)
    with open(trace, "w") as f:
        for r in rows:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)})
                    + "\n")
    paper = tmp_path / "paper.csv"
    paper.write_text("workload,capacity_tokens,capacity_blocks_512,source,token_hit_rate,"
                     "block_hit_rate\nsynthetic,10240,20,test,0.3,\n")
    res = run_mooncake_replay(tmp_path / "out", {"synthetic": trace}, capacities=[2048, 10240, 102400],
                              paper_path=paper, log=lambda *a: None)
    for ext in ("png", "json", "csv"):
        assert (tmp_path / "out" / f"mooncake_hit_rate.{ext}").stat().st_size > 0
    assert all(r["agree"] for r in res["curves"]["synthetic"])
    assert res["comparison"] == [{"trace": "synthetic", "capacity_tokens": 10240, "paper": 0.3,
                                  "kvstore": res["curves"]["synthetic"][1]["token_hit_rate"],
                                  "with_tails": res["curves"]["synthetic"][1]["token_hit_rate_with_tails"]}]
    assert res["ceiling"]["synthetic"] == mooncake_lru_replay(rows, None)["token_hit_rate"]


def test_replay_prints_tables_within_80_columns_and_writes_them_as_markdown(tmp_path, capsys):
    """Every `bench replay` table fits 80 columns on stdout, a table per trace, and is written
    whole (every trace, its legend) as Markdown into --out."""
    from kvstore.cli import main

    trace = tmp_path / "trace.jsonl"
    with open(trace, "w") as f:
        for r in _random_trace(random.Random(2), 60):
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)})
                    + "\n")
    out = tmp_path / "o"
    assert main(["bench", "replay", "--trace", str(trace), "--what", "policies,layouts",
                 "--capacities", "100000,1000000", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    wide = [line for line in printed.splitlines() if len(line) > 80 and str(out) not in line]
    assert not wide
    # Rows: a capacity each (one trace, named by its file), a capacity and policy each.
    for stem, head, n in (("eviction_hit_rate", "| trace | capacity | lru |", 2),
                          ("eviction_hybrid", "| trace | budget | all-full lru |", 2),
                          ("eviction_hybrid_groups", "| trace | budget | policy |", 10)):
        md = (out / f"{stem}.md").read_text()
        assert md.startswith(head) and md.count("\n| trace | ") == n
        assert md.splitlines()[-1] in printed.replace("\n  ", " ")  # the legend, as printed


# ----------------------------------------------------------------------------- sweep


def test_sizes():
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1048576") == 1 << 20  # a bare count is bytes
    with pytest.raises(ValueError, match="positive"):
        parse_size("0B")
    assert parse_pool_sizes("512MiB,1GiB", 4096) == [1 << 30, 512 << 20]
    assert parse_pool_sizes("4000,2000", 4096) == [4000 * 4096, 2000 * 4096]
    with pytest.raises(ValueError):
        parse_size("12 parsecs")
    with pytest.raises(ValueError):
        parse_pool_sizes("1", 4096)
    assert format_bytes(3 << 30) == "3 GiB"
    assert format_bytes(1023 << 20) == "1023 MiB"  # no exponent
    assert format_bytes(int(2.56 * 2**30)) == "2.56 GiB" and format_bytes(5) == "5 B"
    assert MODEL_SHAPES["llama-3-8b"].bytes_per_token == 128 * 1024


@pytest.mark.slow
def test_sweep_end_points():
    """The largest default budget holds everything (no eviction, no preemption); the
    smallest still runs the largest request; naive idles more than paged."""
    w = load_bench_workload("mixed_default", limit=16, seed=1)
    shape = MODEL_SHAPES["tiny"]
    budgets = default_budgets(w, shape, 16, 3)
    res = run_sweep(w, shape=shape, block_size=16, budgets=budgets, jobs=1)
    first = [r.metrics for r in res.rows if r.point == 0]
    assert all(m is not None and m.evictions == 0 and m.preemptions == 0 for m in first)
    assert all(r.feasible for r in res.rows) and not res.nothing_fits
    by = {(r.policy, r.point): r for r in res.rows}
    assert by["naive", 0].metrics.mean_idle_bytes > by["paged", 0].metrics.mean_idle_bytes
    assert by["partial", 0].vs_unbounded == pytest.approx(1.0)
    assert by["prefix", 0].metrics.prompt_hit_rate <= res.meta.ideal_block_hit_rate + 1e-12
    assert by["paged", 0].as_dict()["steps"] == by["paged", 0].metrics.steps  # the flat row
    assert set(res.unbounded) == {"prefix", "partial", "hybrid"}
    assert res.findings["partial"]["first_preemption"]["budget_bytes"] in (None, *budgets[1:])
    m = by["paged", 0].metrics
    assert by["paged", 0].model_time_s == pytest.approx(0.005 * m.steps + 40e-6 * m.computed_tokens)
    assert 0 < m.mean_running <= 256
    assert res.meta.completed_replays == res.meta.total_replays == 3 * 5 + 3
    assert not res.meta.interrupted


def test_rows_that_cannot_fit():
    """A budget under 2 blocks and one too small for a request are rows that do not fit
    (with the reason), and so is every row of a sweep where nothing fits."""
    w = load_bench_workload("mixed_default", limit=8, seed=1)
    shape = MODEL_SHAPES["tiny"]
    bpb = shape.block_bytes(16)
    tiny = run_point(w, POLICIES["paged"], shape, 16, bpb)
    assert not tiny.feasible and tiny.metrics is None and tiny.num_blocks == 1
    assert "at least 2" in tiny.error
    small = run_point(w, POLICIES["paged"], shape, 16, 3 * bpb)
    assert not small.feasible and "may need" in small.error
    flat = small.as_dict()
    assert "steps" not in flat and "vs_ideal" not in flat and flat["num_blocks"] == 3
    res = run_sweep(w, shape=shape, block_size=16, budgets=[bpb, 3 * bpb], jobs=1)
    assert res.nothing_fits and all(r.budget_label for r in res.rows)
    assert set(res.unbounded) == {"prefix", "partial", "hybrid"}  # the references still run


def test_other_errors_are_not_swallowed(monkeypatch):
    """Only a request that can never fit becomes a row that does not fit; any other error
    of a replay propagates."""
    def broken(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(sweep, "simulate", broken)
    w = load_bench_workload("mixed_default", limit=4, seed=1)
    with pytest.raises(ValueError, match="a bug"):
        run_point(w, POLICIES["paged"], MODEL_SHAPES["tiny"], 16, None)


_SIMULATE = sweep.simulate


def _interrupt_after(monkeypatch, n: int) -> None:
    """Make the replay after the first `n` raise KeyboardInterrupt, as Ctrl-C would."""
    calls = []

    def simulate(*args, **kwargs):
        calls.append(1)
        if len(calls) > n:
            raise KeyboardInterrupt
        return _SIMULATE(*args, **kwargs)

    monkeypatch.setattr(sweep, "simulate", simulate)


def test_interrupted_sweep_keeps_finished_replays(monkeypatch):
    _interrupt_after(monkeypatch, 2)
    w = load_bench_workload("mixed_default", limit=8, seed=1)
    with pytest.raises(sweep.SweepInterrupted) as info:
        run_sweep(w, shape="tiny", block_size=16, num_points=2, jobs=1)
    partial = info.value.partial
    assert isinstance(info.value, KeyboardInterrupt)
    assert partial.meta.interrupted and partial.meta.completed_replays == 2
    assert partial.meta.total_replays == 2 * 5 + 3
    assert [(r.policy, r.point) for r in partial.rows] == [("naive", 0), ("paged", 0)]


# ------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    add_viz_parser(sub)
    return parser


QUICK = ["bench", "--quick", "--workload", "mixed_default", "--limit", "12", "--model-shape", "tiny",
         "--jobs", "1"]


@pytest.mark.slow
def test_bench_quick_writes_json_csv_png(tmp_path):
    out = tmp_path / "bench"
    args = _parser().parse_args([*QUICK, "--seed", "3", "--out", str(out)])
    assert args.func(args) == 0
    (run,) = out.iterdir()  # a fresh timestamped folder per run
    assert re.fullmatch(r"\d{8}-\d{6}", run.name)
    for name in ("hit_rate_vs_pool", "cost_vs_pool", "paged_vs_naive"):
        assert (run / f"{name}.png").stat().st_size > 0
    data = json.loads((run / "sweep.json").read_text())
    assert data["meta"]["num_requests"] == 12
    assert len(data["rows"]) == 4 * 5
    assert data["run"]["version"] == kvstore.__version__
    assert data["run"]["seed"] == 3 and data["run"]["arguments"]["seed"] == 3
    assert data["run"]["arguments"]["policies"] == list(DEFAULT_POLICIES)
    assert datetime.fromisoformat(data["run"]["timestamp"]).tzinfo is not None
    with open(run / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["policy"] for r in rows} == {"naive", "paged", "prefix", "partial", "hybrid"}
    assert len(rows) == 4 * 5 + 3  # and the unbounded references
    assert list(rows[0])[:3] == ["policy", "layout", "point"]
    tables = (run / "tables.md").read_text()
    assert tables.count("| KV budget | policy |") == 1 and "| budget | policy |" in tables
    header, sep, first = tables.splitlines()[2:5]
    assert header.count("|") == sep.count("|") == first.count("|")
    # A second run never mixes its files with the first's; --in-place writes into --out.
    assert args.func(args) == 0
    assert len(list(out.iterdir())) == 2
    args = _parser().parse_args([*QUICK, "--out", str(out), "--in-place"])
    assert args.func(args) == 0
    assert (out / "sweep.json").is_file() and len([p for p in out.iterdir() if p.is_dir()]) == 2


def test_bench_interrupted_writes_finished_replays(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench"
    args = _parser().parse_args([*QUICK, "--out", str(out)])
    _interrupt_after(monkeypatch, 0)
    assert args.func(args) == 130
    assert not out.exists()  # nothing had finished: no folder, not even an empty one
    assert "nothing written" in capsys.readouterr().err
    _interrupt_after(monkeypatch, 3)
    assert args.func(args) == 130
    (run,) = out.iterdir()
    data = json.loads((run / "sweep.json").read_text())
    assert data["meta"]["interrupted"] and data["meta"]["completed_replays"] == 3
    assert len(data["rows"]) == 3 and not (run / "hit_rate_vs_pool.png").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kept the 3 of 23 replays" in err[0]


def test_narrow_table_fits_80_columns():
    from rich.console import Console

    w = load_bench_workload("mixed_default", limit=12, seed=1)
    shape = MODEL_SHAPES["llama-3-8b"]
    budgets = [*default_budgets(w, shape, 16, 2), 3 * shape.block_bytes(16)]
    res = run_sweep(w, shape=shape, block_size=16, budgets=budgets, jobs=1)
    console = Console(width=80, record=True, color_system=None)
    print_table(res, console)
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    assert "vs unb" in text and "hit:" in text and "no fit" in text
    assert " conc " in text and " time" in text and "step-time model (5 ms" in text
    assert "Per group" in text and "window kept" in text  # the hybrid rows' breakdown
    # The breakdown splits the evictions by group kind; only hybrid rows have window groups.
    for r in res.rows:
        if r.metrics is None:
            continue
        (full_kept, full_evicted), (window_kept, window_evicted) = (
            r.metrics.kept_and_evicted(kind) for kind in ("full", "window"))
        assert full_evicted + window_evicted == r.metrics.evictions
        if r.policy == "hybrid":
            assert window_kept > 0 and full_kept > 0
        elif r.policy in ("prefix", "partial"):
            assert window_kept == 0 and window_evicted == 0
    console = Console(width=200, record=True, color_system=None)
    print_table(res, console, wide=True)
    text = console.export_text()
    assert "partial tok" in text and "idle KV" in text and "does not fit" in text


def test_viz_prints_ascii_map(tmp_path, capsys):
    png = tmp_path / "layout.png"
    args = _parser().parse_args(["viz", "--out", str(png)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "[A][A]" in text  # A's first blocks
    assert "[*][*]" in text  # A and B share the system prompt
    assert "[+]" in text  # C's partial hit copies A's last prompt block
    assert "[a]" in text and "[.]" in text  # cached-free full and partial blocks
    assert "[E]" in text and "E admitted, hit 8" in text  # the root survived D's evictions
    assert png.stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--num-blocks", "1"], "argument --num-blocks: must be >= 2, got 1"),
    (["--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
    (["--out", "."], "argument --out: . is a folder"),
])
def test_viz_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["viz", *argv, "--no-png"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err


def test_viz_snapshots():
    recorder, result = run_viz()
    letters = {c for s in recorder.snapshots for c in s.cells}
    assert {"A", "B", "C", "D", "E", "*", "+"} <= letters
    assert result.evictions > 0 and result.copies == 1
    assert len(recorder.snapshots) == result.steps
    assert len(demo_scenario()) == 5


# ------------------------------------------------------------------- documented commands

DOCS_WITH_COMMANDS = ("benchmarks.md", "eviction.md", "cache_layer.md", "hybrid.md", "tiers.md",
                      "recurrent.md", "recurrent_models.md",
                      "kernels.md", "copy_on_write.md")


def _documented_bench_commands() -> list[str]:
    """Every ``kvstore bench ...`` command in the docs (code spans and blocks, joined over
    backslash continuations), with the placeholders REV and PYTHON left as they are."""
    import re

    root = Path(__file__).resolve().parent.parent / "docs"
    found = []
    for name in DOCS_WITH_COMMANDS:
        text = "\n".join(line for line in (root / name).read_text().replace("\\\n", " ").splitlines()
                         if not line.startswith("#"))  # headings name flags, not commands
        text = re.sub(r"(?<!`)`[^`\n]+\n[^`\n]+`(?!`)", lambda m: m.group(0).replace("\n", " "), text)
        for m in re.finditer(r"kvstore bench(?: [^`\n|#'$]*)?", text):
            cmd = m.group(0).split("  #")[0].strip().rstrip(".,;:")
            words = shlex.split(cmd)[2:]
            if "..." in cmd or "[" in cmd or (len(words) > 1 and all(
                    w.startswith("-") for w in words)) or any(
                    len(w) <= 6 and w.isupper() and w not in ("REV", "PYTHON") for w in words) or any(
                    a in ("--host-tier-bytes", "--store") and b.startswith("-")
                    for a, b in zip(words, [*words[1:], "-"][:len(words)], strict=True)):
                continue  # a syntax summary or a list of flags, not a command
            found.append(shlex.join(shlex.split(cmd)))
    return sorted(set(found))


def test_every_documented_bench_command_parses(capsys):
    """Each documented command is one the CLI accepts (flags, names, values)."""
    from kvstore.cli import build_parser

    commands = _documented_bench_commands()
    assert len(commands) >= 10
    parser = build_parser()
    for cmd in commands:
        argv = [{"REV": "HEAD", "PYTHON": "python"}.get(w, w) for w in shlex.split(cmd)[1:]]
        if "--trace" in argv and argv[argv.index("--trace") + 1] in ("conversation", "synthetic"):
            if not (Path(__file__).resolve().parents[2] / "shared" / "traces").is_dir():
                continue
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # pragma: no cover - the failure message names the command
            raise AssertionError(f"documented command does not parse: {cmd}\n"
                                 f"{capsys.readouterr().err}") from e
        assert callable(args.func), cmd


def test_bench_subcommands_reject_bad_values_with_a_usage_error(capsys):
    from kvstore.cli import main

    for argv, bad in ((["bench", "replay", "--trace", "/no/such/trace.jsonl"], "/no/such/trace"),
                      (["bench", "replay", "--what", "nope"], "nope"),
                      (["bench", "manager", "--scenarios", "full/nope"], "full/nope"),
                      (["bench", "manager", "--also", "foo=bar"], "unknown foo"),
                      (["bench", "manager", "--seed", "-1"], "--seed"),
                      (["bench", "manager", "--also", "eviction=nope"], "'nope'"),
                      (["bench", "manager", "--vllm", "/no/such/python"], "/no/such/python"),
                      (["bench", "tiers", "--dtype", "foo"], "'foo'"),
                      (["bench", "tiers", "--device", "foo"], "'foo'"),
                      (["bench", "tiers", "--store", "mem"], "'mem'"),
                      (["bench", "tiers", "--store", "valkey://127.0.0.1:1/0"], "cannot reach"),
                      (["bench", "recurrent", "--requests", "0"], "--requests"),
                      (["bench", "recurrent", "--limit", "-3"], "--limit"),
                      (["bench", "--quick", "sweep"], "--quick given before sweep"),
                      (["bench", "--limit", "5", "manager"], "--limit given before manager"),
                      (["bench", "--policies", "nope"], "nope"),
                      (["bench", "--policies", ""], "--policies: no names given"),
                      (["bench", "--policies", "prefix,,partial"], "an empty name"),
                      (["bench", "replay", "--what", ""], "--what: no names given"),
                      (["bench", "recurrent", "--budgets", "", "--mooncake", ""],
                       "nothing to run"),
                      (["bench", "recurrent", "--budgets", "0.001", "--mooncake", "",
                        "--requests", "2"], "--budgets: 0.001 GiB is too small"),
                      (["bench", "recurrent", "--budgets", "0.2", "--mooncake", "",
                        "--requests", "2", "--layouts", "qwen3-next",
                        "--workloads", "shared_system_prompts", "--repeats", "1"],
                       "--budgets: 0.2 GiB cannot hold a request")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert bad in err and "Traceback" not in err


def test_options_after_a_question_apply_to_it():
    from kvstore.cli import build_parser

    args = build_parser().parse_args(["bench", "sweep", "--quick", "--limit", "5"])
    assert args.quick and args.limit == 5


def test_bench_output_paths_are_checked_before_the_work(tmp_path, capsys, monkeypatch):
    """An --out or --json that cannot be a folder (a file) or cannot be created, or a missing
    trace: a usage error before any replay runs."""
    from kvstore.benchmarks import bench
    from kvstore.cli import main

    monkeypatch.setattr(bench, "_sweep_with_progress", lambda *a, **k: pytest.fail("ran the sweep"))
    monkeypatch.setenv("KVSTORE_TRACES", str(tmp_path / "none"))
    file = tmp_path / "file"
    file.write_text("")
    cases = [(["bench", "replay", "--out", str(file)], "is a file"),
             (["bench", "recurrent", "--out", str(file)], "is a file"),
             (["bench", "tiers", "--json", str(tmp_path)], "is a folder"),
             (["viz", "--out", str(file / "layout.png")], "is a file"),
             (["bench", "recurrent", "--mooncake", "1e6"], "--mooncake ''")]
    if Path("/proc/self").is_dir():  # Linux: nothing can be created in /proc
        cases += [(["bench", "--quick", "--out", "/proc/kvstore-none/out"], "cannot create"),
                  (["viz", "--out", "/proc/kvstore-none/layout.png"], "cannot create")]
    for argv, bad in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and bad in err and len(err.splitlines()) == 1, (argv, err)


def test_viz_out_gets_the_png_suffix_it_is_saved_with(tmp_path, capsys):
    from kvstore.cli import main

    assert main(["viz", "--out", str(tmp_path / "layout")]) == 0
    assert (tmp_path / "layout.png").is_file() and not (tmp_path / "layout").exists()
    assert f"wrote {tmp_path / 'layout.png'}" in capsys.readouterr().out


def test_store_password_never_printed_or_recorded(tmp_path, capsys):
    """A store URL with a password: the usage error, the tier line and the run record show
    it redacted."""
    from kvstore.benchmarks.bench import _arguments
    from kvstore.benchmarks.simulator import TierOptions
    from kvstore.cli import build_parser, main

    url = "valkey://:secret@127.0.0.1:1/0"
    with pytest.raises(SystemExit):
        main(["bench", "--quick", "--store", url, "--out", str(tmp_path)])
    out = capsys.readouterr()
    assert "secret" not in out.out + out.err and "127.0.0.1:1" in out.err
    assert "secret" not in TierOptions(None, url).describe()
    args = build_parser().parse_args(["bench", "--store", url])
    assert "secret" not in json.dumps(_arguments(args), default=str)


def test_wide_table_is_never_cut():
    """--wide prints every column whole, however narrow the console (a pipe)."""
    from rich.console import Console

    w = load_bench_workload("mixed_default", limit=6, seed=1)
    res = run_sweep(w, shape="tiny", block_size=16, num_points=2, policies=["paged"], jobs=1)
    console = Console(width=80, record=True, color_system=None)
    print_table(res, console, wide=True)
    text = console.export_text()
    assert "…" not in text and "KV budget" in text and "idle KV" in text
    assert max(map(len, text.splitlines())) > 80 and console.width == 80


def test_table_that_cannot_fit_says_so(monkeypatch):
    """A table too wide even with every optional column left out: one line instead of a
    cut table."""
    from rich.console import Console

    from kvstore.benchmarks import bench

    w = load_bench_workload("mixed_default", limit=6, seed=1)
    res = run_sweep(w, shape="tiny", block_size=16, num_points=2, policies=["paged"], jobs=1)
    monkeypatch.setattr(bench, "TABLE_WIDTH", 30)
    console = Console(width=80, record=True, color_system=None)
    assert bench.print_table(res, console)
    text = console.export_text()
    assert "table.txt only" in text and "…" not in text


_TRACES = Path("/work/shared/traces")


def _traces_dir() -> Path | None:
    import os

    for d in (os.environ.get("KVSTORE_TRACES"), Path(__file__).resolve().parents[2] / "shared" / "traces",
              _TRACES):
        if d and (Path(d) / "mooncake_conversation_trace.jsonl").is_file():
            return Path(d)
    return None


def _tiny_argv(cmd: str, out: Path) -> tuple[list[str], str | None, list[str]]:
    """A documented command with the smallest arguments that still run what it names:
    (argv, why it cannot run here or None, files it must write under `out`)."""
    import torch

    words = shlex.split(cmd)[2:]
    question = words[0] if words and not words[0].startswith("-") else "sweep"
    args = words[1:] if question != "sweep" or (words and words[0] == "sweep") else words

    def drop(flag: str, has_value: bool = True) -> None:
        while flag in args:
            i = args.index(flag)
            del args[i:i + 1 + has_value]

    if "PYTHON" in args:
        return [], "needs vLLM under another interpreter", []
    if any(a.startswith("valkey") for a in args):
        url = os.environ.get("KVSTORE_VALKEY_URL")  # the server .ci/run starts
        if url is None:
            return [], "needs a Valkey server (KVSTORE_VALKEY_URL)", []
        args[:] = [url if a.startswith("valkey") else a for a in args]
    if "--engines" in args:
        from kvstore.benchmarks.valkey_server import find_server_binary

        try:
            find_server_binary()
        except FileNotFoundError:
            return [], "needs a valkey-server binary", []
    if "cuda" in args and not torch.cuda.is_available():
        return [], "needs CUDA", []
    traces = _traces_dir()
    uses_trace = question == "replay" or any(
        a.startswith("mooncake") for a in args)
    if uses_trace and traces is None:
        return [], "needs the Mooncake traces", []
    if question == "sweep":
        for flag in ("--out", "--points", "--jobs", "--limit"):
            drop(flag)
        drop("--in-place", False)
        return (["bench", *args, "--quick", "--limit", "6", "--points", "2", "--jobs", "1",
                 "--out", str(out), "--in-place"], None, ["sweep.json", "table.txt"])
    if question == "replay":
        for flag in ("--out", "--capacities", "--limit", "--jobs"):
            drop(flag)
        what = args[args.index("--what") + 1]
        files = {"lru": "mooncake_hit_rate.json", "policies": "eviction_hit_rate.json",
                 "layouts": "eviction_hybrid.json", "tiers": "tier_replay_conversation.json"}
        extra = ["--limit", "60", "--capacities", "1000000", "--trace", "conversation"]
        if what == "tiers":
            extra[-2:] = []
            extra += ["--device-tokens", "100000", "--host-tokens", "1000000"]
        return ["bench", "replay", *args, *extra, "--out", str(out)], None, [files[what]]
    if question == "manager":
        for flag in ("--repeats", "--requests"):
            drop(flag)
        drop("--quick", False)
        if "--scenarios" not in args:
            args += ["--scenarios", "full/pressured"]
        return (["bench", "manager", *args, "--quick", "--requests", "6", "--repeats", "1"],
                None, [])
    if question == "tiers":
        for flag in ("--reps", "--blocks", "--pool-blocks"):
            drop(flag)
        small = ["--reps", "1", "--blocks", "2", "--pool-blocks", "8", "--layers", "1",
                 "--kv-heads", "1", "--head-dim", "8", "--json", str(out / "tiers.json")]
        if "--engines" in args:
            small = ["--prefixes", "1", "--prefix-len", "40", "--max-tokens", "2", "--layers", "1"]
        return ["bench", "tiers", *args, *small], None, [] if "--engines" in args else ["tiers.json"]
    if question == "recurrent":  # one small workload and budget; the trace replay cut short
        policy = args[args.index("--eviction"):][:2] if "--eviction" in args else []
        tiny = ["bench", "recurrent", *policy, "--layouts", "qwen3-next", "--requests", "8",
                "--out", str(out)]
        if "--limit" in args:  # the Mooncake replay
            if traces is None:
                return [], "needs the Mooncake traces", []
            tiny += ["--budgets", "", "--mooncake", "1000000", "--limit", "20",
                     "--host-tier-gib", ""]
        else:
            tiny += ["--workloads", "shared_system_prompts", "--budgets", "2", "--mooncake", "",
                     "--host-tier-gib", "4" if "--host-tier-gib" in args else ""]
        return tiny, None, ["recurrent.json", "recurrent.csv"]
    assert question == "kernels", cmd
    drop("--json")
    return ["bench", "kernels", *args, "--json", str(out / "kernels.json")], None, []


@pytest.mark.slow
@pytest.mark.parametrize("cmd", _documented_bench_commands())
def test_documented_bench_command_runs(cmd, tmp_path, capsys, monkeypatch):
    """Each documented ``kvstore bench`` command runs to its end with tiny arguments and
    writes what it says (the kernels, without CUDA, say they cannot run here: status 2)."""
    import torch

    from kvstore.cli import main

    argv, why, files = _tiny_argv(cmd.replace("REV", "HEAD"), tmp_path)
    if why:
        pytest.skip(why)
    if (traces := _traces_dir()) is not None:
        monkeypatch.setenv("KVSTORE_TRACES", str(traces))
    if argv[1].startswith("-") and cmd != "kvstore bench --quick":  # one sweep draws the figures
        from kvstore.benchmarks import bench

        monkeypatch.setattr(bench, "write_figures", lambda *a, **k: [])
    status = main(argv)
    out = capsys.readouterr()
    if argv[1] == "kernels" and not torch.cuda.is_available():
        assert status == 2 and "CUDA" in out.err
        return
    assert status == 0, f"{' '.join(argv)}\n{out.out[-2000:]}\n{out.err[-2000:]}"
    for name in files:
        assert (tmp_path / name).stat().st_size > 0, name
    if argv[1] == "recurrent":
        assert "met in" in out.out  # the goals' summary
    elif argv[1] not in ("replay", "manager", "tiers", "kernels"):
        assert "preemption" in out.out  # the headline


@pytest.mark.parametrize("n", [4, 12, 13, 25])
def test_a_log_axis_marks_every_value_and_labels_at_most_twelve(n: int) -> None:
    from kvstore.benchmarks import output

    plt = output.pyplot()
    fig, ax = plt.subplots()
    xs = [10_000 * 1.5 ** i for i in range(n)]
    output.mark_x(ax, xs, output.short_count)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert list(ax.get_xticks()) == pytest.approx(xs)
    assert labels[0] == "10k" and 0 < sum(1 for t in labels if t) <= 12
    assert all(labels) == (n <= 12)
    plt.close(fig)


def test_help_shows_defaults_as_typed_including_zero(capsys):
    """Every option's default is in its help, a list comma-separated, a 0 included."""
    from kvstore.cli import main

    for argv, shown in ((["bench", "--help"], "workload seed (default: 0)"),
                        (["bench", "recurrent", "--help"], "(default: 0.5,1,2,4,8,16)"),
                        (["bench", "tiers", "--help"], "(default: 512)")):
        with pytest.raises(SystemExit):
            main(argv)
        assert shown in " ".join(capsys.readouterr().out.split())
