"""Payload-free tiers for the bench simulator: placeholder values and their verification,
the model tier's capacity, replays with a host tier and a store (in-process and a real
Valkey), and ``kvstore bench --host-tier-bytes / --store``."""

from __future__ import annotations

import json
import os

import pytest

from kvstore.benchmarks.bench import load_bench_workload, print_table
from kvstore.benchmarks.simulator import TierOptions, simulate
from kvstore.benchmarks.sweep import MODEL_SHAPES, run_sweep
from kvstore.benchmarks.tier_model import (
    ModelTier,
    decode_placeholder,
    encode_placeholder,
    placeholder_nbytes,
)
from kvstore.benchmarks.workloads import make_workload
from kvstore.cli import main
from kvstore.kv_cache_manager import BlockIds, CacheConfig, KVCacheManager
from kvstore.request import Request
from kvstore.specs import FullAttentionSpec, KVCacheConfig, make_kv_cache_config
from kvstore.tiers import BlockLayout, load_verified, request_keys
from kvstore.tiers.connector import TierConnector

BS = 4
LAYOUT = BlockLayout("m", FullAttentionSpec(BS, 2, 8, "bfloat16"), (0, 1))
TOKENS = [tuple(range(i * BS, (i + 1) * BS)) for i in range(3)]


def attached(config: KVCacheConfig, tiers: TierConnector,
             cache_config: CacheConfig | None = None) -> KVCacheManager:
    """A manager with the connector beside it, as the scheduler sets them up."""
    manager = KVCacheManager(config, cache_config)
    tiers.attach(manager)
    return manager


def admit(manager: KVCacheManager, tiers: TierConnector, request: Request,
          num_new_tokens: int) -> BlockIds | None:
    """The scheduler's admission: the device hit, what the tiers add, the manager's admit
    with those tokens, then the connector told."""
    computed = manager.get_computed_blocks(request)
    external = tiers.lookup(request, computed)
    ids = manager.admit(request, num_new_tokens, computed, num_external_tokens=external)
    if ids is not None:
        tiers.admitted(request, computed, external)
    return ids


def keys(salt: str | None = None) -> list[bytes]:
    from kvstore.hashing import hash_block, root_hash

    hashes, parent = [], root_hash(salt)
    for t in TOKENS:
        parent = hash_block(parent, t)
        hashes.append(parent)
    return request_keys(LAYOUT, hashes, salt)


def test_placeholder_round_trip_and_every_rejection():
    k = keys()
    value = encode_placeholder(LAYOUT, k[0], TOKENS[0])
    assert len(value) < 200 and placeholder_nbytes(value) == LAYOUT.value_nbytes
    assert placeholder_nbytes(b"x" * 10) == 10
    assert decode_placeholder(LAYOUT, k[0], TOKENS[0], value) is not None
    other = BlockLayout("m2", LAYOUT.spec, LAYOUT.layer_ids)
    cases = {
        "miss": None,
        "wrong_size": value[:-1],
        "bad_header": b"XXXX" + value[4:],
        "wrong_layout": encode_placeholder(other, k[0], TOKENS[0]),
        "wrong_key": encode_placeholder(LAYOUT, k[1], TOKENS[0]),
        "wrong_tokens": encode_placeholder(LAYOUT, k[0], TOKENS[1]),
        "bad_checksum": value[:-1] + bytes([value[-1] ^ 1]),
    }
    for reason, bad in cases.items():
        counters: dict[str, int] = {}
        assert decode_placeholder(LAYOUT, k[0], TOKENS[0], bad, counters) is None
        assert counters == {reason: 1}


def test_load_verified_with_placeholders_stops_at_the_first_bad_value():
    tier = ModelTier(None)
    k = keys()
    tier.store([(k[0], encode_placeholder(LAYOUT, k[0], TOKENS[0])),
                (k[1], encode_placeholder(LAYOUT, k[1], TOKENS[0])),  # wrong tokens
                (k[2], encode_placeholder(LAYOUT, k[2], TOKENS[2]))])
    out = load_verified(tier, LAYOUT, k, TOKENS, decode_placeholder)
    assert len(out) == 1
    assert tier.stats["wrong_tokens"] == 1 and tier.stats["hits"] == 1


