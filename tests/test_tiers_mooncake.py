"""Mooncake Store as a tier (opt-in: KVSTORE_TEST_MOONCAKE=1 with mooncake installed; CI does
not install it, see docs/tiers.md)."""

from __future__ import annotations

import os

import pytest

if os.environ.get("KVSTORE_TEST_MOONCAKE") != "1":
    pytest.skip("Mooncake tests are opt-in: KVSTORE_TEST_MOONCAKE=1", allow_module_level=True)
pytest.importorskip("mooncake.store")

from kvstore.hashing import hash_block, root_hash  # noqa: E402
from kvstore.specs import FullAttentionSpec  # noqa: E402
from kvstore.tiers import BlockLayout, encode_block, load_verified, request_keys  # noqa: E402
from kvstore.tiers.mooncake_store import MooncakeMaster, MooncakeStore  # noqa: E402

LAYOUT = BlockLayout("test-model", FullAttentionSpec(4, 2, 8, "bfloat16"), (0, 1))


def chain(n: int, salt: str | None = None):
    tokens = [[4 * i + j for j in range(4)] for i in range(n)]
    hashes, parent = [], root_hash(salt)
    for t in tokens:
        parent = hash_block(parent, t)
        hashes.append(parent)
    return tokens, request_keys(LAYOUT, hashes, salt)


def test_mooncake_round_trip_contains_and_verification():
    with MooncakeMaster() as master:
        st = MooncakeStore(master.master, master.metadata, segment_bytes=32 << 20, buffer_bytes=16 << 20)
        tokens, keys = chain(6)
        items = [(k, encode_block(LAYOUT, k, t, os.urandom(LAYOUT.payload_nbytes)))
                 for k, t in zip(keys, tokens, strict=True)]
        st.store([items[i] for i in (0, 1, 2, 4)])
        assert st.flush(10)
        assert st.contains(keys) == 3 and st.contains(keys[4:]) == 1
        assert st.present(keys) == [True, True, True, False, True, False]
        assert [bytes(v) if v is not None else None for v in st.load(keys)] == [
            items[0][1], items[1][1], items[2][1], None, items[4][1], None]
        assert len(load_verified(st, LAYOUT, keys, tokens)) == 3
        st.store_now([(keys[1], items[0][1])])  # another key's value: a miss, counted
        assert len(load_verified(st, LAYOUT, keys, tokens)) == 1 and st.stats["wrong_key"] == 1
        _, other = chain(6, "tenant-b")
        assert st.contains(other) == 0
        assert st.stats["errors"] == 0
        st.close()
