"""Recurrent checkpoints in the tiers: a freed request's checkpoints offload beside its
blocks, a lookup on a cleared device extends the hit only to a checkpoint a tier holds
(host tier and an in-process store), the checkpoint loads into the working state, and a
value of another layout is refused. On a CPU device cache, then through the engine with a
tiny Gated DeltaNet hybrid against an engine without tiers and transformers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import xxhash
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from invariants import check_host_tier, check_two_size_pool, internals

from kvstore.hashing import root_hash
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import BlockIds, KVCacheManager
from kvstore.paged_kv_cache import PagedKVCache
from kvstore.request import Request
from kvstore.specs import FullAttentionSpec, KVCacheConfig, RecurrentStateSpec, make_kv_cache_config
from kvstore.tiers.base import StoreItem, TierStats
from kvstore.tiers.codec import BlockLayout, block_key, encode_block
from kvstore.tiers.connector import TierConnector
from kvstore.tiers.host import HostTier, gather_blocks, restore_payloads

BS = 4
FULL = FullAttentionSpec(BS, 1, 8, "float32")  # 256 bytes a block (K and V)
# Two state tensors of two dtypes: 320 + 10 bytes a layer, two layers in one group.
STATE = RecurrentStateSpec(BS, ((2, 40), (5,)), ("float32", "float16"))


class DictStore:
    """An in-process store: a dict behind the tier interface (values copied in)."""

    name = "store"

    def __init__(self) -> None:
        self.stats = TierStats()
        self.values: dict[bytes, bytes] = {}

    def contains(self, keys: Sequence[bytes]) -> int:
        self.stats.add("asks")
        n = 0
        while n < len(keys) and keys[n] in self.values:
            n += 1
        return n

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        self.stats.add("asks")
        return [k in self.values for k in keys]

    def load(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.values.get(k) for k in keys]

    def store(self, items: Sequence[StoreItem]) -> None:
        self.values.update((k, bytes(v)) for k, v in items)

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        pass


def config() -> KVCacheConfig:
    return make_kv_cache_config([FULL, STATE, STATE], num_blocks=60)


def host_tier(cfg: KVCacheConfig) -> HostTier:
    """A host tier with a slot size per layout (checkpoints and blocks), as `create` sizes it."""
    return HostTier(1 << 20, slot_nbytes=[HostTier.slot_nbytes_for(BlockLayout.for_group("m", cfg, g))
                                          for g in range(len(cfg.groups))])


def state_group(cfg: KVCacheConfig) -> int:
    return next(g for g, group in enumerate(cfg.groups) if group.is_recurrent)


def device(tiers: TierConnector) -> tuple[KVCacheManager, PagedKVCache]:
    """A fresh manager with the connector attached, and its (empty) device cache."""
    cfg = tiers.config
    manager = KVCacheManager(cfg)
    tiers.attach(manager)
    return manager, PagedKVCache(cfg)


def admit(manager: KVCacheManager, tiers: TierConnector, request: Request,
          num_new_tokens: int) -> BlockIds:
    """The scheduler's admission: device hit, what the tiers add, admit, tell the tiers."""
    computed = manager.get_computed_blocks(request)
    external = tiers.lookup(request, computed)
    ids = manager.admit(request, num_new_tokens, computed, num_external_tokens=external)
    assert ids is not None
    tiers.admitted(request, computed, external)
    return ids


def fill_state(cache: PagedKVCache, g: int, page: int, value: float) -> None:
    """Write a state that names `value` into every tensor of every layer of group g."""
    for layer in cache.config.groups[g].layer_ids:
        for k, t in enumerate(cache.state_views(layer, page)):
            t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + value + k)


def fill_blocks(cache: PagedKVCache, g: int, pages: Sequence[int]) -> None:
    for layer in cache.config.groups[g].layer_ids:
        k, v = cache.layer_caches(layer)
        for page in pages:
            k[page].fill_(page)
            v[page].fill_(-page)