def test_model_tier_charges_the_real_value_size():
    k = keys()
    tier = ModelTier(2 * LAYOUT.value_nbytes + 1)
    for key, t in zip(k, TOKENS, strict=True):
        tier.store([(key, encode_placeholder(LAYOUT, key, t))])
    assert len(tier) == 2 and tier.num_bytes == 2 * LAYOUT.value_nbytes
    assert tier.contains(k) == 0 and tier.contains(k[1:]) == 2  # the oldest went first
    assert tier.stats["evictions"] == 1
    with pytest.raises(ValueError, match="capacity_bytes"):
        ModelTier(-1)


def _replay(num_blocks: int, tiers: TierOptions | None, layout: str = "full", limit: int = 60,
            hold: bool = True):
    w = make_workload("mixed_default", seed=0)
    shape = MODEL_SHAPES["tiny"]
    specs = shape.full_specs(16) if layout == "full" else shape.hybrid_specs(16)
    return simulate(w.requests[:limit], make_kv_cache_config(specs, num_blocks=num_blocks),
                    enable_partial_hits=True, tiers=tiers, hold_window_pages=hold)


def test_host_tier_adds_hits_at_the_same_device_budget():
    device = _replay(200, None)
    tiered = _replay(200, TierOptions(host_bytes=1 << 20))
    assert tiered.prompt_host_hit_tokens > 0 and tiered.host_hit_tokens >= tiered.prompt_host_hit_tokens
    assert tiered.prompt_hit_tokens > device.prompt_hit_tokens
    assert tiered.total_hit_rate > device.total_hit_rate
    assert tiered.tier_offloaded_blocks > 0 and tiered.tier_loaded_blocks > 0
    assert tiered.tier_rejected_values == 0 and tiered.store_hit_tokens == 0
    # Every token is computed, or found on the device or in a tier.
    for r in (device, tiered):
        assert (r.computed_tokens + r.hit_tokens + r.host_hit_tokens + r.store_hit_tokens
                == r.expected_tokens + r.discarded_tokens)
        assert r.prompt_device_hit_tokens + r.prompt_host_hit_tokens + r.prompt_store_hit_tokens \
            == r.prompt_hit_tokens
    # A tiny host tier holds less and finds less.
    small = _replay(200, TierOptions(host_bytes=256 << 10))
    assert small.prompt_host_hit_tokens < tiered.prompt_host_hit_tokens


def test_dropped_windows_at_likely_hit_ends_add_host_hits():
    # Windows that drop every page leaving them (with held windows, the pages at likely hit
    # ends stay in the table and are offloaded when the request ends).
    hits = {m: _replay(1200, TierOptions(host_bytes=4 << 20, window_offload=m), "hybrid",
                       hold=False)
            for m in ("none", "ends", "all")}
    assert hits["none"].prompt_host_hit_tokens < hits["ends"].prompt_host_hit_tokens \
        <= hits["all"].prompt_host_hit_tokens
    assert hits["none"].tier_offloaded_blocks <= hits["ends"].tier_offloaded_blocks \
        <= hits["all"].tier_offloaded_blocks
    with pytest.raises(ValueError, match="window_offload"):
        _replay(1200, TierOptions(host_bytes=1 << 20, window_offload="some"), "hybrid")


def test_hybrid_replay_with_a_store():
    device = _replay(1200, None, "hybrid")
    tiered = _replay(1200, TierOptions(store="mem"), "hybrid")
    assert tiered.prompt_store_hit_tokens > 0
    assert tiered.prompt_hit_tokens >= device.prompt_hit_tokens
    assert (tiered.computed_tokens + tiered.hit_tokens + tiered.store_hit_tokens
            == tiered.expected_tokens + tiered.discarded_tokens)


@pytest.fixture(scope="module")
def valkey_url():
    pytest.importorskip("redis")
    from kvstore.benchmarks.valkey_server import ValkeyServer, find_server_binary

    url = os.environ.get("KVSTORE_VALKEY_URL")
    if url:
        yield url
        return
    try:
        find_server_binary()
    except Exception as exc:  # no server binary here
        pytest.skip(str(exc))
    with ValkeyServer() as server:
        yield server.url


