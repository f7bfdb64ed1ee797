"""Tier keys and values, the host tier, and packing device pages to host buffers and back."""

from __future__ import annotations

import subprocess
import sys
import threading
from array import array

import numpy as np
import pytest
import torch

from kvstore.hashing import hash_block, root_hash
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.paged_kv_cache import PagedKVCache
from kvstore.request import Request
from kvstore.specs import FullAttentionSpec, SlidingWindowSpec, make_kv_cache_config
from kvstore.tiers import (
    REJECT_REASONS,
    BackgroundWriter,
    BlockLayout,
    HostTier,
    TierStats,
    block_key,
    block_keys,
    block_payload_nbytes,
    decode_block,
    encode_block,
    extend_hit,
    gather_blocks,
    load_verified,
    offload_items,
    request_keys,
    restore_payloads,
    scatter_blocks,
)
from kvstore.tiers.codec import HEADER_NBYTES
from kvstore.tiers.connector import TierConnector

BS, HEADS, DIM = 4, 2, 8


def hybrid_config(dtype: str = "bfloat16", num_blocks: int = 12):
    specs = ([SlidingWindowSpec(BS, HEADS, DIM, dtype, window=8)] * 2
             + [FullAttentionSpec(BS, HEADS, DIM, dtype)] * 4)
    return make_kv_cache_config(specs, num_blocks=num_blocks)


def filled_cache(dtype: str = "bfloat16", seed: int = 0) -> PagedKVCache:
    cache = PagedKVCache(hybrid_config(dtype))
    gen = torch.Generator().manual_seed(seed)
    for t in cache.key_caches + cache.value_caches:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return cache


LAYOUT = BlockLayout("test-model", FullAttentionSpec(BS, HEADS, DIM, "bfloat16"), (2, 3))
TOKENS = [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]]


def chain(tokens, salt=None):
    hashes, parent = [], root_hash(salt)
    for t in tokens:
        parent = hash_block(parent, t)
        hashes.append(parent)
    return hashes


def payload(seed: int, layout: BlockLayout = LAYOUT) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layout.payload_nbytes,), dtype=torch.uint8, generator=gen).numpy().tobytes()


# --- keys -------------------------------------------------------------------------------


def test_key_is_deterministic_and_depends_on_hash_layout_and_salt():
    h = chain(TOKENS)[0]
    root = root_hash(None)
    k = block_key(LAYOUT, h, root)
    assert isinstance(k, bytes) and len(k) == 32
    assert block_key(LAYOUT, h, root) == k
    others = {
        block_key(LAYOUT, h + 1, root),
        block_key(LAYOUT, h, root_hash("tenant-b")),
        block_key(BlockLayout("other-model", LAYOUT.spec, (2, 3)), h, root),
        block_key(BlockLayout("test-model", LAYOUT.spec, (4, 5)), h, root),
        block_key(BlockLayout("test-model", LAYOUT.spec, (2, 3), extra="tp=1/2"), h, root),
        block_key(BlockLayout("test-model", FullAttentionSpec(BS, HEADS, DIM, "float16"), (2, 3)), h, root),
        block_key(BlockLayout("test-model", SlidingWindowSpec(BS, HEADS, DIM, "bfloat16", window=8),
                              (2, 3)), h, root),
        block_key(BlockLayout("test-model", SlidingWindowSpec(BS, HEADS, DIM, "bfloat16", window=16),
                              (2, 3)), h, root),
    }
    assert k not in others and len(others) == 8


def test_another_salt_gives_disjoint_keys():
    a = request_keys(LAYOUT, chain(TOKENS, "tenant-a"), "tenant-a")
    b = request_keys(LAYOUT, chain(TOKENS, "tenant-b"), "tenant-b")
    assert not set(a) & set(b)
    # Even a chained hash taken from another tenant does not reach its keys.
    assert not set(block_keys(LAYOUT, chain(TOKENS, "tenant-a"), root_hash("tenant-b"))) & set(a)


def test_request_keys_match_the_request_hash_chain():
    req = Request("r", [t for block in TOKENS for t in block] + [99], cache_salt="s")
    hashes = req.update_block_hashes(BS, hash_block)
    assert request_keys(LAYOUT, hashes, "s") == block_keys(LAYOUT, chain(TOKENS, "s"), root_hash("s"))


