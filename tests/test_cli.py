"""The ``kvstore`` command as a new user meets it: bad flags, --version, --help, a sweep
where nothing fits, and Ctrl-C in a real process."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

import kvstore
from kvstore.cli import main

# The console script in a fresh interpreter (the installed script may not be on PATH
# under pytest): main() reads its arguments from sys.argv.
MAIN = "import sys; from kvstore.cli import main; sys.exit(main())"
BENCH = ["bench", "--model-shape", "tiny", "--jobs", "1", "--limit", "5"]


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run `argv`, expect exit status 2 with one line on stderr; return that line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert out == ""
    return lines[0]


@pytest.mark.parametrize("command", [[], ["bench"], ["bench", "sweep"], ["bench", "manager"],
                                     ["viz"], ["generate"]])
def test_an_unknown_option_is_reported_by_its_subcommand(capsys, command):
    prog = " ".join(["kvstore", *command])
    line = _usage_error(capsys, [*command, "--bogus"])
    assert line == f"{prog}: error: unrecognized arguments: --bogus (see {prog} --help)"


@pytest.mark.parametrize("argv, flag", [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--n", "0"], "--n"),
    (["--n", "100000"], "--n"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--block-size", "0"], "--block-size"),
    (["--num-blocks", "1"], "--num-blocks"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--seed", "x"], "--seed"),
    (["--checkpoint", "/nonexistent"], "--checkpoint"),
])
def test_generate_rejects_bad_flags(capsys, argv, flag):
    line = _usage_error(capsys, ["generate", *argv])
    assert line.startswith("kvstore generate: error: argument ") and flag in line


def test_generate_checkpoint_without_config(capsys, tmp_path):
    line = _usage_error(capsys, ["generate", "--checkpoint", str(tmp_path)])
    assert "--checkpoint" in line and "config.json" in line


def test_generate_pool_too_small_for_a_prompt(capsys):
    """The rule: the pool must hold any one demo prompt with its output for all samples."""
    line = _usage_error(capsys, ["generate", "--num-blocks", "3", "--device", "cpu"])
    assert "--num-blocks" in line and "too small" in line
    need = int(re.search(r"use --num-blocks (\d+) or more", line).group(1))
    assert need > 3
    line = _usage_error(capsys, ["generate", "--num-blocks", str(need - 1), "--device", "cpu"])
    assert f"use --num-blocks {need} or more" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_generate_device_and_backend_need_cuda(capsys, monkeypatch):
    line = _usage_error(capsys, ["generate", "--device", "cuda"])
    assert "--device" in line and "CUDA is not available" in line
    line = _usage_error(capsys, ["generate", "--device", "nonsense"])
    assert "--device" in line
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    line = _usage_error(capsys, ["generate", "--backend", "triton"])
    assert "--backend" in line and "TRITON_INTERPRET=1" in line


@pytest.mark.parametrize("argv, flag", [
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "-1"], "--max-num-batched-tokens"),
    (["--jobs", "-2"], "--jobs"),
    (["--jobs", "0"], "--jobs"),
    (["--limit", "-5"], "--limit"),
    (["--points", "0"], "--points"),
    (["--policies", ""], "--policies"),
    (["--policies", " , "], "--policies"),
    (["--policies", "naive,bogus"], "--policies"),
    (["--pool-sizes", "12 parsecs"], "--pool-sizes"),
    (["--pool-sizes", "1"], "--pool-sizes"),
    (["--block-size", "0"], "--block-size"),
    (["--seed", "-1"], "--seed"),
    (["--workload", "nope"], "--workload"),
    (["--trace", "/nonexistent/trace.jsonl"], "--trace"),
    (["--host-tier-bytes", "0"], "--host-tier-bytes"),
    (["--host-tier-bytes", "lots"], "--host-tier-bytes"),
    (["--host-tier-bytes", "1MiB", "--policies", "naive,paged"], "--host-tier-bytes"),
    (["--store", "ftp://cache-host"], "--store"),
    (["--store", "mem:0B"], "--store"),
    (["--store", "valkey://127.0.0.1:1/0"], "--store"),  # nothing listens on port 1
])
def test_bench_rejects_bad_flags(capsys, tmp_path, argv, flag):
    line = _usage_error(capsys, [*BENCH, "--out", str(tmp_path / "out"), *argv])
    assert line.startswith("kvstore bench: error: argument ") and flag in line
    assert not (tmp_path / "out").exists()


def test_bench_out_must_be_a_folder(capsys, tmp_path):
    f = tmp_path / "results.txt"
    f.write_text("")
    line = _usage_error(capsys, [*BENCH, "--out", str(f)])
    assert "--out" in line and "is a file" in line
    line = _usage_error(capsys, [*BENCH, "--out", str(f / "sub")])
    assert "--out" in line and "is a file" in line


def test_bench_trace_for_a_built_in_workload(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    line = _usage_error(capsys, [*BENCH, "--trace", str(trace), "--out", str(tmp_path)])
    assert "--trace" in line and "only applies to trace workloads" in line


@pytest.mark.parametrize("workload", ["mooncake-synthetic", "mooncake-conversation", "azure-code",
                                      "azure-conv"])
def test_bench_missing_trace_says_where_to_get_it(capsys, tmp_path, monkeypatch, workload):
    monkeypatch.setenv("KVSTORE_TRACES", str(tmp_path))  # an empty trace folder
    line = _usage_error(capsys, [*BENCH, "--workload", workload, "--out", str(tmp_path / "o")])
    assert "--workload" in line and "--trace PATH" in line and "KVSTORE_TRACES" in line
    assert "https://github.com/" in line


def test_bench_nothing_fits(capsys, tmp_path):
    """Every pool size too small: the table, one clear line, a non-zero exit, no files."""
    out = tmp_path / "out"
    assert main([*BENCH, "--pool-sizes", "2,3", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing fits" in err[0] and "--pool-sizes" in err[0]
    assert not out.exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvstore {kvstore.__version__}"


def test_help_lists_defaults_and_traces(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 16)" in text and "(default: 256)" in text and "(default: llama-3-8b)" in text
    assert "KVSTORE_TRACES" in text and "--trace PATH" in text and "--in-place" in text
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "(default: 512)" in " ".join(capsys.readouterr().out.split())


def test_bench_help_names_every_question(capsys):
    from kvstore.cli import build_parser

    questions = ("manager", "replay", "tiers", "kernels", "recurrent")
    assert all(callable(build_parser().parse_args(["bench", q]).func) for q in questions)
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    summary = text.split("benchmarks:")[1].split(" viz ")[0]
    assert [q for q in questions if q not in summary] == []


def test_generate_synopsis_in_the_docs_names_every_model():
    from pathlib import Path

    from kvstore.cli import DEMO_MODELS, HYBRID_MODELS, REAL_MODELS

    text = (Path(__file__).resolve().parent.parent / "docs" / "engine.md").read_text()
    synopsis = text.split("## `kvstore generate`")[1].split("```")[1]
    assert [m for m in (*DEMO_MODELS, *HYBRID_MODELS, *REAL_MODELS)
            if not re.search(rf"\b{m}\b", synopsis)] == []


def test_building_the_parser_imports_no_torch():
    code = ("import sys; from kvstore.cli import build_parser; build_parser().format_help(); "
            "sys.exit('torch' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_console_script_bad_flag_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-c", MAIN, "bench", "--jobs", "-2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--jobs" in proc.stderr


# ---------------------------------------------------------------------------- Ctrl-C


def _read(fd: int, until: re.Pattern[bytes] | None, timeout: float) -> bytes:
    """What the process writes to its terminal, until `until` matches or it closes."""
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other side closed
            break
        if not chunk:
            break
        buf += chunk
        if until is not None and until.search(buf):
            break
    return buf


def _group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _default_sigint() -> None:
    """In the child, before exec: SIGINT back to its default action. A shell running pytest in
    the background (`nohup`, `&`) starts it with SIGINT ignored, children inherit that, and
    Python leaves an ignored SIGINT ignored, so the Ctrl-C the test sends would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 3])
