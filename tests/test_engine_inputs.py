"""The engine's input checks and error paths: bad settings and requests are refused before
anything changes, aborts reach every sample, and a step that raises leaves no request stuck."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from engines import tokens  # noqa: E402

from kvstore.engine import runner as runner_module  # noqa: E402
from kvstore.engine.engine import (  # noqa: E402
    EngineConfig,
    LLMEngine,
    SamplingParams,
    TierConfig,
)
from kvstore.errors import RequestTooLargeError  # noqa: E402
from kvstore.kernels._triton import HAS_TRITON  # noqa: E402
from kvstore.models.hf import HFCausalLM  # noqa: E402
from kvstore.models.presets import build_preset  # noqa: E402
from kvstore.request import Request  # noqa: E402


@pytest.fixture(scope="module")
def llama() -> HFCausalLM:
    return build_preset("llama")


def snapshot(engine: LLMEngine) -> tuple:
    s = engine.scheduler
    return ([r.request_id for r in s.waiting], [r.request_id for r in s.running],
            engine.manager.num_free_blocks, sorted(engine._groups), sorted(engine._samples),
            dict(s.num_samples), dict(s.finished))


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"seed": 1.5}, TypeError, "seed must be an int"),
    ({"seed": -1}, ValueError, "seed must be >= 0"),
    ({"seed": 2**70}, ValueError, "seed must be < 2\\*\\*63"),
    ({"stop_token_ids": (1.7,)}, TypeError, "stop_token_ids\\[0\\] must be an int"),
    ({"stop_token_ids": "12"}, TypeError, "stop_token_ids must be a sequence"),
    ({"stop_token_ids": 5}, TypeError, "stop_token_ids must be a sequence"),
    ({"stop_token_ids": (-1,)}, ValueError, "stop_token_ids must be in"),
    ({"temperature": math.inf}, ValueError, "temperature must be finite"),
    ({"temperature": True}, TypeError, "temperature must be a float"),
    ({"max_tokens": True}, TypeError, "max_tokens must be an int"),
    ({"n": True}, TypeError, "n must be an int"),
    ({"return_logits": "no"}, TypeError, "return_logits must be a bool"),
])
def test_bad_sampling_params_are_refused_when_made(kw, error, match) -> None:
    with pytest.raises(error, match=match):
        SamplingParams(**{"max_tokens": 3, **kw})


def test_sampling_counts_follow_as_count() -> None:
    sp = SamplingParams(max_tokens=np.int64(3), n=np.int32(2), seed=np.uint8(7),
                        stop_token_ids=np.array([4, 5]))
    assert (sp.max_tokens, sp.n, sp.seed, sp.stop_token_ids) == (3, 2, 7, (4, 5))
    assert type(sp.max_tokens) is int and type(sp.seed) is int


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: EngineConfig(num_blocks=-3), ValueError, "EngineConfig.num_blocks must be >= 2"),
    (lambda: EngineConfig(num_blocks="8"), TypeError, "EngineConfig.num_blocks must be an int"),
    (lambda: EngineConfig(memory_bytes=-10), ValueError, "EngineConfig.memory_bytes must be"),
    (lambda: EngineConfig(num_blocks=8, typical_tokens=-1), ValueError,
     "EngineConfig.typical_tokens must be"),
    (lambda: EngineConfig(), ValueError, "exactly one of num_blocks and memory_bytes"),
    (lambda: EngineConfig(num_blocks=8, memory_bytes=1 << 20), ValueError, "exactly one of"),
    (lambda: TierConfig(host_tier_bytes=-5), ValueError, "TierConfig.host_tier_bytes must be"),
    (lambda: TierConfig(host_tier_bytes=1.5), TypeError, "TierConfig.host_tier_bytes must be"),
    (lambda: TierConfig(host_tier_bytes=1 << 20, window_offload="bogus"), ValueError,
     "TierConfig.window_offload must be one of"),
    (lambda: TierConfig(store_url="valkey://h", store_timeout_s=math.nan), ValueError,
     "TierConfig.store_timeout_s must be a positive finite number"),
    (lambda: TierConfig(store_url="valkey://h", store_timeout_s="1"), TypeError,
     "TierConfig.store_timeout_s must be a number"),
])
def test_a_bad_engine_config_names_its_field(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()


def test_engine_config_counts_follow_as_count() -> None:
    config = EngineConfig(num_blocks=np.int64(8), max_num_seqs=np.int32(4))
    assert type(config.num_blocks) is int and type(config.max_num_seqs) is int


def test_the_engine_needs_a_sized_config(llama: HFCausalLM) -> None:
    with pytest.raises(TypeError, match="config"):
        LLMEngine(llama)  # type: ignore[call-arg]


def test_a_cache_off_the_models_device_is_refused(llama: HFCausalLM) -> None:
    with pytest.raises(ValueError, match="not the model's"):
        LLMEngine(llama, EngineConfig(num_blocks=16, block_size=4), device="meta")


def test_triton_off_cuda_without_the_interpreter_is_refused(
        llama: HFCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    monkeypatch.setattr(runner_module, "is_interpreted", lambda kernel: False, raising=False)
    device = next(llama.parameters()).device
    assert device.type != "cuda"  # the presets are built on CPU
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLMEngine(llama, EngineConfig(num_blocks=16, block_size=4, attention_backend="triton"))


def test_auto_ids_skip_taken_ones_and_failed_adds_use_none(llama: HFCausalLM) -> None:
    engine = LLMEngine(llama, EngineConfig(num_blocks=64, block_size=4))
    sp = SamplingParams(max_tokens=2)
    assert engine.add_request([1, 2, 3], sp, request_id="req-1") == "req-1"
    with pytest.raises(RequestTooLargeError):  # within the model's 512 positions, not the pool
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=400))
    assert [engine.add_request([1, 2, 3], sp) for _ in range(2)] == ["req-0", "req-2"]


def test_a_request_longer_than_the_model_positions_is_refused_up_front(llama: HFCausalLM) -> None:
    """It was queued and ran past max_position_embeddings (512 in the tiny preset)."""
    limit = llama.config.max_positions
    assert limit == 512
    engine = LLMEngine(llama, EngineConfig(num_blocks=1024, block_size=4))
    before = snapshot(engine)
    with pytest.raises(ValueError, match="exceed the model's 512 positions"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=limit - 2))
    with pytest.raises(ValueError, match="exceed the model's 512 positions"):
        engine.generate([[1, 2], list(range(1, 500))], SamplingParams(max_tokens=20))
    assert snapshot(engine) == before
    assert engine.add_request([1, 2, 3], SamplingParams(max_tokens=limit - 3)) == "req-0"


def test_generate_queues_nothing_when_a_prompt_is_bad(llama: HFCausalLM) -> None:
    engine = LLMEngine(llama, EngineConfig(num_blocks=64, block_size=4))
    before = snapshot(engine)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([[1, 2], [3, 10**6]], SamplingParams(max_tokens=2))
    assert snapshot(engine) == before
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate([[1, 2], [3]], [SamplingParams(max_tokens=2), {"seed": 1}])
    assert snapshot(engine) == before
    (out,) = engine.generate([[5, 6]], SamplingParams(max_tokens=2))
    assert out.request_id == "req-0"


def test_abort_reaches_a_preempted_sample(llama: HFCausalLM) -> None:
    engine = LLMEngine(llama, EngineConfig(num_blocks=20, block_size=4,
                                           max_num_batched_tokens=16))
    for seed in (1, 2):
        engine.add_request(tokens(10, seed), SamplingParams(max_tokens=16, n=2))
    for _ in range(60):  # until a forked sample is preempted back to the waiting queue
        engine.step()
        waiting = [r.request_id for r in engine.scheduler.waiting if "#" in r.request_id]
        if waiting:
            break
    assert waiting, "no forked sample was preempted"
    victim = waiting[0].split("#")[0]
    assert engine.abort_request(victim) is True
    s = engine.scheduler
    live = [r.request_id for r in [*s.waiting, *s.running]]
    assert not any(rid.split("#")[0] == victim for rid in live)
    assert s.finished[waiting[0]] == "abort" and waiting[0] not in engine._samples
    # The id is free again, with forks of its own.
    engine.add_request(tokens(6, 3), SamplingParams(max_tokens=4, n=2), request_id=victim)
    outs = {}
    while engine.has_unfinished_requests:
        outs.update((o.request_id, o) for o in engine.step())
    assert victim in outs and len(outs[victim].outputs) == 2
    assert engine.manager.usage == 0.0 and not engine._samples


def step_with_a_failing_forward(engine: LLMEngine, model: HFCausalLM,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """One engine step whose model forward raises; the error reaches the caller."""
    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("the forward failed")

    with monkeypatch.context() as patch:
        patch.setattr(model, "forward", broken)
        with pytest.raises(RuntimeError, match="the forward failed"):
            engine.step()


def test_a_step_that_raises_ends_its_requests(llama: HFCausalLM,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(llama, EngineConfig(num_blocks=64, block_size=4))
    a = engine.add_request(tokens(9, 1), SamplingParams(max_tokens=4, n=2))
    engine.step()  # a prefills and forks
    b = engine.add_request(tokens(5, 2), SamplingParams(max_tokens=4))
    step_with_a_failing_forward(engine, llama, monkeypatch)
    assert not engine.has_unfinished_requests and not engine._groups and not engine._samples
    assert {engine.scheduler.finished[r] for r in (a, a + "#1", b)} == {"error"}
    assert engine.manager.usage == 0.0
    (out,) = engine.generate([tokens(5, 2)], SamplingParams(max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4


def test_a_step_that_raises_with_a_hit_in_flight_caches_nothing_of_it(
        llama: HFCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prompts sharing a prefix in one step that raises: the second was admitted on the
    pages the first's step was to compute; both end, and none of those pages stays indexed."""
    engine = LLMEngine(llama, EngineConfig(num_blocks=64, block_size=4))
    prefix = tokens(12, 5)
    first = engine.add_request(prefix + [1, 2], SamplingParams(max_tokens=3))
    second = engine.add_request(prefix + [3], SamplingParams(max_tokens=3))
    step_with_a_failing_forward(engine, llama, monkeypatch)
    assert engine.stats.hit_tokens == 12  # the second hit the first's pages in flight
    assert {engine.scheduler.finished[r] for r in (first, second)} == {"error"}
    assert engine.manager.usage == 0.0
    probe = engine.manager.get_computed_blocks(Request("probe", prefix + [9]))
    assert probe.num_computed_tokens == 0, "pages never written stayed indexed"
    (out,) = engine.generate([prefix + [3]], SamplingParams(max_tokens=3))
    assert len(out.outputs[0].token_ids) == 3


def test_learned_positions_past_their_table_are_refused_before_queueing() -> None:
    """A prompt running past gpt2's position table failed mid-step (IndexError)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                                  n_positions=16, bos_token_id=None, eos_token_id=None)
    engine = LLMEngine(HFCausalLM(AutoModelForCausalLM.from_config(config).eval()),
                       EngineConfig(num_blocks=32, block_size=4))
    with pytest.raises(ValueError, match="12 prompt \\+ 8 output tokens exceed the model's 16"):
        engine.generate([tokens(12, 1, 64), tokens(3, 2, 64)], SamplingParams(max_tokens=8))
    assert not engine.has_unfinished_requests and engine.manager.usage == 0.0
    (out,) = engine.generate([tokens(5, 2, 64)], SamplingParams(max_tokens=2))
    assert len(out.outputs[0].token_ids) == 2