def test_keys_carry_no_token_ids():
    tokens = [[123456789 + i, 987654321 + i, 55555 + i, 4242 + i] for i in range(3)]
    for key, block in zip(request_keys(LAYOUT, chain(tokens), None), tokens, strict=True):
        for tok in block:
            for enc in (array("q", [tok]).tobytes(), array("i", [tok]).tobytes(), str(tok).encode()):
                assert enc not in key


@pytest.mark.parametrize("bad", [-1, 1 << 128, True, 1.5, "12"])
def test_bad_block_hash_is_refused(bad):
    with pytest.raises(ValueError, match="block_hash"):
        block_key(LAYOUT, bad, root_hash(None))


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="model"):
        BlockLayout("", LAYOUT.spec, (0,))
    with pytest.raises(ValueError, match="layer_ids"):
        BlockLayout("m", LAYOUT.spec, ())
    with pytest.raises(ValueError, match="repeat"):
        BlockLayout("m", LAYOUT.spec, (1, 1))
    with pytest.raises(TypeError, match="spec"):
        BlockLayout("m", object(), (1,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group_id"):
        BlockLayout.for_group("m", hybrid_config(), 5)


def test_layout_for_group_matches_the_cache():
    cache = filled_cache()
    for g in range(len(cache.config.groups)):
        layout = BlockLayout.for_group("m", cache.config, g)
        assert layout.payload_nbytes == block_payload_nbytes(cache, g)
    # Groups with equal specs but different layers have different digests.
    digests = {BlockLayout.for_group("m", cache.config, g).digest for g in (1, 2)}
    assert len(digests) == 2


# --- values -------------------------------------------------------------------------------


def test_value_round_trip():
    key = block_key(LAYOUT, chain(TOKENS)[0], root_hash(None))
    value = encode_block(LAYOUT, key, TOKENS[0], payload(1))
    assert len(value) == LAYOUT.value_nbytes
    counters: dict[str, int] = {}
    out = decode_block(LAYOUT, key, TOKENS[0], value, counters)
    assert out is not None and bytes(out) == payload(1) and counters == {}


def corrupt(value: bytes, offset: int) -> bytes:
    b = bytearray(value)
    b[offset] ^= 0x40
    return bytes(b)


def test_every_bad_value_is_a_miss_with_its_counter():
    key = block_key(LAYOUT, chain(TOKENS)[0], root_hash(None))
    good = encode_block(LAYOUT, key, TOKENS[0], payload(1))
    other_layout = BlockLayout("other-model", LAYOUT.spec, LAYOUT.layer_ids)
    other_key = block_key(LAYOUT, chain(TOKENS)[1], root_hash(None))
    cases = {
        "wrong_size": [good[:-1], good + b"\0", b""],
        "bad_header": [corrupt(good, 0)],
        "wrong_version": [corrupt(good, 4)],
        "wrong_layout": [encode_block(other_layout, key, TOKENS[0], payload(1))],
        "wrong_key": [encode_block(LAYOUT, other_key, TOKENS[0], payload(1))],
        "wrong_tokens": [encode_block(LAYOUT, key, TOKENS[1], payload(1))],
        "bad_checksum": [corrupt(good, HEADER_NBYTES + 40), corrupt(good, len(good) - 1),
                         corrupt(good, HEADER_NBYTES - 1), corrupt(good, 6)],
        "miss": [None],
    }
    assert set(cases) - {"miss"} == set(REJECT_REASONS)
    for reason, values in cases.items():
        for value in values:
            counters: dict[str, int] = {}
            assert decode_block(LAYOUT, key, TOKENS[0], value, counters) is None, reason
            assert counters == {reason: 1}, (reason, counters)
    # tokens of the wrong length or type are a miss too, not an exception
    assert decode_block(LAYOUT, key, TOKENS[0][:3], good) is None
    assert decode_block(LAYOUT, key, ["x", 1, 2, 3], good) is None


def test_a_tampered_token_with_a_fixed_header_still_fails_the_checksum():
    key = block_key(LAYOUT, chain(TOKENS)[0], root_hash(None))
    good = bytearray(encode_block(LAYOUT, key, TOKENS[0], payload(1)))
    good[HEADER_NBYTES:HEADER_NBYTES + 8] = array("q", [999]).tobytes()
    counters: dict[str, int] = {}
    assert decode_block(LAYOUT, key, [999] + TOKENS[0][1:], bytes(good), counters) is None
    assert counters == {"bad_checksum": 1}


def test_encode_refuses_bad_input():
    key = block_key(LAYOUT, 1, 2)
    with pytest.raises(ValueError, match="key"):
        encode_block(LAYOUT, b"short", TOKENS[0], payload(1))
    with pytest.raises(ValueError, match="payload"):
        encode_block(LAYOUT, key, TOKENS[0], payload(1)[:-2])
    with pytest.raises(ValueError, match="tokens"):
        encode_block(LAYOUT, key, TOKENS[0][:2], payload(1))
    with pytest.raises(ValueError, match="int64"):
        encode_block(LAYOUT, key, [1, 2, 3, 1 << 70], payload(1))


# --- host tier ------------------------------------------------------------------------------


def items(n: int, start: int = 0, size: int = 100):
    return [(block_key(LAYOUT, i + 1, 0), bytes([i % 256]) * size) for i in range(start, start + n)]


def test_host_tier_contains_is_the_leading_run():
    tier = HostTier(10_000)
    its = items(5)
    tier.store([its[0], its[1], its[3]])
    keys = [k for k, _ in its]
    assert tier.contains(keys) == 2
    assert tier.contains(keys[3:]) == 1
    assert tier.contains(keys[2:]) == 0
    assert tier.contains([]) == 0
    assert tier.present(keys) == [True, True, False, True, False]
    assert [v is not None for v in tier.load(keys)] == [True, True, False, True, False]


def test_host_tier_evicts_least_recent_within_capacity():
    evicted = []
    tier = HostTier(350, on_evict=evicted.extend)
    its = items(4)
    tier.store(its[:3])
    tier.load([its[0][0]])  # 0 becomes most recent
    tier.store([its[3]])  # evicts 1
    assert [k for k, _ in evicted] == [its[1][0]]
    assert tier.num_bytes == 300 and len(tier) == 3
    assert tier.load([its[1][0]]) == [None]
    tier.store([(its[2][0], b"x" * 50)])  # replacing a key frees its old bytes
    assert tier.num_bytes == 250
    tier.store([(its[0][0], b"x" * 351)])  # larger than the capacity: dropped
    assert tier.stats["dropped_stores"] == 1 and tier.load([its[0][0]]) == [None]
    assert tier.stats["evictions"] == 1


def test_host_tier_refuses_bad_input():
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostTier(-1)
    tier = HostTier(100)
    with pytest.raises(ValueError, match="key"):
        tier.contains([b"k"])
    with pytest.raises(ValueError, match="key"):
        tier.present([b"k"])
    with pytest.raises(ValueError, match="pair"):
        tier.store([b"k"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="bytes-like"):
        tier.store([(block_key(LAYOUT, 1, 0), "text")])  # type: ignore[list-item]


def test_load_verified_stops_at_the_first_bad_block_and_counts():
    tier = HostTier(1 << 20)
    keys = request_keys(LAYOUT, chain(TOKENS), None)
    vals = [encode_block(LAYOUT, k, t, payload(i)) for i, (k, t) in enumerate(zip(keys, TOKENS, strict=True))]
    tier.store([(keys[0], vals[0]), (keys[1], corrupt(vals[1], len(vals[1]) - 1)), (keys[2], vals[2])])
    out = load_verified(tier, LAYOUT, keys, TOKENS)
    assert [bytes(p) for p in out] == [payload(0)]
    assert tier.stats["hits"] == 1 and tier.stats["misses"] == 2 and tier.stats["bad_checksum"] == 1
    with pytest.raises(ValueError, match="token id lists"):
        load_verified(tier, LAYOUT, keys, TOKENS[:2])


def test_extend_hit_asks_each_tier_after_the_ones_above():
    keys = [k for k, _ in items(6)]
    host, store = HostTier(10_000), HostTier(10_000)
    host.store([(k, b"v") for k in keys[1:3]])
    store.store([(k, b"v") for k in keys[:5]])
    assert extend_hit([host, store], keys, 1) == [2, 2]
    assert extend_hit([host, store], keys, 0) == [0, 5]
    assert extend_hit([host, store], keys, 6) == [0, 0]
    with pytest.raises(ValueError, match="num_hit"):
        extend_hit([host], keys, 7)


def test_background_writer_drops_when_full_and_flushes():
    gate = threading.Event()
    written = []

    def write(batch):
        gate.wait(5)
        written.extend(batch)

    stats = TierStats()
    w = BackgroundWriter(write, stats, max_queue=2, batch=1)
    w.submit(items(1))  # taken by the thread, blocked in write
    for _ in range(200):
        if w._queue.empty():
            break
        threading.Event().wait(0.005)
    w.submit(items(4, start=1))  # 2 fit, 2 dropped
    assert stats["dropped_stores"] == 2
    assert not w.flush(timeout=0.05)
    gate.set()
    assert w.flush(timeout=5)
    assert len(written) == 3 and stats["stores_queued"] == 3
    w.close()
    w.submit(items(1))
    assert stats["dropped_stores"] == 3


# --- device pages <-> host buffers ------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
def test_gather_scatter_round_trip_is_exact(dtype):
    src = filled_cache(dtype, seed=1) if dtype != "float8_e4m3fn" else filled_cache("float32", 1)
    if dtype == "float8_e4m3fn":  # fill through bytes: randn has no fp8 path on every build
        src = PagedKVCache(hybrid_config(dtype))
        for t in src.key_caches + src.value_caches:
            t.view(torch.uint8).copy_(torch.randint(0, 120, t.shape, dtype=torch.uint8))
    dst = PagedKVCache(hybrid_config(dtype))
    for g in range(len(src.config.groups)):
        packed = gather_blocks(src, g, [3, 5, 9])
        assert packed.shape == (3, block_payload_nbytes(src, g)) and packed.dtype == torch.uint8
        scatter_blocks(dst, g, [10, 1, 4], packed)
        L = len(src.config.groups[g].layer_ids)
        for j in range(L):
            pairs = ((src.key_caches, dst.key_caches), (src.value_caches, dst.value_caches))
            for caches_s, caches_d in pairs:
                for s, d in ((3, 10), (5, 1), (9, 4)):
                    assert torch.equal(caches_d[j][d].view(torch.uint8), caches_s[j][s].view(torch.uint8))
        # packing order: layer, then K before V, then the page
        row = packed[1].view(src.dtype).view(L, 2, BS, HEADS, DIM)
        assert torch.equal(row[L - 1, 1].view(torch.uint8), src.value_caches[L - 1][5].view(torch.uint8))
    untouched = [b for b in range(1, 12) if b not in (10, 1, 4)]
    assert not dst.key_caches[0][untouched].view(torch.uint8).any()


def test_offload_and_restore_through_the_host_tier():
    src, dst = filled_cache(seed=2), PagedKVCache(hybrid_config())
    tier = HostTier(1 << 20)
    g = 1
    layout = BlockLayout.for_group("m", src.config, g)
    keys = request_keys(layout, chain(TOKENS), None)
    tier.store(offload_items(src, layout, g, [2, 6, 7], keys, TOKENS))
    payloads = load_verified(tier, layout, keys, TOKENS)
    restore_payloads(dst, g, [8, 9, 11], payloads)
    for j in range(2):
        assert torch.equal(dst.key_caches[j][[8, 9, 11]], src.key_caches[j][[2, 6, 7]])
        assert torch.equal(dst.value_caches[j][[8, 9, 11]], src.value_caches[j][[2, 6, 7]])


def test_restore_reads_payloads_wherever_they_lie():
    """Payloads at equal distances (neighbouring arena slots), in reverse order, repeated,
    and in separate buffers all land in their own pages."""
    src, dst = filled_cache(seed=4), PagedKVCache(hybrid_config())
    g = 1
    P = block_payload_nbytes(src, g)
    packed = gather_blocks(src, g, [1, 2, 3, 4, 5]).numpy()
    arena = np.zeros((6, P + 64), dtype=np.uint8)  # rows spaced wider than a payload
    arena[:5, :P] = packed
    rows = [arena[i, :P] for i in range(5)]
    payloads = [rows[0], rows[1], rows[2], packed[4].tobytes(), rows[3], rows[1], rows[0]]
    sources = [1, 2, 3, 5, 4, 2, 1]
    targets = [11, 9, 7, 3, 6, 10, 8]
    restore_payloads(dst, g, targets, payloads)
    for j in range(len(src.config.groups[g].layer_ids)):
        assert torch.equal(dst.key_caches[j][targets], src.key_caches[j][sources])
        assert torch.equal(dst.value_caches[j][targets], src.value_caches[j][sources])
    untouched = [b for b in range(1, 12) if b not in targets]
    assert not dst.key_caches[0][untouched].view(torch.uint8).any()


def test_transfer_bad_input():
    cache = filled_cache()
    with pytest.raises(ValueError, match="null block"):
        gather_blocks(cache, 0, [0])
    with pytest.raises(ValueError, match="null block"):
        gather_blocks(cache, 0, [12])
    with pytest.raises(ValueError, match="group_id"):
        gather_blocks(cache, 3, [1])
    packed = gather_blocks(cache, 0, [1, 2])
    with pytest.raises(ValueError, match="repeat"):
        scatter_blocks(cache, 0, [3, 3], packed)
    with pytest.raises(ValueError, match="contiguous"):
        scatter_blocks(cache, 0, [3], packed)
    with pytest.raises(ValueError, match="uint8"):
        scatter_blocks(cache, 0, [3, 4], packed.float())
    with pytest.raises(ValueError, match="layout packs"):
        offload_items(cache, LAYOUT.__class__("m", LAYOUT.spec, (0,)), 0, [1], [block_key(LAYOUT, 1, 0)],
                      [TOKENS[0]])
    assert gather_blocks(cache, 0, []).shape == (0, block_payload_nbytes(cache, 0))


def test_importing_tiers_imports_no_torch():
    code = "import sys, kvstore, kvstore.tiers, kvstore.tiers.valkey_store; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- the host tier's arena ----------------------------------------------------------------------


def test_store_blocks_seals_in_place_the_bytes_encode_block_makes():
    src, dst = filled_cache(seed=3), PagedKVCache(hybrid_config())
    g = 1
    layout = BlockLayout.for_group("m", src.config, g)
    keys = request_keys(layout, chain(TOKENS), None)
    tier = HostTier(3 * HostTier.slot_nbytes_for(layout))
    # Scattered slots: store, drop the middle one, store again (runs of one and two slots).
    assert tier.store_blocks(src, layout, g, [2, 6, 7], keys, TOKENS) == 3
    expected = dict(offload_items(src, layout, g, [2, 6, 7], keys, TOKENS))
    assert [bytes(v) for v in tier.load(keys)] == [expected[k] for k in keys]
    assert tier.discard([keys[1]]) == 1
    assert tier.store_blocks(src, layout, g, [9], [keys[1]], [TOKENS[1]]) == 1
    assert bytes(tier.load([keys[1]])[0]) == dict(offload_items(src, layout, g, [9], [keys[1]],
                                                               [TOKENS[1]]))[keys[1]]
    payloads = load_verified(tier, layout, keys, [TOKENS[0], TOKENS[1], TOKENS[2]])
    restore_payloads(dst, g, [8, 3, 11], payloads)
    for j in range(len(src.config.groups[g].layer_ids)):
        assert torch.equal(dst.key_caches[j][[8, 3, 11]], src.key_caches[j][[2, 9, 7]])
        assert torch.equal(dst.value_caches[j][[8, 3, 11]], src.value_caches[j][[2, 9, 7]])
    # The payload starts on an aligned offset in its slot, the value right before it.
    assert (HostTier.slot_nbytes_for(layout) % 64 == 0
            and HostTier.slot_nbytes_for(layout) >= layout.value_nbytes)


def test_large_batches_seal_and_verify_on_the_checksum_threads(monkeypatch):
    from kvstore.tiers import codec

    monkeypatch.setattr(codec, "PARALLEL_MIN_NBYTES", 0)  # every batch counts as large
    monkeypatch.setattr(codec, "checksum_threads", lambda: 3)
    seen = set()
    real_seal = codec.seal_block

    def seal(*args):
        seen.add(threading.current_thread().name)
        real_seal(*args)

    import kvstore.tiers.host as host_mod

    monkeypatch.setattr(host_mod, "seal_block", seal)
    src, g = filled_cache(seed=5), 1
    layout = BlockLayout.for_group("m", src.config, g)
    keys = request_keys(layout, chain(TOKENS), None)
    tier = HostTier(3 * HostTier.slot_nbytes_for(layout))
    assert tier.store_blocks(src, layout, g, [2, 6, 7], keys, TOKENS) == 3
    assert seen and all(name.startswith("kvstore-xxh3") for name in seen)
    expected = dict(offload_items(src, layout, g, [2, 6, 7], keys, TOKENS))
    assert [bytes(v) for v in tier.load(keys)] == [expected[k] for k in keys]
    # Verified on the threads too: a bad middle value ends the run and is counted once,
    # the value after it (verified, but past the failure) is not counted.
    bad = bytearray(expected[keys[1]])
    bad[-1] ^= 1
    tier.store([(keys[1], bytes(bad))])
    before = tier.stats.snapshot()
    out = load_verified(tier, layout, keys, TOKENS)
    after = tier.stats.snapshot()
    assert [bytes(p) for p in out] == [expected[keys[0]][HEADER_NBYTES + 8 * layout.block_size:]]
    assert after.get("bad_checksum", 0) - before.get("bad_checksum", 0) == 1
    assert after["hits"] - before.get("hits", 0) == 1 and after["misses"] - before.get("misses", 0) == 2


def test_arena_reuses_its_slots_and_copies_what_it_evicts():
    evicted: list = []
    tier = HostTier(350, on_evict=evicted.extend)  # 100-byte values: 3 slots
    its = items(10)
    for it in its:
        tier.store([it])
    assert tier.arena_bytes == 300 and len(tier) == 3 and tier.num_slots == 3
    big = HostTier(5 * 100 + 99)
    big._per_chunk = 2  # chunks of 2 slots: 2, 2, then 1 (the capacity), never 6
    big.store(items(8))
    assert big.arena_bytes == 500 and len(big) == 5 and [len(c) for c in big._chunks] == [2, 2, 1]
    assert evicted == its[:7]  # copies of the values as they were, not views of reused slots
    assert tier.peek([its[9][0], its[0][0]]) == [its[9][1], None]
    tier.store([(its[8][0], b"z" * 101)])  # larger than a slot: dropped, the old value gone
    assert tier.load([its[8][0]]) == [None] and tier.stats["dropped_stores"] == 1


def test_held_slots_are_not_reused_until_released():
    tier = HostTier(300)  # 3 slots
    its = items(7)
    tier.store(its[:3])
    view = tier.load([its[0][0]])[0]
    handle = tier.hold([its[0][0], its[1][0]])
    tier.store(its[3:5])  # evicts 2, then 3: the held 0 and 1 stay, least recent as they are
    assert bytes(view) == its[0][1]
    assert [v is not None for v in tier.load([k for k, _ in its[:5]])] == [True, True, False, False, True]
    other = tier.hold([its[4][0]])
    tier.store([its[5]])  # every slot held: dropped
    assert tier.stats["dropped_stores"] == 1 and tier.load([its[5][0]]) == [None]
    tier.store([(its[0][0], b"n" * 100)])  # replaced while held: no slot for the new value
    assert bytes(view) == its[0][1] and tier.load([its[0][0]]) == [None]
    tier.release(handle)  # the retired slot of 0 is free again, 1 can be evicted
    tier.release(other)
    tier.store(its[5:7])
    assert [v is not None for v in tier.load([its[1][0], its[4][0], its[5][0], its[6][0]])] == \
        [False, True, True, True]


def test_tier_bench_reports_the_checksum_at_every_thread_count(capsys):
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    from kvstore.benchmarks import tier_bench

    views = [memoryview(bytes([i]) * 4096) for i in range(4)]
    with ThreadPoolExecutor(2) as pool:
        assert tier_bench.xxh3_all(pool, views) == [xxhash.xxh3_128(v).digest() for v in views]
    assert tier_bench.main(["--no-store", "--reps", "1", "--blocks", "2", "--pool-blocks", "8",
                            "--layers", "1", "--kv-heads", "1", "--head-dim", "8"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("checksum")]
    assert [row.split(",")[1].split()[0] for row in rows] == [
        str(t) for t in tier_bench.CHECKSUM_THREADS]


def test_tier_bench_without_cryptography_leaves_the_sealed_rows_out_and_says_so(monkeypatch, capsys):
    from kvstore.benchmarks import tier_bench
    from kvstore.tiers import seal

    def no_cryptography(*args: object) -> None:
        raise ImportError("sealed store values need cryptography")

    monkeypatch.setattr(seal, "Sealer", no_cryptography)
    assert tier_bench.main(["--no-store", "--reps", "1", "--blocks", "2", "--pool-blocks", "8",
                            "--layers", "1", "--kv-heads", "1", "--head-dim", "8"]) == 0
    out, err = capsys.readouterr()
    assert "store value, checksum path: verify" in out and "sealed" not in out
    assert "store value, sealed: left out (sealed store values need cryptography)" in err


def test_values_kept_in_process_skip_the_checksum_and_leave_it_with_their_copies():
    from kvstore.tiers.codec import checked_copy

    src, g = filled_cache(seed=3), 1
    layout = BlockLayout.for_group("m", src.config, g)
    keys = request_keys(layout, chain(TOKENS), None)
    other = request_keys(layout, chain(TOKENS, "other"), "other")[0]
    evicted: list = []
    tier = HostTier(3 * HostTier.slot_nbytes_for(layout), on_evict=evicted.extend, pin=False)
    assert tier.in_process
    assert tier.store_blocks(src, layout, g, [2, 6, 7], keys, TOKENS, checksum=False) == 3
    expected = dict(offload_items(src, layout, g, [2, 6, 7], keys, TOKENS))
    views = tier.load(keys)
    counters: dict = {}
    for k, t, v in zip(keys, TOKENS, views, strict=True):
        # only a reader that trusts this process's memory accepts them as they lie
        assert decode_block(layout, k, t, v, counters) is None
        payload = decode_block(layout, k, t, v, trusted=True)
        assert payload is not None and bytes(payload) == expected[k][-layout.payload_nbytes:]
        assert checked_copy(v) == expected[k]
    assert counters == {"bad_checksum": 3}
    # copies that leave (peek for a store, on_evict) carry the checksum encode_block computes
    assert tier.peek(keys) == [expected[k] for k in keys]
    assert tier.store_blocks(src, layout, g, [9], [other], [TOKENS[0]], checksum=False) == 1
    assert evicted == [(keys[0], expected[keys[0]])]
    # a trusted reader still checks size, layout, key and tokens
    assert decode_block(layout, keys[1], TOKENS[0], views[1], trusted=True) is None
    assert decode_block(layout, keys[2], TOKENS[2], bytes(views[2])[:-1], trusted=True) is None


def test_a_handle_released_twice_is_refused_and_other_holds_stay():
    tier = HostTier(300)  # 3 slots
    its = items(6)
    tier.store(its[:1])
    view = tier.load([its[0][0]])[0]
    reader, other = tier.hold([its[0][0]]), tier.hold([its[0][0]])
    tier.release(other)
    with pytest.raises(ValueError, match="released already"):
        tier.release(other)
    with pytest.raises(ValueError, match="did not return"):
        tier.release(tuple(reader))  # an equal tuple is not the handle
    tier.store([(its[0][0], b"n" * 100)])  # replaced: the old slot stays the reader's
    tier.store(its[1:6])
    assert bytes(view) == its[0][1]
    tier.release(reader)
    tier.release(tier.hold([b"k" * 32]))  # nothing held: an empty handle, released as a no-op


def test_connector_refuses_bad_settings():
    config = make_kv_cache_config([FullAttentionSpec(BS, HEADS, DIM)], num_blocks=8)
    host = HostTier(1 << 16)
    for kwargs, error in (({"recent_keys": -1}, ValueError), ({"recent_keys": "x"}, TypeError),
                          ({"remember_s": True}, TypeError), ({"remember_s": 0}, ValueError),
                          ({"remember_s": float("nan")}, ValueError), ({"host": "x"}, TypeError),
                          ({"store": object()}, TypeError)):
        with pytest.raises(error):
            TierConnector(config, "m", **{"host": host, **kwargs})
    with pytest.raises(TypeError, match="KVCacheConfig"):
        TierConnector("cfg", "m", host=host)  # type: ignore[arg-type]


def offloaded(prompt: list[int]) -> tuple[KVCacheManager, TierConnector]:
    """A manager (one full group) and its connector over a host tier holding `prompt`'s
    whole blocks, computed, offloaded and then dropped from the device."""
    config = make_kv_cache_config([FullAttentionSpec(BS, HEADS, DIM)], num_blocks=16)
    m = KVCacheManager(config)
    tiers = TierConnector(config, "m", host=HostTier(1 << 20))
    tiers.attach(m)
    a = Request("a", prompt)
    m.admit(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    m.free(a)
    tiers.take_transfers().run(PagedKVCache(config))  # a's blocks, into the host tier
    assert m.reset_prefix_cache()
    return m, tiers


def test_an_admission_on_another_device_hit_than_the_tier_lookup_is_refused():
    """The tier hit starts where the device hit its lookup followed ended: admitted on a
    later, longer device hit, its loads would land on the wrong pages."""
    prompt = list(range(100, 121))
    m, tiers = offloaded(prompt[:13])
    b = Request("b", prompt)
    with pytest.raises(TypeError, match="get_computed_blocks"):
        tiers.lookup(b, None)  # type: ignore[arg-type]
    external = tiers.lookup(b, m.get_computed_blocks(b))
    assert external == 12
    x = Request("x", prompt[:5])  # meanwhile block 0 is computed on the device
    m.admit(x, 5)
    x.num_computed_tokens = 5
    m.free(x)
    later = m.get_computed_blocks(b)
    assert later.num_full_hit_tokens == 4
    m.admit(b, 1, later, 0, external)
    with pytest.raises(ValueError, match="tier lookup followed one of 0"):
        tiers.admitted(b, later, external)
    assert "b" in tiers.hits  # kept for a drop or an admission that matches
    assert tiers.drop_lookup(b)


def test_an_arena_that_cannot_grow_drops_the_stores_and_grows_once_memory_is_back(monkeypatch):
    src = filled_cache(seed=3)
    layout = BlockLayout.for_group("m", src.config, 1)
    keys = request_keys(layout, chain(TOKENS), None)
    tier = HostTier(3 * HostTier.slot_nbytes_for(layout))

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", no_memory)
        assert tier.store_blocks(src, layout, 1, [2, 6, 7], keys, TOKENS) == 0
        tier.store([(keys[0], b"v" * 64)])  # a dropped store, as in a full tier: no raise
    assert len(tier) == 0 and tier.arena_bytes == 0
    assert tier.stats["dropped_stores"] == 4 and tier.stats["alloc_errors"] >= 1
    assert tier.store_blocks(src, layout, 1, [2, 6, 7], keys, TOKENS) == 3
    assert tier.contains(keys) == 3


def test_store_takes_memoryviews_of_any_format_and_refuses_non_contiguous_ones():
    tier = HostTier(1 << 20)
    grid = np.arange(64, dtype=np.uint8).reshape(8, 8)
    good = (b"g" * 32, memoryview(grid))
    with pytest.raises(ValueError, match="C-contiguous"):
        tier.store([good, (b"n" * 32, memoryview(grid[:, ::2]))])
    assert len(tier) == 0  # refused before anything is stored
    tier.store([good, (b"q" * 32, memoryview(grid.tobytes()).cast("q"))])
    assert tier.peek([b"g" * 32, b"q" * 32]) == [grid.tobytes()] * 2


def test_a_kept_lookup_is_reused_only_for_the_prefix_it_found():
    """A request id looked up again at the same device hit and length reuses its kept tier
    hit only while its prompt is the one the hit was found for: another prompt under that
    id (a caller that dropped the manager's lookup but not the tiers') is looked up afresh,
    never admitted on the first prompt's KV."""
    prompt = list(range(100, 113))
    m, tiers = offloaded(prompt)
    x = Request("x", prompt)
    assert tiers.lookup(x, m.get_computed_blocks(x)) == 12
    lookups = tiers.stats.lookups
    again = Request("x", list(prompt))  # the same prompt: the kept hit serves
    assert tiers.lookup(again, m.get_computed_blocks(again)) == 12
    assert tiers.stats.lookups == lookups
    other = Request("x", [50] * len(prompt))  # the same id and length, another prompt
    assert tiers.lookup(other, m.get_computed_blocks(other)) == 0
    assert tiers.stats.lookups == lookups + 1
    assert "x" not in tiers.hits
    salted = Request("x", prompt, cache_salt="t")  # another tenant's prefix: no hit either
    assert tiers.lookup(salted, m.get_computed_blocks(salted)) == 0
    assert tiers.lookup(x, m.get_computed_blocks(x)) == 12
    assert tiers.drop_lookup(x)
