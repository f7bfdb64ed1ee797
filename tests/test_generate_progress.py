"""`kvstore generate`'s progress lines (stderr): stages at once, running counts rate-limited,
in place on a terminal; the step loop reports prefill, then decode, and returns what
``LLMEngine.generate`` returns."""

from __future__ import annotations

import io

import pytest

from kvstore.cli.generate import Progress, build_demo_model, demo_prompts, generate_with_progress
from kvstore.engine.engine import EngineConfig, LLMEngine, SamplingParams


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_stages_print_at_once_and_updates_are_rate_limited() -> None:
    out = io.StringIO()
    p = Progress(out, interval=3600)
    p.stage("reading x")
    p.update("step 1")  # within the interval: not shown
    p.stage("round 1/3")
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["kvstore generate: reading x",
                                                       "kvstore generate: round 1/3"]
    assert all(line.endswith(" s)") for line in lines)
    p = Progress(out, interval=0)
    p.update("step 2")
    assert out.getvalue().splitlines()[-1].startswith("kvstore generate: step 2 (")


def test_terminal_updates_rewrite_one_line() -> None:
    term = _Terminal()
    p = Progress(term, interval=0)
    p.update("step 1")
    p.update("step 2")
    p.stage("done")
    text = term.getvalue()
    assert text.count("\r\x1b[K") == 2 and text.count("\n") == 2  # the updates' line, then "done"
    assert text.rstrip("\n").endswith(" s)") and "kvstore generate: done" in text


def test_silent_without_a_stream() -> None:
    p = Progress()
    p.stage("x")
    p.update("y")
    p.end()


@pytest.mark.parametrize("interval", [0.0, 3600.0])
def test_step_loop_reports_and_matches_generate(interval: float) -> None:
    model = build_demo_model("llama")
    prompts = demo_prompts(model.config.vocab_size, 16)
    sampling = SamplingParams(max_tokens=4)
    expected = LLMEngine(model, EngineConfig(num_blocks=64, block_size=16)).generate(prompts, sampling)
    out = io.StringIO()
    got = generate_with_progress(LLMEngine(model, EngineConfig(num_blocks=64, block_size=16)), prompts,
                                  sampling, "round 1/1", Progress(out, interval=interval))
    assert [o.request_id for o in got] == [o.request_id for o in expected]
    assert [[s.token_ids for s in o.outputs] for o in got] == \
        [[s.token_ids for s in o.outputs] for o in expected]
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"kvstore generate: round 1/1: {len(prompts)} request(s), "
                               f"{sum(map(len, prompts))} prompt tokens")
    if interval == 0:
        assert "decode, " in out.getvalue() and f"{len(prompts)}/{len(prompts)} done" in lines[-1]
    else:
        assert len(lines) == 1
