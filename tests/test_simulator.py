"""The cost-free simulator's accounting over the real scheduler and cache manager."""

from __future__ import annotations

import math

import pytest

from kvstore.benchmarks.simulator import SimResult, simulate
from kvstore.benchmarks.sweep import MODEL_SHAPES, POLICIES, run_point
from kvstore.benchmarks.workloads import (
    RequestSpec,
    ideal_hit_tokens,
    mixed_default,
    multi_turn_chat,
    unique_prompts,
)
from kvstore.engine.scheduler import SchedulerConfig
from kvstore.specs import FullAttentionSpec, make_kv_cache_config

TINY = MODEL_SHAPES["tiny"]
BS = 16


@pytest.fixture(scope="module")
def workload():
    """A small mix: shared system prompts, chats, few-shot and unique prompts."""
    return mixed_default(seed=3, num_requests=24)


def _need(w) -> list[int]:
    return [-(-(len(r.prompt_token_ids) + r.max_tokens) // BS) for r in w.requests]


def _config(w, layout: str = "full", blocks: int | None = None, memory: int | None = None):
    specs = TINY.hybrid_specs(BS) if layout == "hybrid" else TINY.full_specs(BS)
    if memory is not None:
        return make_kv_cache_config(specs, memory_bytes=memory)
    # Unbounded: every page of every request at once, in every group.
    groups = len(make_kv_cache_config(specs, num_blocks=2).groups)
    return make_kv_cache_config(specs, num_blocks=blocks if blocks else sum(_need(w)) * groups + 1)


def _run(w, policy: str, **kw) -> SimResult:
    p = POLICIES[policy]
    return simulate(w, _config(w, p.layout, **kw), enable_caching=p.enable_caching,
                    enable_partial_hits=p.enable_partial_hits,
                    scheduler_config=SchedulerConfig(reserve_full_output=p.reserve_full_output))


def _identity_holds(r: SimResult) -> bool:
    return r.computed_tokens + r.hit_tokens == r.expected_tokens + r.discarded_tokens


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("pressure", [False, True])
def test_token_accounting_identity(workload, policy, pressure):
    """computed + hit == sum(prompt + max_tokens - 1) + discarded, with and without
    preemptions, for every policy; and nothing leaks."""
    blocks = max(_need(workload)) + 3 if pressure else None
    memory = blocks * TINY.block_bytes(BS) if blocks else None
    r = _run(workload, policy, memory=memory) if memory else _run(workload, policy)
    expected = sum(len(s.prompt_token_ids) + s.max_tokens - 1 for s in workload.requests)
    assert r.expected_tokens == expected
    assert _identity_holds(r)
    assert r.leaked_blocks == 0 and r.free_blocks_at_end == r.usable_blocks
    if pressure and policy == "paged":
        assert r.preemptions > 0  # the pressured case does exercise preemption
    if not pressure:
        assert r.preemptions == 0 and r.evictions == 0


def test_pool_empty_after_partial_hit_on_last_step():
    """The last request finishes in the step it was admitted with a partial hit: the copy
    source's pin must be released before the leak check."""
    config = make_kv_cache_config([FullAttentionSpec(4, 1, 8)], num_blocks=20)
    reqs = [RequestSpec("a", 0.0, tuple(range(10)), 2),
            RequestSpec("b", 1.0, tuple(range(9)) + (99,), 1)]
    r = simulate(reqs, config)
    assert r.partial_hits == 1 and r.copies == 1
    assert r.leaked_blocks == 0
    assert _identity_holds(r)


def test_naive_never_preempts_when_everything_fits_and_idles_more(workload):
    naive, paged = _run(workload, "naive"), _run(workload, "paged")
    assert naive.preemptions == 0 and paged.preemptions == 0
    assert naive.idle_slot_steps > paged.idle_slot_steps
    assert naive.mean_idle_bytes > paged.mean_idle_bytes
    # Paged pages never run more than a block ahead of what a request holds.
    assert paged.peak_idle_slots < BS * len(workload.requests)
    assert naive.peak_blocks >= paged.peak_blocks


def test_naive_slower_than_paged_under_pressure():
    """Everything arrives at once with heavy-tailed outputs and room for about three
    requests: reserving every request's max output admits fewer at a time."""
    w = unique_prompts(40, prompt_len=(50, 200), rate=math.inf, output_median=60,
                       output_max=400, seed=2)
    memory = (max(_need(w)) + 1) * 3 * TINY.block_bytes(BS)
    naive = _run(w, "naive", memory=memory)
    paged = _run(w, "paged", memory=memory)
    assert naive.preemptions == 0
    assert naive.steps > paged.steps
    assert naive.mean_idle_bytes > paged.mean_idle_bytes


def test_caching_keeps_the_computed_plus_hit_total(workload):
    off, on = _run(workload, "paged"), _run(workload, "partial")
    assert on.hit_tokens > 0 and off.hit_tokens == 0
    assert on.computed_tokens + on.hit_tokens == off.computed_tokens + off.hit_tokens
    assert on.computed_tokens < off.computed_tokens


def test_first_admission_hits_bounded_by_ideal(workload):
    ideal_tok = ideal_hit_tokens(workload.requests, include_outputs=True)
    ideal_blk = ideal_hit_tokens(workload.requests, BS, include_outputs=True)
    full, part = _run(workload, "prefix"), _run(workload, "partial")
    assert 0 < full.prompt_hit_tokens <= ideal_blk.total
    assert full.prompt_hit_tokens <= part.prompt_hit_tokens <= ideal_tok.total
    # Without pressure every admission is a first admission.
    assert part.prompt_hit_tokens == part.hit_tokens


def test_hybrid_holds_fewer_peak_bytes_than_all_full():
    """Long chats against a 64-token window: the 5 sliding : 1 full layout holds fewer
    KV bytes at its peak than all-full layers, from the same byte budget."""
    w = multi_turn_chat(6, 3, user_len=(100, 300), output_median=60, seed=1)
    budget = (sum(_need(w)) + 1) * TINY.block_bytes(BS)
    full = run_point(w, POLICIES["partial"], TINY, BS, budget)
    hyb = run_point(w, POLICIES["hybrid"], TINY, BS, budget)
    assert full.feasible and hyb.feasible
    assert full.metrics is not None and hyb.metrics is not None
    assert hyb.metrics.peak_kv_bytes < full.metrics.peak_kv_bytes
    assert hyb.num_groups == 6 and hyb.padding_layers == 0


def test_kv_bytes_follow_the_page_size_formula(workload):
    r = _run(workload, "paged", blocks=200)
    per_block = 2 * BS * TINY.num_kv_heads * TINY.head_dim * 2 * TINY.num_layers
    assert r.bytes_per_block == per_block
    assert r.kv_bytes == 200 * per_block
    assert r.peak_kv_bytes == r.peak_blocks * per_block


def test_on_step_sees_every_step():
    w = mixed_default(seed=1, num_requests=6)
    seen = []
    config = make_kv_cache_config(TINY.full_specs(BS), num_blocks=400)
    r = simulate(w, config, on_step=lambda s, o: seen.append(o.num_tokens))
    assert len(seen) == r.steps and sum(seen) == r.computed_tokens


def test_request_that_never_fits_is_rejected():
    config = make_kv_cache_config([FullAttentionSpec(4, 1, 8)], num_blocks=3)
    with pytest.raises(ValueError):
        simulate([RequestSpec("x", 0.0, tuple(range(20)), 4)], config)
