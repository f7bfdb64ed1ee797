"""Handles the manager hands out are bound to it: a lookup is admitted only by the manager
that made it, for the request object it was made for, as that request's latest lookup; an
eviction policy object orders one pool; a fork made between its parent's scheduling and
its step can be freed in any order without dropping another request's computed blocks,
and no request writes a page holding content it did not index."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from invariants import check_manager

from kvstore import CacheConfig, FullAttentionSpec, KVCacheManager, Request, make_kv_cache_config
from kvstore.eviction import EVICTION_POLICIES, make_policy
from kvstore.specs import KVCacheSpec, SlidingWindowSpec

BS = 4


def layout(windows: Sequence[int | None]) -> list[KVCacheSpec]:
    return [FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=1) if w is None else
            SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_dim=1, window=w)
            for w in windows]


def make(num_blocks: int = 20, windows: Sequence[int | None] = (None,),
         **options: Any) -> KVCacheManager:
    return KVCacheManager(make_kv_cache_config(layout(windows), num_blocks=num_blocks),
                          CacheConfig(**options))


def run(m: KVCacheManager, r: Request) -> None:
    """Admit r on its hit, compute its prompt, free it."""
    computed = m.get_computed_blocks(r)
    assert m.admit(r, r.num_tokens - computed.num_computed_tokens, computed) is not None
    m.take_pending_copies()
    r.num_computed_tokens = r.num_tokens
    m.free(r)


def test_a_lookup_of_another_manager_is_refused_and_changes_nothing() -> None:
    cfg = make_kv_cache_config(layout([None]), num_blocks=20)
    m1, m2 = KVCacheManager(cfg), KVCacheManager(cfg)
    run(m1, Request("A", list(range(1, 11))))
    x = Request("X", [99] * 10, cache_salt="tenant-x")
    assert m2.admit(x, 10, m2.get_computed_blocks(x)) is not None
    b = Request("B", list(range(1, 10)) + [40, 41])
    foreign = m1.get_computed_blocks(b)
    assert foreign.num_computed_tokens == 9
    states1, states2 = m1.block_states(), m2.block_states()
    with pytest.raises(ValueError, match="not looked up by this manager"):
        m2.admit(b, 2, foreign)
    assert m1.block_states() == states1 and m2.block_states() == states2
    assert m2.take_pending_copies() == [] and "B" not in m2.requests
    check_manager(m1)
    check_manager(m2)
    # Its own lookup finds nothing of tenant-x's for B.
    assert m2.get_computed_blocks(b).num_computed_tokens == 0


def test_a_lookup_of_another_request_object_under_the_same_id_is_refused() -> None:
    m = make()
    run(m, Request("A", list(range(1, 11))))
    looked_up = m.get_computed_blocks(Request("E", list(range(1, 10)) + [40]))
    assert looked_up.num_computed_tokens == 9
    impostor = Request("E", [77] * 10)
    before = m.block_states()
    with pytest.raises(ValueError, match="another request object"):
        m.admit(impostor, 1, looked_up)
    assert m.block_states() == before and impostor.num_computed_tokens == 0
    assert "E" not in m.requests
    check_manager(m)


def test_a_lookup_is_refused_once_admitted_dropped_or_superseded() -> None:
    m = make()
    run(m, Request("A", list(range(1, 11))))
    r = Request("R", list(range(1, 10)) + [50, 51])
    first = m.get_computed_blocks(r)
    latest = m.get_computed_blocks(r)
    with pytest.raises(ValueError, match="latest lookup"):
        m.admit(r, 2, first)
    m.drop_lookup(r)
    with pytest.raises(ValueError, match="another request object"):
        m.admit(r, 2, latest)
    computed = m.get_computed_blocks(r)
    assert m.admit(r, r.num_tokens - computed.num_computed_tokens, computed) is not None
    m.take_pending_copies()
    r.num_computed_tokens = r.num_tokens
    m.free(r)
    with pytest.raises(ValueError, match="another request object"):
        m.admit(r, 2, computed)  # freed: the lookup it was admitted on is spent
    check_manager(m)


def test_a_lookup_that_did_not_fit_can_be_retried() -> None:
    m = make(num_blocks=6)  # 5 usable pages
    hog = Request("hog", list(range(100, 112)))
    assert m.admit(hog, 12, m.get_computed_blocks(hog)) is not None
    r = Request("R", list(range(1, 13)))
    computed = m.get_computed_blocks(r)
    assert m.admit(r, 12, computed) is None
    hog.num_computed_tokens = 12
    m.free(hog)
    assert m.admit(r, 12, computed) is not None
    check_manager(m)


@pytest.mark.parametrize("partial", [True, False])
def test_a_request_given_a_salt_after_its_lookup_is_looked_up_under_the_new_salt(
        partial: bool) -> None:
    """A prompt shorter than a block may get its salt after a lookup (nothing is hashed):
    the next lookup is that of the salted prompt, never a reuse of the unsalted one."""
    m = make(enable_partial_hits=partial)
    run(m, Request("a", [7, 8, 9], cache_salt="a"))  # a partial block under tenant a
    waiting = Request("w", [7, 8, 9], cache_salt="a")
    assert m.get_computed_blocks(waiting).num_partial_tokens == (2 if partial else 0)
    waiting.cache_salt = "b"
    again = m.get_computed_blocks(waiting)
    fresh = Request("fresh", [7, 8, 9], cache_salt="b")
    expected = m.get_computed_blocks(fresh)
    m.drop_lookup(fresh)
    assert again.num_computed_tokens == expected.num_computed_tokens == 0
    assert again.parent_serials == expected.parent_serials
    assert m.admit(waiting, 3, again) is not None
    check_manager(m)


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_one_policy_object_orders_one_pool(name: str) -> None:
    policy = make_policy(name)
    with pytest.raises(ValueError, match="already orders another pool"):
        make(eviction=policy)
    fresh = type(policy)()
    m1 = make(num_blocks=6, eviction=fresh)
    with pytest.raises(ValueError, match="already orders another pool"):
        make(num_blocks=6, eviction=fresh)
    assert m1.num_free_blocks == 5
    check_manager(m1)


@pytest.mark.parametrize("free_parent_first", [False, True])
def test_a_fork_between_scheduling_and_step_frees_in_any_order(free_parent_first: bool) -> None:
    m = make(num_blocks=10)
    p = Request("P", list(range(1, 11)))
    assert m.admit(p, 10, m.get_computed_blocks(p)) is not None
    c = p.fork("C")
    m.fork(p, c)
    p.num_computed_tokens = 10  # the step computed P; C was not in it
    check_manager(m)
    for r in ((p, c) if free_parent_first else (c, p)):
        m.free(r)
        check_manager(m)
    # P's computed blocks stay findable whichever was freed first.
    assert m.get_computed_blocks(Request("Q", list(range(1, 11)))).num_full_hit_tokens == 8


def test_a_fork_does_not_write_the_pages_its_parent_cached() -> None:
    m = make(num_blocks=10)
    p = Request("P", list(range(1, 11)))
    assert m.admit(p, 10, m.get_computed_blocks(p)) is not None
    c = p.fork("C")
    m.fork(p, c)
    p.num_computed_tokens = 10
    m.free(p)
    parent_pages = set(m.block_table("C")[0][:2])
    assert m.grow(c, 10) is not None  # C computes its prompt itself
    assert not parent_pages & set(m.block_table("C")[0])
    c.num_computed_tokens = 10
    check_manager(m)
    m.free(c)
    check_manager(m)


class ForkAtEveryPoint(RuleBasedStateMachine):
    """Requests are scheduled (admitted or grown) and stepped; forks happen at any point,
    including between a parent's scheduling and its step; any request with nothing
    scheduled is freed. Every page a request reads through its table holds its own tokens,
    and no page holding indexed content is written."""

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.live: dict[str, Request] = {}
        self.scheduled: dict[str, int] = {}  # tokens scheduled for the next step
        self.pages: dict[tuple[int, int], dict[int, int]] = {}  # (group, page) -> slot -> token
        self.n = 0

    @initialize(windows=st.sampled_from([(None,), (None, 8)]), num_blocks=st.integers(12, 30))
    def setup(self, windows: tuple[int | None, ...], num_blocks: int) -> None:
        self.m = make(num_blocks=num_blocks, windows=windows)

    @property
    def manager(self) -> KVCacheManager:
        assert self.m is not None
        return self.m

    def _run_copies(self) -> None:
        """The worker's copies (their sources are pinned: running them now is the same)."""
        m = self.manager
        for src, dst in m.take_pending_copies():
            for g in range(len(m.config.groups)):
                self.pages[(g, dst)] = dict(self.pages.get((g, src), {}))

    def _scheduled(self, r: Request, end: int, indexed_before: set[int]) -> None:
        """Record r's tokens up to `end` as scheduled; none of the pages they go to may hold
        content indexed before it was scheduled (another request's)."""
        m = self.manager
        for table in m.block_table(r.request_id):
            for i in range(r.num_computed_tokens // BS, -(-end // BS)):
                assert table[i] not in indexed_before, (
                    f"{r.request_id} is to write page {table[i]}, which holds indexed content")
        self.scheduled[r.request_id] = end
        self._run_copies()

    def _indexed(self) -> set[int]:
        """Pages in use holding indexed content (a free one may be reused: a new page)."""
        return {s.block_id for s in self.manager.block_states()
                if s.block_hash is not None and s.ref_cnt > 0}

    def _new_id(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    @rule(prefix=st.integers(0, 2), tail=st.lists(st.integers(1, 3), min_size=1, max_size=9),
          chunk=st.integers(1, 20))
    def admit(self, prefix: int, tail: list[int], chunk: int) -> None:
        tokens = [100 + prefix] * 5 + tail
        r = Request(self._new_id("r"), tokens, max_tokens=3)
        m = self.manager
        computed = m.get_computed_blocks(r)
        n = min(chunk, r.num_tokens - computed.num_computed_tokens)
        before = self._indexed()
        if m.admit(r, n, computed) is None:
            m.drop_lookup(r)
            return
        self.live[r.request_id] = r
        self._scheduled(r, r.num_computed_tokens + n, before)

    @precondition(lambda self: any(self.scheduled[k] == self.live[k].num_computed_tokens
                                   for k in self.live))
    @rule(data=st.data(), chunk=st.integers(1, 20), token=st.integers(1, 3))
    def grow(self, data: st.DataObject, chunk: int, token: int) -> None:
        idle = sorted(k for k in self.live if self.scheduled[k] == self.live[k].num_computed_tokens)
        r = self.live[data.draw(st.sampled_from(idle))]
        if r.num_computed_tokens == r.num_tokens:
            if r.num_tokens - r.num_prompt_tokens >= 3:
                return
            r.append_token_ids(token)  # decode: the sampled token
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        before = self._indexed()
        if self.manager.grow(r, n) is not None:
            self._scheduled(r, r.num_computed_tokens + n, before)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = parent.fork(self._new_id("f"))
        self.manager.fork(parent, child)
        self.live[child.request_id] = child
        self.scheduled[child.request_id] = child.num_computed_tokens  # not in this step

    @rule()
    def step(self) -> None:
        m = self.manager
        self._run_copies()
        for rid, r in self.live.items():
            end = self.scheduled[rid]
            for g, table in enumerate(m.block_table(rid)):
                for pos in range(r.num_computed_tokens, end):
                    page = table[pos // BS]
                    assert page != 0, f"{rid} writes position {pos} into the null block"
                    self.pages.setdefault((g, page), {})[pos % BS] = r.token_ids[pos]
            r.num_computed_tokens = end
        self._check_content()

    @precondition(lambda self: any(self.scheduled[k] == self.live[k].num_computed_tokens
                                   for k in self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        idle = sorted(k for k in self.live if self.scheduled[k] == self.live[k].num_computed_tokens)
        rid = data.draw(st.sampled_from(idle))
        self.manager.free(self.live.pop(rid))
        del self.scheduled[rid]

    @invariant()
    def pool_is_consistent(self) -> None:
        if self.m is not None:
            check_manager(self.m)

    def _check_content(self) -> None:
        """After a step: every table reads its own tokens."""
        m = self.manager
        for rid, r in self.live.items():
            for g, table in enumerate(m.block_table(rid)):
                for pos in range(r.num_computed_tokens):
                    page = table[pos // BS]
                    if page == 0:
                        continue  # dropped from a window
                    got = self.pages.get((g, page), {}).get(pos % BS)
                    assert got == r.token_ids[pos], (
                        f"{rid} group {g} position {pos}: page {page} holds {got}, "
                        f"expected {r.token_ids[pos]}")


TestForkAtEveryPoint = ForkAtEveryPoint.TestCase
TestForkAtEveryPoint.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"enable_caching": 1}, TypeError, "enable_caching must be a bool"),
    ({"hold_window_pages": None}, TypeError, "hold_window_pages must be a bool"),
    ({"eviction": "nope"}, ValueError, "unknown eviction policy 'nope'"),
    ({"eviction": 3}, TypeError, "eviction must be a policy name"),
    ({"hash_fn": "xxh3"}, TypeError, "hash_fn must be callable"),
])
def test_a_bad_cache_config_is_refused_when_made(options: dict[str, Any], error: type,
                                                 match: str) -> None:
    with pytest.raises(error, match=match):
        CacheConfig(**options)


def test_the_manager_takes_a_cache_config_only() -> None:
    cfg = make_kv_cache_config(layout([None]), num_blocks=8)
    with pytest.raises(TypeError, match="cache_config must be a CacheConfig"):
        KVCacheManager(cfg, {"enable_caching": False})  # type: ignore[arg-type]
    m = KVCacheManager(cfg, CacheConfig(enable_caching=False))
    assert m.cache_config == CacheConfig(enable_caching=False) and not m.enable_caching


def test_a_copy_batch_runs_only_on_the_cache_of_its_manager() -> None:
    torch = pytest.importorskip("torch")
    from kvstore.paged_kv_cache import PagedKVCache

    cfg = make_kv_cache_config(layout([None]), num_blocks=20)
    m1, m2 = KVCacheManager(cfg), KVCacheManager(cfg)
    cache = PagedKVCache(cfg)
    cache.bind(m1)
    with pytest.raises(ValueError, match="already runs another manager"):
        cache.bind(m2)
    run(m2, Request("A", list(range(1, 11))))
    b = Request("B", list(range(1, 10)) + [40])
    computed = m2.get_computed_blocks(b)
    assert m2.admit(b, 1, computed) is not None
    batch = m2.take_pending_copies()
    assert batch.issuer is m2 and len(batch) == 1  # the partial block's copy
    before = [t.clone() for t in cache.key_caches]
    with pytest.raises(ValueError, match="another manager"):
        cache.copy_blocks(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.key_caches, strict=True))
    assert cache.copies_executed == 0
    cache.copy_blocks(m1.take_pending_copies())  # its own (empty) batch
    cache.copy_blocks([(1, 2)])  # hand-made pairs name no manager
    assert cache.copies_executed == 1