@pytest.mark.slow
def test_a_real_store_replays_as_the_in_process_one_and_is_left_clean(valkey_url):
    from kvstore.tiers.valkey_store import ValkeyStore

    probe = ValkeyStore(valkey_url, sync_stores=True)
    client = probe._get_client()
    before = client.dbsize()
    mem = _replay(200, TierOptions(host_bytes=128 << 10, store="mem"))
    real = _replay(200, TierOptions(host_bytes=128 << 10, store=valkey_url))
    assert real.prompt_store_hit_tokens > 0
    for name in ("prompt_hit_tokens", "prompt_host_hit_tokens", "prompt_store_hit_tokens",
                 "store_hit_tokens", "computed_tokens", "tier_offloaded_blocks"):
        assert getattr(real, name) == getattr(mem, name), name
    assert client.dbsize() == before  # the replay deleted what it wrote
    probe.close()


def test_sweep_with_tiers_side_by_side_in_80_columns():
    from rich.console import Console

    w = load_bench_workload("mixed_default", limit=40, seed=0)
    shape = MODEL_SHAPES["tiny"]
    res = run_sweep(w, shape=shape, block_size=16, budgets=[200 * shape.block_bytes(16)],
                    policies=["paged", "prefix"], jobs=1, tiers=TierOptions(host_bytes=1 << 20))
    by = {r.policy: r for r in res.rows}
    assert set(by) == {"paged", "prefix", "prefix+tiers"}
    assert set(res.unbounded) == {"prefix"}
    dev, tiered = by["prefix"].metrics, by["prefix+tiers"].metrics
    assert dev is not None and tiered is not None
    assert tiered.prompt_host_hit_tokens > 0 and dev.prompt_host_hit_tokens == 0
    assert tiered.prompt_hit_rate >= dev.prompt_hit_rate
    assert by["prefix+tiers"].vs_unbounded is not None
    assert res.meta.tiers == {"host_bytes": 1 << 20, "store": None, "window_offload": "ends"}
    console = Console(width=80, record=True, color_system=None)
    print_table(res, console)
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    assert "prefix+tiers" in text and " host " in text and "store" in text
    from kvstore.benchmarks.bench import _count

    assert [_count(n) for n in (9999, 12345, 114_800, 999_499, 1_234_567)] == \
        ["9999", "12.3k", "115k", "999k", "1.23M"]  # the narrow table's counts stay 5 wide
    console = Console(width=250, record=True, color_system=None)
    print_table(res, console, wide=True)
    text = console.export_text()
    assert "total hit" in text and "device" in text and "steps" in text


def test_bench_cli_host_tier_rows_in_json_and_csv(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "--model-shape", "tiny", "--jobs", "1", "--limit", "40",
                 "--policies", "prefix", "--pool-sizes", "200", "--host-tier-bytes", "1MiB",
                 "--store", "mem", "--out", str(out), "--in-place"]) == 0
    rows = {r["policy"]: r for r in json.loads((out / "sweep.json").read_text())["rows"]}
    dev, tiered = rows["prefix"], rows["prefix+tiers"]
    assert tiered["prompt_host_hit_tokens"] + tiered["prompt_store_hit_tokens"] > 0
    assert tiered["prompt_hit_rate"] >= dev["prompt_hit_rate"]
    assert tiered["total_hit_rate"] >= dev["total_hit_rate"]
    header = (out / "sweep.csv").read_text().splitlines()[0].split(",")
    assert {"prompt_host_hit_tokens", "prompt_store_hit_tokens", "prompt_device_hit_tokens",
            "total_hit_rate"} <= set(header)
    assert "prefix+tiers" in capsys.readouterr().out


