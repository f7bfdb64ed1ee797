"""The host tier with slots of several sizes in one capacity: a state machine over two slot
sizes (stores, loads, holds, discards, eviction under pressure), checkpoints beside
attention blocks through the connector's sizing, and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from invariants import check_host_tier

from kvstore.hashing import root_hash
from kvstore.paged_kv_cache import PagedKVCache
from kvstore.specs import FullAttentionSpec, RecurrentStateSpec, make_kv_cache_config
from kvstore.tiers import BlockLayout, HostTier, block_keys, offload_items
from kvstore.tiers.connector import TierConnector

SMALL, LARGE = 100, 350  # a page of 350 bytes holds one large slot or three small ones
KEYS = [bytes([i]) * 32 for i in range(12)]


class TwoSizeHostMachine(RuleBasedStateMachine):
    """Values of two sizes in 4 pages (in chunks of 2); a model of what the tier holds,
    kept from what ``on_evict`` hands out, and of the views held."""

    def __init__(self) -> None:
        super().__init__()
        self.evicted: list[tuple[bytes, bytes]] = []
        self.tier = HostTier(4 * LARGE + 99, slot_nbytes=[LARGE, SMALL, SMALL], pin=False,
                             on_evict=self.evicted.extend)
        self.tier._per_chunk = 2
        self.model: dict[bytes, bytes] = {}
        self.holds: list[tuple[tuple[int, ...], list[tuple[memoryview, bytes]]]] = []
        self.version = 0

    def value(self, size: int) -> bytes:
        self.version += 1
        return bytes((self.version + i) % 256 for i in range(size))

    @rule(batch=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, LARGE + 1)),
                         min_size=1, max_size=4, unique_by=lambda item: item[0]))
    def store(self, batch: list[tuple[bytes, int]]) -> None:
        items = [(k, self.value(n)) for k, n in batch]
        old, new = dict(self.model), dict(items)
        dropped = self.tier.stats["dropped_stores"]
        self.tier.store(items)
        left: dict[bytes, list[bytes]] = {}
        for k, v in self.evicted:
            left.setdefault(k, []).append(v)
        if len(self.evicted) > len(items):
            event("a page of values evicted for one")
        self.evicted.clear()
        for k, copies in left.items():  # exactly what left, as it was: a key's old value
            # before its new one (stored later in the batch, evicted by a store after it)
            assert copies in ([old[k]] if k in old else [],
                              [old[k], new.get(k)] if k in old else [new.get(k)],
                              [new.get(k)]), k
            self.model.pop(k, None)
        lost = 0
        for k, v in items:
            if self.tier.peek([k]) == [v]:
                self.model[k] = v
            else:  # evicted by a later store of the batch, or dropped (the old value gone too)
                self.model.pop(k, None)
                lost += v not in left.get(k, [])[-1:]
        assert self.tier.stats["dropped_stores"] - dropped == lost
        if lost and self.holds:
            event("a store dropped while slots are held")
        assert all(self.tier.peek([k]) == [None] for k, n in batch if n > LARGE)  # no slot holds it

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def load(self, keys: list[bytes]) -> None:
        views = self.tier.load(keys)
        for k, v in zip(keys, views, strict=True):
            assert (None if v is None else bytes(v)) == self.model.get(k)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def hold(self, keys: list[bytes]) -> None:
        views = self.tier.load(keys)
        handle = self.tier.hold(keys)
        self.holds.append((handle, [(v, bytes(v)) for v in views if v is not None]))

    @precondition(lambda self: self.holds)
    @rule(i=st.integers(0, 7))
    def release(self, i: int) -> None:
        handle, _ = self.holds.pop(i % len(self.holds))
        self.tier.release(handle)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def discard(self, keys: list[bytes]) -> None:
        assert self.tier.discard(keys) == sum(k in self.model for k in keys)
        for k in keys:
            self.model.pop(k, None)

    @invariant()
    def arena_is_consistent(self) -> None:
        check_host_tier(self.tier)

    @invariant()
    def every_value_loads_back_and_held_views_keep_their_bytes(self) -> None:
        assert len(self.tier) == len(self.model)
        assert self.tier.peek(list(self.model)) == list(self.model.values())
        for _, views in self.holds:
            for view, was in views:
                assert bytes(view) == was


TestTwoSizeHostMachine = TwoSizeHostMachine.TestCase
TestTwoSizeHostMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_a_large_value_takes_a_whole_page_and_evicts_the_least_recent_page() -> None:
    evicted: list = []
    tier = HostTier(2 * LARGE, slot_nbytes=[SMALL, LARGE], pin=False, on_evict=evicted.extend)
    small = [(KEYS[i], bytes([i]) * 80) for i in range(6)]
    tier.store(small)  # two pages carved for three small slots each
    assert len(tier) == 6 and tier.arena_bytes == 2 * LARGE
    tier.load([KEYS[0]])  # the least recent is now 1, in the first page with 0 and 2
    tier.store([(KEYS[9], b"L" * 300)])
    assert [k for k, _ in evicted] == [KEYS[0], KEYS[1], KEYS[2]]
    assert tier.peek([KEYS[9]]) == [b"L" * 300] and len(tier) == 4
    # A small value reuses the slot of the least recent small one; none fits while all is held.
    evicted.clear()
    tier.store([(KEYS[10], b"s")])
    assert [k for k, _ in evicted] == [KEYS[3]]
    handle = tier.hold(KEYS)
    tier.store([(KEYS[11], b"x" * 200)])
    assert tier.stats["dropped_stores"] == 1 and tier.peek([KEYS[11]]) == [None]
    tier.release(handle)
    check_host_tier(tier)


def test_a_small_value_takes_a_slot_in_a_carved_page_before_a_free_page() -> None:
    tier = HostTier(3 * LARGE, slot_nbytes=(SMALL, LARGE), pin=False)
    tier.store([(KEYS[0], b"a"), (KEYS[1], b"b" * LARGE), (KEYS[2], b"c")])
    assert tier.arena_bytes == 3 * LARGE  # one chunk
    tier.discard([KEYS[1]])
    tier.store([(KEYS[3], b"d" * 250)])  # the page the large value left, not a carved one
    tier.store([(KEYS[4], b"e")])
    check_host_tier(tier)
    assert len({tier.hold([k])[0] // tier._ids for k in (KEYS[0], KEYS[2], KEYS[4])}) == 1


BS = 4
FULL = FullAttentionSpec(BS, 1, 8, "float32")  # 256 bytes of K/V a block
STATE = RecurrentStateSpec(BS, ((64, 40),), ("float32",))  # 10 KiB a layer


def recurrent_config(recurrent: bool = True):
    return make_kv_cache_config([FULL, STATE, STATE] if recurrent else [FULL], num_blocks=400)


def attention_values(layout: BlockLayout, n: int) -> list[tuple[bytes, bytes]]:
    return [(i.to_bytes(32, "little"), bytes(layout.value_nbytes)) for i in range(n)]


def test_checkpoints_beside_attention_blocks_cost_their_own_bytes_only() -> None:
    """The connector's host tier holds as many attention blocks with a recurrent group in
    the layout as without, less the checkpoints' own bytes."""
    capacity = 1 << 20
    with_state = TierConnector.create(recurrent_config(), "m", host_tier_bytes=capacity).host
    plain = TierConnector.create(recurrent_config(False), "m", host_tier_bytes=capacity).host
    assert with_state is not None and plain is not None
    layouts = [BlockLayout.for_group("m", recurrent_config(), g) for g in range(2)]
    attn, ckpt = sorted(layouts, key=lambda layout: layout.value_nbytes)
    assert with_state.slot_classes == tuple(sorted(HostTier.slot_nbytes_for(x) for x in layouts))
    for tier in (with_state, plain):
        tier.store(attention_values(attn, 4000))  # more than fit
    assert len(plain) == capacity // HostTier.slot_nbytes_for(attn)
    assert len(with_state) >= 0.95 * len(plain)
    checkpoints = [((10_000 + i).to_bytes(32, "little"), bytes(ckpt.value_nbytes)) for i in range(5)]
    with_state.store(checkpoints)
    assert with_state.contains([k for k, _ in checkpoints]) == 5
    blocks = len(with_state) - 5
    assert blocks >= 0.95 * (capacity - 5 * HostTier.slot_nbytes_for(ckpt)) // HostTier.slot_nbytes_for(attn)
    check_host_tier(with_state)