def test_ctrl_c_stops_workers_and_keeps_finished_points(tmp_path, presses):
    """In a terminal, Ctrl-C (SIGINT to the foreground process group) during a 2-worker
    sweep: one line, status 130, no worker left, the finished replays written."""
    total = 4 * 5 + 3  # 4 pool sizes x 5 policies + 3 unbounded references
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120", "LINES": "40"}
    proc = subprocess.Popen(
        [sys.executable, "-c", MAIN, "bench", "--model-shape", "tiny", "--points", "4", "--limit", "120",
         "--jobs", "2", "--out", "out"],
        cwd=tmp_path, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
        preexec_fn=_default_sigint)
    os.close(slave)
    try:
        started = _read(master, re.compile(rb"\b[1-9]\d*/%d\b" % total), timeout=120)
        assert re.search(rb"\b[1-9]\d*/%d\b" % total, started), started.decode(errors="replace")
        for _ in range(presses):
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.05)
        rest = _read(master, None, timeout=60)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
    text = rest.decode(errors="replace")
    assert rc == 130, text
    assert "Traceback" not in text
    assert len(re.findall(r"interrupted", text)) == 1, text
    assert _group_gone(proc.pid, timeout=30), "worker processes outlived the run"
    runs = list((tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    if "kept the" in text:
        (run,) = runs
        meta = json.loads((run / "sweep.json").read_text())["meta"]
        assert meta["interrupted"] and 1 <= meta["completed_replays"] < total
        assert (run / "sweep.csv").is_file() and (run / "tables.md").is_file()
    else:  # a later press landed after the sweep, before the save began
        assert "kvstore: interrupted" in text
