"""The continuous-batching scheduler over the real manager: budgets, admission, preemption."""

from __future__ import annotations

import pytest
import torch
from invariants import check_manager

from kvstore import FullAttentionSpec, KVCacheManager, Request, make_kv_cache_config
from kvstore.engine.scheduler import Scheduler, SchedulerConfig

BS = 4


def make(num_blocks: int, **kw: int) -> Scheduler:
    spec = FullAttentionSpec(BS, 1, 8, torch.float32)
    manager = KVCacheManager(make_kv_cache_config([spec], num_blocks=num_blocks))
    return Scheduler(manager, SchedulerConfig(**kw))


def run_step(s: Scheduler, token: int = 7) -> list[tuple[str, int]]:
    out = s.schedule()
    check_manager(s.manager)
    sampled = {x.request.request_id: [token] * s.num_samples.get(x.request.request_id, 1)
               for x in out.scheduled if x.samples}
    s.update(out, sampled)
    return [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]


def test_chunked_prefill_respects_the_token_budget() -> None:
    s = make(64, max_num_batched_tokens=6)
    s.add_request(Request("a", list(range(10)), max_tokens=2))
    s.add_request(Request("b", list(range(100, 103)), max_tokens=1))
    assert run_step(s) == [("a", 6)]
    assert run_step(s) == [("a", 4), ("b", 2)]  # a finishes its prompt, b starts
    assert run_step(s) == [("a", 1), ("b", 1)]  # a decodes, b finishes its prompt
    assert s.finished == {"a": "length", "b": "length"}  # a sampled twice: done


def test_newest_running_request_is_preempted_first_and_recomputed() -> None:
    s = make(5, max_num_batched_tokens=64)  # 4 usable blocks
    s.add_request(Request("old", list(range(7)), max_tokens=6))
    s.add_request(Request("new", list(range(50, 57)), max_tokens=6))
    run_step(s)  # both admitted: 2 + 2 blocks
    steps = 0
    while "old" not in s.finished:
        run_step(s)
        steps += 1
        assert steps < 50
    assert s.stats.preemptions >= 1
    assert s.stats.discarded_tokens > 0
    while s.has_unfinished:
        run_step(s)
    assert s.finished == {"old": "length", "new": "length"}
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks


def test_forks_take_their_seats_at_admission() -> None:
    s = make(64, max_num_seqs=3)
    s.add_request(Request("a", list(range(5)), max_tokens=2), n=3)
    s.add_request(Request("b", list(range(9, 14)), max_tokens=2))
    assert run_step(s) == [("a", 5)]  # b waits: a's three samples fill max_num_seqs
    assert len(s.running) == 3
    assert {r.request_id for r in s.running} == {"a", "a#1", "a#2"}
    assert all(r.token_ids == list(range(5)) + [7] for r in s.running)


def test_bad_requests_are_rejected_up_front() -> None:
    s = make(5, max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        s.add_request(Request("a", [1, 2], max_tokens=1), n=3)
    with pytest.raises(ValueError, match="at least one token"):
        s.add_request(Request("b", [1, 2], max_tokens=0))
    with pytest.raises(ValueError, match="blocks"):
        s.add_request(Request("c", list(range(20)), max_tokens=1))  # 6 blocks > 4
    with pytest.raises(ValueError, match="must not contain '#'"):
        s.add_request(Request("d#1", [1, 2], max_tokens=1))
    assert not s.has_unfinished


def test_update_returns_the_forks_it_made_in_sample_order() -> None:
    s = make(64)
    s.add_request(Request("a", list(range(5)), max_tokens=3), n=3)
    s.add_request(Request("b", list(range(9, 14)), max_tokens=1))
    out = s.schedule()
    result = s.update(out, {"a": [10, 11, 12], "b": [20]})
    assert [r.request_id for r in result.finished] == ["b"]
    [fork] = result.forks
    assert fork.parent.request_id == "a"
    # Sample k got the k-th sampled token; the children are the scheduler's running requests.
    assert [c.token_ids[-1] for c in (fork.parent, *fork.children)] == [10, 11, 12]
    assert all(any(c is r for r in s.running) for c in fork.children)
    # A later step forks nothing.
    out = s.schedule()
    assert s.update(out, {r.request.request_id: [1] for r in out.scheduled}).forks == []


def test_abort_removes_waiting_and_running_requests_and_their_forks() -> None:
    s = make(7, max_num_batched_tokens=64)  # 6 usable blocks
    s.add_request(Request("a", list(range(5)), max_tokens=4), n=2)
    s.add_request(Request("b", list(range(20, 37)), max_tokens=2))  # 5 blocks: waits
    run_step(s)  # a prefills and forks into a and a#1; b does not fit and is looked up
    assert {r.request_id for r in s.running} == {"a", "a#1"}
    assert [r.request_id for r in s.waiting] == ["b"]
    assert [r.request_id for r in s.abort("a")] == ["a", "a#1"]
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks
    assert [r.request_id for r in s.abort("b")] == ["b"]
    assert s.abort("b") == [] and s.abort("zzz") == []
    assert not s.has_unfinished
    assert s.finished == {"a": "abort", "a#1": "abort", "b": "abort"}
    assert s.stats.finish_reasons == {"abort": 3} and s.stats.finished == 3
    check_manager(s.manager)


def test_abort_releases_the_host_slots_a_waiting_lookup_holds() -> None:
    from kvstore.benchmarks.tier_model import PlaceholderConnector
    from kvstore.tiers import HostTier

    config = make_kv_cache_config([FullAttentionSpec(BS, 1, 8, torch.float32)], num_blocks=7)
    host = HostTier(8 * 128, slot_nbytes=128, pin=False)
    tiers = PlaceholderConnector(config, "m", host=host)
    s = Scheduler(KVCacheManager(config), SchedulerConfig(), tiers)
    prefix = list(range(100, 108))
    s.add_request(Request("a", prefix + [1], max_tokens=1))
    run_step(s)
    tiers.run_offloads(None, tiers.take_offloads())  # a's 2 full blocks reach the host tier
    assert s.manager.reset_prefix_cache() and len(host) == 2
    s.add_request(Request("big", list(range(40, 60)), max_tokens=4))  # 6 blocks: runs alone
    s.add_request(Request("b", prefix + [2], max_tokens=1))
    run_step(s)  # big is admitted; b is looked up (a host hit of 2 blocks) and waits
    assert [r.request_id for r in s.waiting] == ["b"] and sum(host._held.values()) == 2
    assert [r.request_id for r in s.abort("b")] == ["b"]
    assert not host._held