def test_a_tier_hit_too_large_to_admit_at_once_falls_back_to_the_device_hit():
    """A hybrid tier hit allocates a page per loaded block in every group before the
    sliding groups give back those below their window: on a pool that holds the request
    only chunk by chunk, the request is admitted on its device hit instead of failing."""
    import random

    from kvstore.benchmarks.workloads import RequestSpec
    from kvstore.engine.scheduler import SchedulerConfig

    rng = random.Random(0)
    long = tuple(rng.randrange(30000) for _ in range(2000))
    reqs = [RequestSpec("a", 0.0, long, 8)]
    reqs += [RequestSpec(f"f{i}", 1.0 + i, tuple(rng.randrange(30000) for _ in range(1500)), 8)
             for i in range(6)]
    reqs += [RequestSpec("b", 20.0, long[:1990] + (1, 2, 3), 8)]
    specs = MODEL_SHAPES["tiny"].hybrid_specs(16)
    sched = SchedulerConfig(256, 16)
    host = TierOptions(host_bytes=64 << 20)
    small = make_kv_cache_config(specs, num_blocks=300)
    device = simulate(reqs, small, scheduler_config=sched)
    tiered = simulate(reqs, small, scheduler_config=sched, tiers=host)
    assert tiered.prompt_host_hit_tokens == 0 and tiered.computed_tokens == device.computed_tokens
    # With room for the whole hit at once, the same request loads it from the host tier.
    roomy = simulate(reqs, make_kv_cache_config(specs, num_blocks=800), scheduler_config=sched,
                     tiers=host)
    assert roomy.prompt_host_hit_tokens == 1984


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("grow", ["grow", "allocate_slots"])
def test_pages_dropped_before_the_prompt_end_are_queued_as_they_drop(grow, hold):
    """Window 8, 4-token blocks, a 16-token prompt: the windows before its likely hit ends
    (15 tokens, one short of the prompt, as a repeat hits, and 16) cover blocks 1 to 3;
    decoding past them drops them, and each is queued for offload right when it drops,
    not before. Block 0 lies before no likely hit end and is not. With held windows
    (hold_window_pages) the cache had none of the prompt, so its first window (blocks 0
    and 1) stays in the table and reaches the tiers when the request ends."""
    from kvstore.benchmarks.tier_model import PlaceholderConnector
    from kvstore.specs import SlidingWindowSpec

    specs = [SlidingWindowSpec(4, 1, 8, "float16", window=8), FullAttentionSpec(4, 1, 8, "float16")]
    config = make_kv_cache_config(specs, num_blocks=64)
    tiers = PlaceholderConnector(config, "m", host=ModelTier(None))
    manager = attached(config, tiers, CacheConfig(hold_window_pages=hold))
    window_group = next(g for g, grp in enumerate(config.groups) if grp.spec.sliding_window)
    request = Request("r", list(range(100, 116)), max_tokens=40)
    assert admit(manager, tiers, request, 16) is not None
    table = manager.block_table("r")[window_group]
    dropped: list[int] = []
    for step in range(30):
        request.num_computed_tokens = request.num_tokens
        request.append_token_ids(step)
        getattr(manager, grow)(request, 1)
        dropped += [b for off in tiers.take_offloads() if off.group_id == window_group
                    for b in off.block_ids]
        now = manager.block_table("r")[window_group]
        # queued exactly when it left the window
        assert all((b in dropped) == (now[i] == 0) for i, b in enumerate(table) if i in (1, 2, 3))
    assert tiers.watching("r") == (not hold)  # held windows: the manager tags the pages
    if hold:
        assert manager.block_table("r")[window_group][:4] == (table[0], table[1], 0, 0)
        assert dropped == [table[2], table[3]]
        manager.free(request)
        freed = [b for off in tiers.take_offloads() if off.group_id == window_group
                 for b in off.block_ids]
        assert {table[0], table[1]} <= set(freed)
    else:
        assert manager.block_table("r")[window_group][:4] == (0, 0, 0, 0)
        assert dropped == [table[1], table[2], table[3]]