def serve_first(tiers: TierConnector, prompt: list[int], decode: int = 0
                ) -> tuple[PagedKVCache, dict[int, torch.Tensor], torch.Tensor]:
    """Run `prompt` (plus `decode` tokens in one step) on a fresh device as a worker would:
    the state after 8 tokens is 8.0, the checkpoint the prompt's end (8) takes; free it and
    run the offloads. Returns the device, the packed checkpoints by position, and the
    attention pages packed."""
    manager, cache = device(tiers)
    g = state_group(tiers.config)
    req = Request("a", prompt)
    admit(manager, tiers, req, 8)
    working = manager.block_table("a")[g][0]
    fill_state(cache, g, working, 8.0)
    req.num_computed_tokens = 8
    assert manager.allocate_slots(req, len(prompt) - 8) is not None  # takes the checkpoint
    cache.copy_blocks(manager.take_pending_copies())
    fill_state(cache, g, working, float(len(prompt)))
    if decode:
        req.num_computed_tokens = len(prompt)
        req.append_token_ids(list(range(200, 200 + decode)))
        assert manager.allocate_slots(req, decode) is not None
    req.num_computed_tokens = req.num_tokens - (1 if decode else 0)
    full = manager.block_table("a")[0]
    fill_blocks(cache, 0, full)
    attention = gather_blocks(cache, 0, full[:req.num_computed_tokens // BS]).clone()
    manager.free(req)
    tiers.take_transfers().run(cache)
    layout = tiers.layouts[g]
    packed = {}
    for pos in (8, req.num_computed_tokens):
        if pos % BS == 0:
            key = block_key(layout, req.block_hashes[pos // BS - 1], root_hash(req.cache_salt))
            tier = tiers.host if tiers.host is not None else tiers.store
            assert tier is not None
            (value,) = tier.load([key])
            if value is not None:
                packed[pos] = torch.frombuffer(bytearray(value), dtype=torch.uint8)[
                    -layout.payload_nbytes:]
    return cache, packed, attention


def expected_state(cfg: KVCacheConfig, value: float) -> torch.Tensor:
    """The packed payload of a state filled by `fill_state(..., value)`."""
    cache = PagedKVCache(cfg)
    g = state_group(cfg)
    page = cfg.num_blocks + 1
    fill_state(cache, g, page, value)
    return gather_blocks(cache, g, [page])[0]


@pytest.mark.parametrize("where", ["host", "store"])
def test_checkpoint_offloads_and_a_cleared_device_loads_it(where: str) -> None:
    cfg = config()
    host = host_tier(cfg) if where == "host" else None
    store = DictStore() if where == "store" else None
    tiers = TierConnector(cfg, "m", host=host, store=store)
    g = state_group(cfg)
    prompt = list(range(1, 11))  # 10 tokens: prompt-end checkpoint at 8
    _, packed, attention = serve_first(tiers, prompt, decode=5)  # computed 14: blocks 0..2
    assert set(packed) == {8}  # no checkpoint at 12: no block boundary was reached there
    assert torch.equal(packed[8], expected_state(cfg, 8.0))
    assert tiers.stats.offloaded_blocks == 3 + 1

    # A cleared device: the tiers hold blocks 0..2 and a checkpoint at 8 only.
    manager, cache = device(tiers)
    req = Request("b", prompt + list(range(200, 205)) + [7, 7, 7])
    assert tiers.lookup(req, manager.get_computed_blocks(req)) == 8
    computed = manager.get_computed_blocks(req)
    ids = manager.admit(req, 4, computed, num_external_tokens=8)
    assert ids is not None and req.num_computed_tokens == 8
    tiers.admitted(req, computed, 8)
    tiers.take_transfers().run(cache)
    working = manager.block_table("b")[g][0]
    assert torch.equal(gather_blocks(cache, g, [working])[0], expected_state(cfg, 8.0))
    assert torch.equal(gather_blocks(cache, 0, manager.block_table("b")[0][:2]), attention[:2])
    assert tiers.stats.loaded_blocks == 2 + 1
    assert not manager.take_pending_copies()  # no device checkpoint was copied
    kind = "host_hit_tokens" if where == "host" else "store_hit_tokens"
    assert getattr(tiers.stats, kind) == 8


def test_a_lookup_asks_each_tier_once_which_checkpoints_it_holds() -> None:
    """The store lost every checkpoint of a long prompt: the lookup misses after one question
    for the attention run and one for the checkpoints, not one per candidate position."""
    cfg = config()
    store = DictStore()
    tiers = TierConnector(cfg, "m", store=store)
    prompt = list(range(1, 41))  # 10 full blocks, a checkpoint at the end
    serve_first(tiers, prompt)
    manager, _ = device(tiers)
    req = Request("b", prompt + [7, 7])
    computed = manager.get_computed_blocks(req)
    layout = tiers.layouts[state_group(cfg)]
    lost = {block_key(layout, h, root_hash(req.cache_salt)) for h in req.block_hashes}
    assert lost & set(store.values)  # checkpoints were offloaded
    store.values = {k: v for k, v in store.values.items() if k not in lost}
    asked = store.stats["asks"]
    assert not tiers.lookup(req, computed)
    assert store.stats["asks"] - asked == 2


def test_output_end_checkpoint_gives_the_whole_turn() -> None:
    cfg = config()
    tiers = TierConnector(cfg, "m", host=host_tier(cfg))
    prompt = list(range(1, 11))
    _, packed, _ = serve_first(tiers, prompt, decode=3)  # computed 12: the working state
    assert set(packed) == {8, 12}
    assert torch.equal(packed[12], expected_state(cfg, 10.0))
    manager, _ = device(tiers)
    req = Request("b", prompt + [200, 201, 202, 9, 9])
    assert tiers.lookup(req, manager.get_computed_blocks(req)) == 12


def test_no_checkpoint_no_tier_hit_and_other_salt_misses() -> None:
    cfg = config()
    tiers = TierConnector(cfg, "m", host=host_tier(cfg))
    serve_first(tiers, list(range(1, 11)))
    manager, _ = device(tiers)
    # Diverges in block 1: the blocks hold, the checkpoint at 8 does not name this prefix.
    req = Request("b", [1, 2, 3, 4, 5, 6, 7, 99, 9, 10, 11])
    assert tiers.lookup(req, manager.get_computed_blocks(req)) == 0
    salted = Request("c", list(range(1, 11)) + [5], cache_salt="other")
    assert tiers.lookup(salted, manager.get_computed_blocks(salted)) == 0
    assert not tiers.hits


def test_a_checkpoint_value_of_another_layout_is_refused() -> None:
    cfg = config()
    store = DictStore()
    tiers = TierConnector(cfg, "m", store=store)
    prompt = list(range(1, 11))
    serve_first(tiers, prompt)
    g = state_group(cfg)
    layout = tiers.layouts[g]
    req = Request("b", prompt + [5, 5])
    manager, _ = device(tiers)
    req.update_block_hashes(BS, manager.hash_fn)
    key = block_key(layout, req.block_hashes[1], root_hash(None))
    assert key in store.values
    # Same key and tokens, the states of another spec (one tensor of the same byte size).
    other = BlockLayout("m", RecurrentStateSpec(BS, ((165,),), "float16"), layout.layer_ids)
    assert other.payload_nbytes == layout.payload_nbytes and other.digest != layout.digest
    store.values[key] = encode_block(other, key, prompt[4:8], bytes(other.payload_nbytes))
    assert tiers.lookup(req, manager.get_computed_blocks(req)) == 0
    assert store.stats["wrong_layout"] == 1
    assert tiers.stats.rejected_values == 1


def test_released_checkpoints_leave_out_pages_a_queued_copy_fills() -> None:
    cfg = config()
    g = state_group(cfg)
    manager = KVCacheManager(cfg)
    released: dict[str, tuple[tuple[int, int], ...]] = {}
    manager.set_release_listener(
        lambda r: released.update({r.request.request_id: r.pages}) if r.group_id == g else None)
    a = Request("a", list(range(1, 11)))
    manager.admit(a, 8)
    a.num_computed_tokens = 8
    assert manager.allocate_slots(a, 2) is not None  # queues the checkpoint at 8
    (working_a, checkpoint), = manager.take_pending_copies()  # the worker runs it
    a.num_computed_tokens = 10
    manager.free(a)
    assert released["a"] == ((1, checkpoint),)  # the checkpoint it took, not its working state
    b = Request("b", list(range(1, 11)) + [5])
    computed = manager.get_computed_blocks(b)
    assert computed.num_computed_tokens == 8
    assert manager.admit(b, 3, computed) is not None  # queues checkpoint -> working state
    working_b = manager.block_table("b")[g][0]
    manager.free(b)  # before the worker ran that copy: its working state holds nothing yet
    assert released["b"] == ((1, checkpoint),) and working_b != checkpoint


def test_recurrent_layouts_and_transfers_check_their_input() -> None:
    cfg = config()
    g = state_group(cfg)
    layout = BlockLayout.for_group("m", cfg, g)
    assert layout.is_recurrent and not BlockLayout.for_group("m", cfg, 0).is_recurrent
    assert layout.payload_nbytes == 2 * (2 * 40 * 4 + 5 * 2)
    assert layout.digest != BlockLayout("m", FULL, layout.layer_ids).digest
    cache = PagedKVCache(cfg)
    with pytest.raises(ValueError, match="large pages"):
        gather_blocks(cache, g, [1])  # a block id, not a large page
    page = cfg.num_blocks + 1
    fill_state(cache, g, page, 3.0)
    before = gather_blocks(cache, g, [page]).clone()
    with pytest.raises(ValueError, match="bytes"):
        restore_payloads(cache, g, [page], [bytes(layout.payload_nbytes - 1)])
    assert torch.equal(gather_blocks(cache, g, [page]), before)
    restore_payloads(cache, g, [page + 1], [before[0].numpy().tobytes()])
    assert torch.equal(gather_blocks(cache, g, [page + 1]), before)


# ---------------------------------------------------------------- a machine, simulated device

PREFIXES = [list(range(100, 112)), list(range(100, 106)) + [7, 7, 7], list(range(200, 209))]
CHUNK = 6  # tokens a step computes at most


def content(salt: str | None, token_ids: Sequence[int]) -> float:
    """What a from-scratch run holds for a prefix: an int exact in float16 and float32."""
    return float(xxhash.xxh64_intdigest(repr((salt, tuple(token_ids))).encode()) % 2000 + 1)


def gather_state(cache: PagedKVCache, g: int, page: int) -> list[torch.Tensor]:
    """The state tensors of every layer of group g in a large page."""
    return [t for layer in cache.config.groups[g].layer_ids
            for t in cache.state_views(layer, page)]


class TieredRecurrentMachine(RuleBasedStateMachine):
    """Requests served one after the other on a small pool (prompt chunks stopped at
    checkpoint positions, decodes, preemption) with a host tier (and a store) beside it,
    and device resets, on a CPU device cache whose forward checks, before each step, that
    the working state and every attention page before the computed count hold what a
    from-scratch run has there: every hit, from the device or a tier, restored exactly."""

    with_store = False

    def __init__(self) -> None:
        super().__init__()
        cfg = make_kv_cache_config([FULL, STATE], num_blocks=24)  # 8 large pages of 3
        layouts = [BlockLayout.for_group("m", cfg, g) for g in range(len(cfg.groups))]
        slots = [HostTier.slot_nbytes_for(layout) for layout in layouts]
        self.host = HostTier(10 * max(slots), slot_nbytes=slots, pin=False)  # 10 pages
        self.store = DictStore() if self.with_store else None
        self.tiers = TierConnector(cfg, "m", host=self.host, store=self.store)
        self.manager = KVCacheManager(cfg)
        self.tiers.attach(self.manager)
        self.cache = PagedKVCache(cfg)
        self.g = state_group(cfg)
        self.n = 0

    def worker(self) -> None:
        """The worker's part of a step before its forward: tier transfers, then copies."""
        self.tiers.take_transfers().run(self.cache)
        self.cache.copy_blocks(self.manager.take_pending_copies())

    def forward(self, req: Request, n: int) -> None:
        """Check what the step reads, then write what computing n tokens leaves."""
        rid, nc, bs = req.request_id, req.num_computed_tokens, BS
        full, state = self.manager.block_table(rid)[0], self.manager.block_table(rid)[self.g]
        layer = self.cache.config.groups[0].layer_ids[0]
        keys = self.cache.layer_caches(layer)[0]
        for i in range(nc // bs):
            assert full[i] != 0
            want = content(req.cache_salt, req.token_ids[:(i + 1) * bs])
            assert bool((keys[full[i]] == want).all()), f"block {i} of {rid}"
        if nc:
            want = content(req.cache_salt, req.token_ids[:nc])
            for t in gather_state(self.cache, self.g, state[0]):
                assert bool((t == want).all()), f"state of {rid} at {nc}"
        end = nc + n
        for i in range(nc // bs, end // bs):
            keys[full[i]].fill_(content(req.cache_salt, req.token_ids[:(i + 1) * bs]))
        value = content(req.cache_salt, req.token_ids[:end])
        for layer in self.cache.config.groups[self.g].layer_ids:
            for t in self.cache.state_views(layer, state[0]):
                t.fill_(value)
        req.num_computed_tokens = end

    def chunk(self, req: Request, start: int, computed: ComputedBlocks | None = None,
              hit: int = -1) -> int:
        """The next chunk, stopped at the first checkpoint position (as the scheduler)."""
        n = min(req.num_tokens - (start if hit < 0 else hit), CHUNK)
        base = start if hit < 0 else hit
        stops = [p for p in self.manager.next_checkpoints(req, base - start + n, computed)
                 if p > base]
        return stops[0] - base if stops else n

    @rule(prefix=st.integers(0, len(PREFIXES) - 1),
          suffix=st.lists(st.integers(0, 50), max_size=6), max_tokens=st.integers(1, 8),
          salt=st.sampled_from([None, "tenant"]), preempt_at=st.integers(1, 12))
    def serve(self, prefix: int, suffix: list[int], max_tokens: int, salt: str | None,
              preempt_at: int) -> None:
        rid = f"r{self.n}"
        self.n += 1
        req = Request(rid, PREFIXES[prefix] + suffix, max_tokens=max_tokens, cache_salt=salt)
        m, tiers = self.manager, self.tiers
        computed = m.get_computed_blocks(req)
        external = tiers.lookup(req, computed)
        hit = computed.num_full_hit_tokens + external if external else computed.num_computed_tokens
        num_new = self.chunk(req, computed.num_computed_tokens, computed, hit)
        ids = m.admit(req, num_new, computed, num_external_tokens=external)
        if ids is None:
            assert tiers.drop_lookup(req) == bool(external)
            m.drop_lookup(req)
            return
        tiers.admitted(req, computed, external)
        assert req.num_computed_tokens == hit
        if external:
            event("a hit through the tiers")
        self.worker()
        self.forward(req, num_new)
        for _ in range(preempt_at):
            if req.num_computed_tokens == req.num_tokens:
                if req.num_output_tokens >= max_tokens:
                    break
                req.append_token_ids(int(content(salt, req.token_ids)) % 50)
            n = self.chunk(req, req.num_computed_tokens)
            if m.grow(req, n) is None:
                break
            self.worker()
            self.forward(req, n)
        m.free(req)
        self.worker()

    @rule()
    def reset_device_cache(self) -> None:
        assert self.manager.reset_prefix_cache()

    @invariant()
    def pool_is_consistent(self) -> None:
        check_two_size_pool(internals(self.manager).pool)
        check_host_tier(self.host)
        assert not self.tiers.hits and not self.host._held

    def teardown(self) -> None:
        for _ in range(2):  # the last batch ran: taking again releases its pins
            self.manager.take_pending_copies()
        assert self.manager.num_free_blocks == self.manager.num_usable_blocks


class TieredRecurrentStoreMachine(TieredRecurrentMachine):
    with_store = True


TestTieredRecurrentMachine = TieredRecurrentMachine.TestCase
TestTieredRecurrentStoreMachine = TieredRecurrentStoreMachine.TestCase
for case in (TestTieredRecurrentMachine, TestTieredRecurrentStoreMachine):
    case.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


# ------------------------------------------------------------------------ through the engine

transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_engine_hits_a_checkpoint_in_the_host_tier_after_a_reset() -> None:
    """A turn served, the device cache cleared: the next turn's whole prefix (16 tokens, the
    output's end) comes from the host tier, and tokens and logits are those of an engine
    without tiers and of transformers."""
    from test_recurrent_models import build, check, make_engine, run_one, tokens

    from kvstore.engine.engine import TierConfig

    ref, model = build("qwen3_next")
    plain = make_engine(model)
    tiered = make_engine(model, tiers=TierConfig(host_tier_bytes=1 << 22))
    try:
        gen = torch.Generator().manual_seed(5)
        a = tokens(gen, 13)
        first = [run_one(e, a)[0] for e in (plain, tiered)]
        assert first[0].outputs[0].token_ids == first[1].outputs[0].token_ids
        assert tiered.flush_tiers(5.0)
        assert tiered.stats.tier_offloaded_blocks == 4 + 2  # blocks 0..3, checkpoints 12, 16
        turn = a + first[0].outputs[0].token_ids + tokens(gen, 3)
        for e in (plain, tiered):
            assert e.manager.reset_prefix_cache()
        (want, computed_plain), (got, computed) = (run_one(e, turn) for e in (plain, tiered))
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        check(ref, got, 4)
        assert got.num_cached_tokens == 16 and tiered.stats.host_hit_tokens == 16
        assert computed == computed_plain - 16
        assert tiered.stats.tier_rejected_values == 0
    finally:
        tiered.close()