def test_store_blocks_fills_carved_pages_with_the_bytes_encode_block_makes() -> None:
    cfg = recurrent_config()
    cache = PagedKVCache(cfg)
    gen = torch.Generator().manual_seed(0)
    for t in cache.key_caches + cache.value_caches:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    layouts = [BlockLayout.for_group("m", cfg, g) for g in range(len(cfg.groups))]
    g = next(g for g, x in enumerate(layouts) if not x.is_recurrent)
    tier = HostTier(1 << 18, slot_nbytes=[HostTier.slot_nbytes_for(x) for x in layouts], pin=False)
    tier._per_chunk = 1  # a run of slots ends at a page's end
    per_page = tier.slot_nbytes // HostTier.slot_nbytes_for(layouts[g])
    n = per_page + 3  # two pages: one full run, then the next
    tokens = [[i] * BS for i in range(n)]
    keys = block_keys(layouts[g], list(range(1, n + 1)), root_hash(None))
    ids = [1 + i % 40 for i in range(n)]
    assert tier.store_blocks(cache, layouts[g], g, ids, keys, tokens) == n
    assert [bytes(v) for v in tier.load(keys)] == [v for _, v in offload_items(cache, layouts[g], g, ids,
                                                                             keys, tokens)]
    assert tier.arena_bytes == 2 * tier.slot_nbytes
    check_host_tier(tier)


@pytest.mark.parametrize("bad", [0, -64, [], [64, 0], [1.5], "128", [True], (64, None)])
def test_bad_slot_sizes_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="slot_nbytes"):
        HostTier(1 << 10, slot_nbytes=bad)


def test_store_blocks_of_a_layout_no_slot_holds_is_refused_and_changes_nothing() -> None:
    cfg = recurrent_config()
    cache = PagedKVCache(cfg)
    layouts = [BlockLayout.for_group("m", cfg, g) for g in range(len(cfg.groups))]
    g = next(g for g, x in enumerate(layouts) if x.is_recurrent)
    attn = next(x for x in layouts if not x.is_recurrent)
    tier = HostTier(1 << 16, slot_nbytes=HostTier.slot_nbytes_for(attn), pin=False)
    tier.store(attention_values(attn, 3))
    before = (tier.peek([k for k, _ in attention_values(attn, 3)]), tier.stats.snapshot(), tier.arena_bytes)
    key = block_keys(layouts[g], [7], root_hash(None))
    with pytest.raises(ValueError, match="largest slot"):
        tier.store_blocks(cache, layouts[g], g, [cfg.num_blocks + 1], key, [[1] * BS])
    assert (tier.peek([k for k, _ in attention_values(attn, 3)]), tier.stats.snapshot(),
            tier.arena_bytes) == before
    # store() keeps the tier interface: a value too large for every slot is dropped and counted
    tier.store([(key[0], bytes(layouts[g].value_nbytes))])
    assert tier.stats["dropped_stores"] == 1 and len(tier) == 3
