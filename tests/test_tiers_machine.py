"""A state machine over a hybrid KVCacheManager with a TierConnector over a real host tier beside
it: lookups that are
admitted, looked up again or dropped, requests that grow (alone, letting go of held
windows), are preempted or finish, and device caches reset so hits come from the host tier.
Invariants: the pool's (every page and reference accounted for) and the host tier's holds,
which are exactly those of the hits looked up and not yet admitted or dropped."""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from invariants import EventMirror, check_host_tier, check_manager

from kvstore.benchmarks.tier_model import PlaceholderConnector
from kvstore.errors import RequestTooLargeError
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import BlockIds, CacheConfig, KVCacheManager
from kvstore.request import Request
from kvstore.specs import FullAttentionSpec, SlidingWindowSpec, make_kv_cache_config
from kvstore.tiers import HostTier

BS = 4
PREFIXES = [list(range(100, 112)), list(range(200, 209)), list(range(100, 106)) + [7, 7, 7]]


class TieredManagerMachine(RuleBasedStateMachine):
    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        specs = [SlidingWindowSpec(BS, 1, 8, "float16", window=8),
                 FullAttentionSpec(BS, 1, 8, "float16")]
        config = make_kv_cache_config(specs, num_blocks=16)  # 15 pages
        self.host = HostTier(12 * 256, slot_nbytes=256, pin=False)  # 12 values
        self.tiers = PlaceholderConnector(config, "m", host=self.host)
        self.manager = KVCacheManager(config, CacheConfig(eviction=self.eviction, enable_events=True))
        self.events = EventMirror()
        self.tiers.attach(self.manager)
        # request id -> (request, its device hit, the tokens the tiers add to it)
        self.waiting: dict[str, tuple[Request, ComputedBlocks, int]] = {}
        self.running: dict[str, Request] = {}
        self.n = 0

    def _worker(self) -> None:
        """The worker's part of a step: offloads, loads, then the loads' holds released;
        the copies (taking them releases the previous batch's source pins)."""
        self.tiers.take_transfers().run(None)
        self.manager.take_pending_copies()

    # ---- rules ---------------------------------------------------------------------------
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), suffix=st.lists(st.integers(0, 50), max_size=9),
          max_tokens=st.integers(1, 20))
    def look_up(self, prefix: int, suffix: list[int], max_tokens: int) -> None:
        rid = f"r{self.n}"
        self.n += 1
        request = Request(rid, PREFIXES[prefix] + suffix, max_tokens=max_tokens)
        computed, external = self._look_up(request)
        assert self._hit(computed, external) <= request.num_tokens - 1
        if rid in self.tiers.hits:
            event("a hit from the host tier")
        self.waiting[rid] = (request, computed, external)

    def _look_up(self, request: Request) -> tuple[ComputedBlocks, int]:
        computed = self.manager.get_computed_blocks(request)
        return computed, self.tiers.lookup(request, computed)

    @staticmethod
    def _hit(computed: ComputedBlocks, external: int) -> int:
        return computed.num_full_hit_tokens + external if external else computed.num_computed_tokens

    def _admit(self, request: Request, computed: ComputedBlocks, external: int) -> BlockIds | None:
        """As the scheduler admits: a hit larger than the pool at once falls back to the
        device hit; the connector is told what was admitted."""
        num_new = request.num_tokens - self._hit(computed, external)
        try:
            ids = self.manager.admit(request, num_new, computed, num_external_tokens=external)
        except RequestTooLargeError:
            if not external:
                raise
            event("a tier hit too large for the pool at once")
            self.tiers.drop_oversized(request)
            external = 0
            ids = self.manager.admit(request, num_new, computed)
        if ids is not None:
            self.tiers.admitted(request, computed, external)
        return ids

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def look_up_again(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        request = self.waiting[rid][0]
        self.waiting[rid] = (request, *self._look_up(request))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        request, computed, external = self.waiting[rid]
        try:
            ids = self._admit(request, computed, external)
        except ValueError as e:  # evicted or reset since the lookup: refused, nothing changed
            assert "stale" in str(e)
            check_manager(self.manager)
            computed, external = self._look_up(request)
            self.waiting[rid] = (request, computed, external)
            ids = self._admit(request, computed, external)
        if ids is None:
            return  # stays waiting, its hit (and holds) recorded for a retry
        del self.waiting[rid]
        self._worker()
        # The step computes the tokens scheduled from where the admission put the request
        # (the full-block part of its hit when the partial block's copy did not fit).
        scheduled = request.num_tokens - self._hit(computed, external)
        request.num_computed_tokens = min(request.num_tokens,
                                          request.num_computed_tokens + scheduled)
        self.running[rid] = request

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        request = self.waiting.pop(rid)[0]
        assert self.manager.drop_lookup(request) is False
        if self.tiers.drop_lookup(request):
            event("a lookup holding host slots dropped")
        with pytest.raises(ValueError, match="never admitted"):
            self.manager.free(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 50), steps=st.integers(1, 20))
    def decode(self, data: st.DataObject, token: int, steps: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        for _ in range(steps):
            if rid not in self.running:
                return
            self.decode_step(rid, token)

    def decode_step(self, rid: str, token: int) -> None:
        request = self.running[rid]
        if request.num_output_tokens >= request.max_tokens:
            self.finish(rid)
            return
        request.append_token_ids(token)
        ids = self.manager.grow(request, 1)
        if ids is None:
            self.finish(rid)  # preempted: its computed content stays cached, then offloaded
            return
        self._worker()
        request.num_computed_tokens += 1

    def finish(self, rid: str) -> None:
        self.manager.free(self.running.pop(rid))
        self._worker()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.finish(data.draw(st.sampled_from(sorted(self.running))))

    @rule()
    def reset_device_cache(self) -> None:
        if self.manager.reset_prefix_cache():  # only when no page is in use
            assert not self.running

    # ---- invariants ----------------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self) -> None:
        check_manager(self.manager)
        self.events.check(self.manager)

    @invariant()
    def host_holds_are_the_outstanding_hits(self) -> None:
        check_host_tier(self.host)
        outstanding = sum(len(hit.held) for hit in self.tiers.hits.values())
        assert sum(self.host._held.values()) == outstanding
        assert set(self.tiers.hits) <= set(self.waiting)

    def teardown(self) -> None:
        for rid in sorted(self.running):
            self.finish(rid)
        for request, _, _ in self.waiting.values():
            self.manager.drop_lookup(request)
            self.tiers.drop_lookup(request)
        self.manager.take_pending_copies()  # the last batch ran: its pins go
        assert not self.host._held
        assert self.manager.num_free_blocks == self.manager.num_usable_blocks


class WindowPolicyMachine(TieredManagerMachine):
    eviction = "window"


TestTieredManagerMachine = TieredManagerMachine.TestCase
TestWindowPolicyMachine = WindowPolicyMachine.TestCase
for case in (TestTieredManagerMachine, TestWindowPolicyMachine):
    case.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
