"""PagedKVCache: layer -> group -> slot mapping, slot-mapped writes, block copies, sizes."""

from __future__ import annotations

import pytest
import torch

from kvstore.paged_kv_cache import PagedKVCache
from kvstore.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)

BS = 4
HEADS = 2
DIM = 8


def gemma3_specs(num_layers: int = 12, window: int = 8,
                 dtype: torch.dtype = torch.float32) -> list[KVCacheSpec]:
    """Gemma-3 style: five sliding-window layers, then one full layer, repeated."""
    full = FullAttentionSpec(BS, HEADS, DIM, dtype)
    sliding = SlidingWindowSpec(BS, HEADS, DIM, dtype, window=window)
    return [full if (i + 1) % 6 == 0 else sliding for i in range(num_layers)]


def gemma3_config(num_blocks: int = 10, dtype: torch.dtype = torch.float32) -> KVCacheConfig:
    return make_kv_cache_config(gemma3_specs(dtype=dtype), num_blocks=num_blocks)


# --------------------------------------------------------------------- layer -> group -> slot


def test_gemma3_layers_split_into_six_equal_groups() -> None:
    config = gemma3_config()
    # 10 sliding + 2 full layers: groups of 2, the sliding type split into 5 groups.
    assert config.num_slots == 2
    assert len(config.groups) == 6
    assert all(len(g.layer_ids) == 2 for g in config.groups)
    assert config.num_padding_layers == 0
    windows = [g.spec.sliding_window for g in config.groups]
    assert windows.count(None) == 1 and windows.count(8) == 5
    # Every layer is in exactly one group, and each group holds one type.
    specs = gemma3_specs()
    seen = sorted(layer for g in config.groups for layer in g.layer_ids)
    assert seen == list(range(12))
    for g in config.groups:
        assert {specs[layer] for layer in g.layer_ids} == {g.spec}

    cache = PagedKVCache(config)
    expected = {
        0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (2, 0), 6: (2, 1),
        7: (3, 0), 8: (3, 1), 9: (4, 0), 10: (4, 1), 5: (5, 0), 11: (5, 1),
    }
    assert cache.layer_to_group_slot == expected
    for layer, (group, slot) in expected.items():
        assert cache.group_of(layer) == group
        assert config.groups[group].layer_ids[slot] == layer
        k, v = cache.layer_caches(layer)
        # Layer j of every group shares the tensors of slot j.
        assert k is cache.key_caches[slot] and v is cache.value_caches[slot]
    assert len(cache.key_caches) == len(cache.value_caches) == 2
    assert cache.key_caches[0].shape == (10, BS, HEADS, DIM)


def test_uneven_types_report_padding() -> None:
    full = FullAttentionSpec(BS, HEADS, DIM, torch.float32)
    sliding = SlidingWindowSpec(BS, HEADS, DIM, torch.float32, window=4)
    config = make_kv_cache_config([sliding, sliding, sliding, full, full], num_blocks=4)
    assert config.num_slots == 2
    assert [g.layer_ids for g in config.groups] == [(0, 1), (2,), (3, 4)]
    assert config.num_padding_layers == 1


def test_writes_land_in_the_layers_slot_only() -> None:
    config = gemma3_config()
    cache = PagedKVCache(config)
    key = torch.full((1, HEADS, DIM), 3.0)
    cache.write(7, key, -key, torch.tensor([2 * BS + 1]))  # layer 7 = group 3, slot 0
    assert torch.equal(cache.key_caches[0][2, 1], key[0])
    assert torch.equal(cache.value_caches[0][2, 1], -key[0])
    assert int((cache.key_caches[0] != 0).sum()) == HEADS * DIM
    assert not cache.key_caches[1].any() and not cache.value_caches[1].any()


# --------------------------------------------------------------------- write / gather