def test_drop_lookup_releases_the_host_slots_of_a_hit_never_admitted():
    """A host tier hit holds its slots from the lookup until its loads ran. A request that
    leaves the waiting queue unadmitted gives them back with ``drop_lookup``; held, a full
    host tier would drop every new value instead of evicting those."""
    from kvstore.benchmarks.tier_model import PlaceholderConnector
    from kvstore.tiers import HostTier

    config = make_kv_cache_config([FullAttentionSpec(4, 1, 8, "float16")], num_blocks=64)
    host = HostTier(4 * 128, slot_nbytes=128, pin=False)  # 4 slots of placeholder values
    tiers = PlaceholderConnector(config, "m", host=host)
    manager = attached(config, tiers)

    def hit(r: Request) -> int:
        computed = manager.get_computed_blocks(r)
        return computed.num_full_hit_tokens + tiers.lookup(r, computed)

    def run(rid: str, prompt: list[int]) -> None:
        r = Request(rid, prompt, max_tokens=1)
        assert admit(manager, tiers, r, len(prompt)) is not None
        r.num_computed_tokens = len(prompt)
        manager.free(r)
        tiers.run_offloads(None, tiers.take_offloads())
        assert manager.reset_prefix_cache()  # later hits come from the host tier

    first = list(range(100, 117))  # 4 full blocks and one token
    run("a", first)
    assert len(host) == 4
    b = Request("b", first + [1, 2], max_tokens=1)
    assert hit(b) == 16  # the host tier's
    assert sum(host._held.values()) == 4
    with pytest.raises(ValueError, match="never admitted"):
        manager.free(b)
    assert manager.drop_lookup(b) is False and tiers.drop_lookup(b) is True
    assert not host._held and tiers.drop_lookup(b) is False
    # New content now evicts the old slots rather than being dropped.
    second = list(range(300, 317))
    run("c", second)
    assert host.stats["dropped_stores"] == 0 and host.stats["evictions"] == 4
    d = Request("d", second + [5], max_tokens=1)
    assert hit(d) == 16
    assert admit(manager, tiers, d, 2) is not None
    held = dict(host._held)
    with pytest.raises(ValueError, match="admitted: free it"):
        manager.drop_lookup(d)  # an admitted request is freed instead; nothing changes
    assert host._held == held and manager.requests["d"] is d


@pytest.mark.parametrize("mode", ["ends", "all"])
def test_held_window_pages_a_lone_request_lets_go_of_reach_the_tiers(mode):
    """Window 8, 4-token blocks, a 16-token prompt the cache had none of: the window group
    holds blocks 0 and 1 (the first W tokens) and drops 2 and 3 as the window passes them.
    Decoding alone in a pool too small to keep the held ones, the request lets them go;
    they are queued for offload as they drop (with "ends", those before the prompt's end:
    blocks 1 to 3), not lost."""
    from kvstore.benchmarks.tier_model import PlaceholderConnector
    from kvstore.specs import SlidingWindowSpec

    specs = [SlidingWindowSpec(4, 1, 8, "float16", window=8), FullAttentionSpec(4, 1, 8, "float16")]
    config = make_kv_cache_config(specs, num_blocks=20)
    tiers = PlaceholderConnector(config, "m", host=ModelTier(None), window_offload=mode)
    manager = attached(config, tiers)
    w = next(g for g, grp in enumerate(config.groups) if grp.spec.sliding_window)
    request = Request("r", list(range(100, 116)), max_tokens=44)
    assert admit(manager, tiers, request, 16) is not None
    table = manager.block_table("r")[w]
    offloaded: list[int] = []
    released_at = None
    for step in range(43):  # up to 59 tokens: 15 full pages and 3 in the window fit 19 pages
        request.num_computed_tokens = request.num_tokens
        request.append_token_ids(step)
        assert manager.grow(request, 1) is not None
        offloaded += [b for off in tiers.take_offloads() if off.group_id == w for b in off.block_ids]
        now = manager.block_table("r")[w]
        if released_at is None and now[3] == 0:
            released_at = step
    assert released_at is not None, "the pool never made the request let go of its held pages"
    want = set(table[1:4]) | ({table[0]} if mode == "all" else set())
    assert want <= set(offloaded)
    if mode == "ends":
        assert table[0] not in offloaded  # the head lies before no likely hit end