def test_write_gather_round_trip_skips_padding() -> None:
    config = gemma3_config(num_blocks=8)
    cache = PagedKVCache(config)
    gen = torch.Generator().manual_seed(0)
    table = [5, 2, 7]  # a 10-token sequence scattered over three pages
    n = 10
    key = torch.randn(n + 3, HEADS, DIM, generator=gen)
    value = torch.randn(n + 3, HEADS, DIM, generator=gen)
    # Three padding rows interleaved; their values must go nowhere.
    slots, rows = [], []
    pos = 0
    for t in range(n + 3):
        if t in (0, 4, n + 2):
            slots.append(-1)
        else:
            slots.append(table[pos // BS] * BS + pos % BS)
            rows.append(t)
            pos += 1
    slot_mapping = torch.tensor(slots)
    for layer in (0, 5):
        cache.write(layer, key, value, slot_mapping)
        k, v = cache.gather(layer, table, 0, n)
        assert torch.equal(k, key[rows]) and torch.equal(v, value[rows])
        k, v = cache.gather(layer, table, 3, 9)
        assert torch.equal(k, key[rows][3:9]) and torch.equal(v, value[rows][3:9])
    # Only the 10 real tokens were written in slot 0: padding rows are nowhere.
    written = (cache.key_caches[0] != 0).any(-1).any(-1)
    assert int(written.sum()) == n
    assert not cache.key_caches[0][0].any()  # the null block is untouched
    for t in (0, 4, n + 2):
        assert not (cache.key_caches[0] == key[t]).all(-1).all(-1).any()
    assert not cache.key_caches[1].any()


def test_write_int32_slot_mapping_and_fp16() -> None:
    config = gemma3_config(num_blocks=4, dtype=torch.float16)
    cache = PagedKVCache(config)
    key = torch.arange(2 * HEADS * DIM, dtype=torch.float16).reshape(2, HEADS, DIM)
    cache.write(11, key, key + 1, torch.tensor([3 * BS + 3, -1], dtype=torch.int32))
    k, v = cache.gather(11, [0, 0, 0, 3], 15, 16)
    assert k.dtype == torch.float16
    assert torch.equal(k[0], key[0]) and torch.equal(v[0], key[0] + 1)


# --------------------------------------------------------------------- copy_blocks


def test_copy_blocks_copies_in_every_slot() -> None:
    config = gemma3_config(num_blocks=8)
    cache = PagedKVCache(config)
    gen = torch.Generator().manual_seed(1)
    for t in cache.key_caches + cache.value_caches:
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t.clone() for t in cache.key_caches + cache.value_caches]
    pairs = [(1, 4), (2, 6), (1, 7)]
    cache.copy_blocks(pairs)
    assert cache.copies_executed == 3
    for old, new in zip(before, cache.key_caches + cache.value_caches, strict=True):
        expected = old.clone()
        for src, dst in pairs:
            expected[dst] = old[src]
        assert torch.equal(new, expected)
    # Every layer sees the copy through its own slot.
    for layer in range(12):
        k, v = cache.gather(layer, [6], 0, BS)
        k_src, v_src = cache.gather(layer, [2], 0, BS)
        assert torch.equal(k, k_src) and torch.equal(v, v_src)
    cache.copy_blocks([])
    assert cache.copies_executed == 3


def test_copy_blocks_rejects_order_dependent_batches() -> None:
    cache = PagedKVCache(gemma3_config(num_blocks=8))
    with pytest.raises(ValueError):
        cache.copy_blocks([(1, 2), (3, 2)])
    with pytest.raises(ValueError):
        cache.copy_blocks([(1, 2), (2, 3)])
    assert cache.copies_executed == 0


# --------------------------------------------------------------------- errors and sizes


@pytest.mark.parametrize("layer", [12, -1, 100])
def test_unknown_layer_is_a_clear_error(layer: int) -> None:
    cache = PagedKVCache(gemma3_config())
    key = torch.zeros(1, HEADS, DIM)
    with pytest.raises(ValueError, match=f"layer {layer} is not in this cache"):
        cache.write(layer, key, key, torch.tensor([BS]))
    with pytest.raises(ValueError, match="not in this cache"):
        cache.gather(layer, [1], 0, 1)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.group_of(layer)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.layer_caches(layer)
    assert not any(t.any() for t in cache.key_caches + cache.value_caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_blocks", [2, 9])
def test_num_bytes_matches_config(dtype: torch.dtype, num_blocks: int) -> None:
    config = gemma3_config(num_blocks=num_blocks, dtype=dtype)
    cache = PagedKVCache(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert config.page_size_bytes == 2 * BS * HEADS * DIM * itemsize
    assert config.bytes_per_block == config.page_size_bytes * config.num_slots
    assert cache.num_bytes == config.bytes_per_block * num_blocks
    assert all(t.dtype == dtype for t in cache.key_caches + cache.value_caches)


def test_num_bytes_with_padding_counts_unused_pages() -> None:
    full = FullAttentionSpec(BS, HEADS, DIM, torch.float32)
    sliding = SlidingWindowSpec(BS, HEADS, DIM, torch.float32, window=4)
    config = make_kv_cache_config([sliding, sliding, sliding, full, full], num_blocks=5)
    cache = PagedKVCache(config)
    assert cache.num_bytes == config.bytes_per_block * 5 == 2 * config.page_size_bytes * 5