def test_external_tokens_take_fresh_pages_with_the_window_below_the_hit_end_null():
    """The manager's seam for a connector: whole blocks supplied from outside the pool get
    fresh pages and count as computed; a sliding group keeps only the window before their
    end. The release listener hears of a request's pages when it is freed."""
    from kvstore.kv_cache_manager import ReleasedPages
    from kvstore.specs import SlidingWindowSpec

    specs = [SlidingWindowSpec(4, 1, 8, "float16", window=8), FullAttentionSpec(4, 1, 8, "float16")]
    config = make_kv_cache_config(specs, num_blocks=32)
    w = next(g for g, grp in enumerate(config.groups) if grp.spec.sliding_window)
    manager = KVCacheManager(config)
    records: list[ReleasedPages] = []
    manager.set_release_listener(records.append)
    request = Request("r", list(range(100, 122)), max_tokens=4)
    computed = manager.get_computed_blocks(request)
    for bad in (3, -4, 24, "4"):
        with pytest.raises(ValueError):
            manager.admit(request, 4, computed, num_external_tokens=bad)  # type: ignore[arg-type]
    ids = manager.admit(request, 6, computed, num_external_tokens=16)
    assert ids is not None and request.num_computed_tokens == 16
    table = manager.block_table("r")
    # Window 8 at 16 tokens: the next query attends positions 9.., blocks 2 on.
    assert table[w][:2] == (0, 0) and all(table[w][2:]) and len(table[w]) == 6
    assert all(table[1 - w]) and len(table[1 - w]) == 6
    assert ids[w] == table[w][2:] and ids[1 - w] == table[1 - w]
    request.num_computed_tokens = 22
    manager.free(request)
    assert [(r.group_id, r.cause) for r in records] == [(0, "free"), (1, "free")]
    assert records[w].pages == tuple((i, b) for i, b in enumerate(table[w]) if b)
    manager.set_release_listener(None)
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_a_request_freed_before_its_loads_ran_offloads_none_of_their_pages() -> None:
    """Offloads run before loads in a step: a request let go of between its admission on a
    tier hit and the step's transfers must not offload the pages its loads have yet to fill
    (they would reach the host tier holding whatever the pages held before)."""
    import torch

    from kvstore.paged_kv_cache import PagedKVCache
    from kvstore.tiers import HostTier
    from kvstore.tiers.host import gather_blocks

    config = make_kv_cache_config([FullAttentionSpec(BS, 1, 8, "float32")], num_blocks=30)
    store = HostTier(1 << 20)  # stands for the shared store
    prompt = list(range(100, 113))  # 3 full blocks and 1 token
    a = TierConnector(config, "m", store=store)
    ma = attached(config, a)
    cache_a = PagedKVCache(config)
    r = Request("a", prompt)
    assert ma.admit(r, len(prompt)) is not None
    for t in cache_a.key_caches + cache_a.value_caches:
        t.fill_(1.0)
    truth = gather_blocks(cache_a, 0, ma.block_table("a")[0][:3]).clone()
    r.num_computed_tokens = len(prompt)
    ma.free(r)
    a.take_transfers().run(cache_a)

    host = HostTier(1 << 20)
    b = TierConnector(config, "m", host=host, store=store)
    mb = attached(config, b)
    cache_b = PagedKVCache(config)
    for t in cache_b.key_caches + cache_b.value_caches:
        t.fill_(-7.0)  # what fresh pages held before
    r2 = Request("b", prompt)
    computed = mb.get_computed_blocks(r2)
    external = b.lookup(r2, computed)
    assert external == 12
    assert mb.admit(r2, 1, computed, num_external_tokens=external) is not None
    b.admitted(r2, computed, external)
    mb.free(r2)  # let go of before the worker ran the step's transfers
    b.take_transfers().run(cache_b)
    assert len(host) == 0  # nothing offloaded from pages no load had filled
    r3 = Request("c", prompt)  # the loads still ran, into the pages cached at the free
    computed = mb.get_computed_blocks(r3)
    assert computed.num_full_hit_tokens == 12  # the loaded pages, cached at the free
    assert torch.equal(gather_blocks(cache_b, 0, [b.block_id for b in computed.blocks[0]]),
                       truth)
