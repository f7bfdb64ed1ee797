"""KV cache specs and the grouping of a model's layers over one shared pool."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from invariants import internals

from kvstore.block_pool import BlockPool, PendingCopies
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.single_type_kv_cache_manager import MANAGER_TYPES, SlidingWindowManager, make_manager
from kvstore.specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    group_layers,
    make_kv_cache_config,
)

BS, HEADS, DIM = 16, 4, 64


def full(dtype: torch.dtype = torch.float16) -> FullAttentionSpec:
    return FullAttentionSpec(BS, HEADS, DIM, dtype)


def sliding(window: int, dtype: torch.dtype = torch.float16) -> SlidingWindowSpec:
    return SlidingWindowSpec(BS, HEADS, DIM, dtype, window=window)


def gemma3_layers(num_layers: int = 26, window: int = 512) -> list[KVCacheSpec]:
    """Every 6th layer full, the rest sliding (Gemma 3's 5:1 pattern)."""
    return [full() if (i + 1) % 6 == 0 else sliding(window) for i in range(num_layers)]


def check_partition(config: KVCacheConfig, specs: list[KVCacheSpec]) -> None:
    """Every layer in exactly one group, of its own spec; no group larger than num_slots."""
    seen: list[int] = []
    for group in config.groups:
        assert 0 < len(group.layer_ids) <= config.num_slots
        for layer in group.layer_ids:
            assert specs[layer] == group.spec
        seen.extend(group.layer_ids)
    assert sorted(seen) == list(range(len(specs)))
    mapping = config.layer_to_group_slot()
    assert len(mapping) == len(specs)
    for layer, (g, slot) in mapping.items():
        assert config.groups[g].layer_ids[slot] == layer
    assert config.num_padding_layers == sum(config.num_slots - len(g.layer_ids)
                                            for g in config.groups)


# ---- page sizes --------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "itemsize"),
                         [(torch.float16, 2), (torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize(("bs", "heads", "dim"), [(16, 4, 64), (1, 1, 1), (32, 8, 128), (4, 2, 80)])
def test_page_size_bytes(dtype: torch.dtype, itemsize: int, bs: int, heads: int, dim: int) -> None:
    expected = 2 * bs * heads * dim * itemsize
    assert FullAttentionSpec(bs, heads, dim, dtype).page_size_bytes == expected
    assert SlidingWindowSpec(bs, heads, dim, dtype, window=7).page_size_bytes == expected


def test_spec_windows_and_defaults() -> None:
    assert FullAttentionSpec(16, 4, 64).dtype == "float16"
    # A torch dtype and its name make the same spec; a dtype a cache cannot hold is refused.
    assert FullAttentionSpec(16, 4, 64, torch.bfloat16) == FullAttentionSpec(16, 4, 64, "bfloat16")
    with pytest.raises(ValueError, match="unsupported KV cache dtype"):
        FullAttentionSpec(16, 4, 64, torch.int32)
    assert FullAttentionSpec(16, 4, 64).sliding_window is None
    assert sliding(128).sliding_window == 128
    # Specs are values: equal fields group together, a different window is a different spec.
    assert sliding(128) == sliding(128)
    assert sliding(128) != sliding(256)
    assert full() != SlidingWindowSpec(BS, HEADS, DIM, torch.float16, window=1)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 32, 100])
def test_window_arithmetic(window: int) -> None:
    """First needed block, where a block leaves the window (its inverse) and a hit end's
    pages agree with the window's positions, at every edge."""
    bs = 4
    spec = SlidingWindowSpec(bs, HEADS, DIM, window=window)
    for n in range(0, 3 * window + 4 * bs):
        assert spec.first_needed_block(n) == spec.first_needed_position(n) // bs
        start, stop = spec.hit_end_range(n)
        assert (start, stop) == (spec.first_needed_block(n // bs * bs), -(-n // bs))
    for i in range(3 * window // bs + 4):
        at = spec.leaves_window_at(i)
        assert spec.first_needed_block(at) > i >= spec.first_needed_block(at - 1)
    assert spec.resident_span(10_000, 64) == window + 64 + bs
    assert spec.resident_span(3, 64) == 3
    whole = FullAttentionSpec(bs, HEADS, DIM)
    assert whole.first_needed_block(10**6) == 0 and whole.hit_end_range(9) == (0, 3)
    assert whole.leaves_window_at(0) > 10**12 and whole.resident_span(10_000, 64) == 10_000


# ---- grouping ----------------------------------------------------------------------------------


def test_gemma3_like_grouping() -> None:
    specs = gemma3_layers(26)
    config = make_kv_cache_config(specs, num_blocks=100)
    check_partition(config, specs)
    full_layers = [5, 11, 17, 23]
    # The smallest type (4 full layers) sets the group size; 22 sliding layers need 6 groups.
    assert config.num_slots == 4
    full_groups = [g for g in config.groups if g.spec.sliding_window is None]
    sw_groups = [g for g in config.groups if g.spec.sliding_window is not None]
    assert len(full_groups) == 1 and full_groups[0].layer_ids == tuple(full_layers)
    assert len(sw_groups) == 6
    assert sorted(len(g.layer_ids) for g in sw_groups) == [2, 4, 4, 4, 4, 4]
    assert config.num_padding_layers == 2
    assert config.block_size == BS
    assert config.page_size_bytes == 2 * BS * HEADS * DIM * 2
    assert config.bytes_per_block == config.page_size_bytes * 4
    # Layer order is kept inside a group.
    for g in config.groups:
        assert list(g.layer_ids) == sorted(g.layer_ids)


def test_gemma3_exact_multiple_has_no_padding() -> None:
    specs = gemma3_layers(24)  # 20 sliding + 4 full: 5:1 exactly
    config = make_kv_cache_config(specs, num_blocks=10)
    check_partition(config, specs)
    assert config.num_slots == 4
    assert len(config.groups) == 6
    assert config.num_padding_layers == 0


def test_gemma2_alternating() -> None:
    specs: list[KVCacheSpec] = [sliding(4096) if i % 2 == 0 else full() for i in range(42)]
    config = make_kv_cache_config(specs, num_blocks=10)
    check_partition(config, specs)
    assert config.num_slots == 21
    assert len(config.groups) == 2
    assert config.num_padding_layers == 0
    by_window = {g.spec.sliding_window: g.layer_ids for g in config.groups}
    assert by_window[4096] == tuple(range(0, 42, 2))
    assert by_window[None] == tuple(range(1, 42, 2))


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_single_type_is_one_group(kind: str) -> None:
    specs: list[KVCacheSpec] = [full() if kind == "full" else sliding(64) for _ in range(12)]
    config = make_kv_cache_config(specs, num_blocks=10)
    check_partition(config, specs)
    assert len(config.groups) == 1
    assert config.num_slots == 12
    assert config.groups[0].layer_ids == tuple(range(12))
    assert config.num_padding_layers == 0


def test_single_layer() -> None:
    config = make_kv_cache_config([sliding(3)], num_blocks=5)
    assert config.num_slots == 1 and len(config.groups) == 1
    assert config.num_padding_layers == 0


def test_two_windows_and_full() -> None:
    # 6 layers of window 128, 3 of window 1024, 3 full: groups of 3.
    specs: list[KVCacheSpec] = []
    for i in range(12):
        specs.append(full() if i % 4 == 3 else sliding(1024) if i % 4 == 1 else sliding(128))
    config = make_kv_cache_config(specs, num_blocks=10)
    check_partition(config, specs)
    assert config.num_slots == 3
    windows = sorted((g.spec.sliding_window or 0) for g in config.groups)
    assert windows == [0, 128, 128, 1024]
    assert config.num_padding_layers == 0


def test_uneven_types_report_padding() -> None:
    # 7 windowed (W=8), 3 windowed (W=32), 2 full: groups of 2 -> 4 + 2 + 1 groups, one padded each
    # for the two odd types.
    specs: list[KVCacheSpec] = [sliding(8)] * 7 + [sliding(32)] * 3 + [full()] * 2
    config = make_kv_cache_config(specs, num_blocks=10)
    check_partition(config, specs)
    assert config.num_slots == 2
    assert len(config.groups) == 4 + 2 + 1
    assert config.num_padding_layers == 1 + 1


def test_group_layers_matches_config() -> None:
    specs = gemma3_layers(26)
    groups, num_slots = group_layers(specs)
    config = make_kv_cache_config(specs, num_blocks=7)
    assert groups == config.groups and num_slots == config.num_slots


def slot_tokens(config: KVCacheConfig, num_tokens: int) -> int:
    """Layer-slot tokens a request of `num_tokens` holds when every group keeps what its spec
    needs (full: all tokens; sliding: the window)."""
    return sum(config.num_slots * (num_tokens if g.spec.sliding_window is None
                                   else min(num_tokens, g.spec.sliding_window))
               for g in config.groups)


def test_typical_tokens_keeps_sliding_layers_whole_where_that_packs_them() -> None:
    # Llama-3-8B-like 5 full : 27 sliding (W = 1024): by default 7 groups of 5 slots, 3 of
    # them padding. Below about 2W, three sliding layers kept whole pack 4 groups of 8.
    specs = [full() if (i + 1) % 6 == 0 else sliding(1024) for i in range(32)]
    padded = make_kv_cache_config(specs, num_blocks=10)
    assert (len(padded.groups), padded.num_slots, padded.num_padding_layers) == (7, 5, 3)
    for typical in (200, 1024, 2000):
        packed = make_kv_cache_config(specs, num_blocks=10, typical_tokens=typical)
        assert (len(packed.groups), packed.num_slots, packed.num_padding_layers) == (4, 8, 0)
        assert slot_tokens(packed, typical) < slot_tokens(padded, typical)
        whole = [layer for g in packed.groups for layer in g.kept_whole]
        assert len(whole) == 3 and all(specs[layer] == sliding(1024) for layer in whole)
        for g in packed.groups:  # kept whole only in a full-attention group
            assert set(g.kept_whole) <= set(g.layer_ids)
            assert not g.kept_whole or g.spec == full()
            assert all(specs[layer] == g.spec for layer in g.layer_ids if layer not in g.kept_whole)
        assert sorted(x for g in packed.groups for x in g.layer_ids) == list(range(32))
    # Long requests: the padded layout holds them in fewer bytes, and stays.
    long = make_kv_cache_config(specs, num_blocks=10, typical_tokens=20_000)
    assert long.groups == padded.groups
    # A layout without padding is left alone whatever the length (Gemma 3 12B: 8 : 40).
    even = [full() if (i + 1) % 6 == 0 else sliding(1024) for i in range(48)]
    assert (make_kv_cache_config(even, num_blocks=10, typical_tokens=500).groups
            == make_kv_cache_config(even, num_blocks=10).groups)
    # No padding, nothing kept whole: one group of all three would cost as much here.
    few = [full(), sliding(64), sliding(64)]
    assert len(make_kv_cache_config(few, num_blocks=10, typical_tokens=10).groups) == 3
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="typical_tokens"):
            make_kv_cache_config(specs, num_blocks=10, typical_tokens=bad)  # type: ignore[arg-type]


def test_manager_gets_one_sub_manager_per_group() -> None:
    config = make_kv_cache_config(gemma3_layers(26, window=64), num_blocks=50)
    manager = KVCacheManager(config)
    managers = internals(manager).groups
    assert len(managers) == len(config.groups) == 7
    for g, (sub, group) in enumerate(zip(managers, config.groups, strict=True)):
        assert sub.group_id == g
        assert sub.spec == group.spec
        assert isinstance(sub, SlidingWindowManager) == (group.spec.sliding_window is not None)
    assert manager.group_usage() == [0.0] * 7


# ---- sizing from a byte budget -----------------------------------------------------------------


def test_num_blocks_from_memory_budget() -> None:
    specs = gemma3_layers(26)
    page = 2 * BS * HEADS * DIM * 2
    per_block = page * 4  # four slots
    config = make_kv_cache_config(specs, memory_bytes=per_block * 1000)
    assert config.num_blocks == 1000
    assert config.bytes_per_block == per_block
    # The budget is rounded down to whole blocks.
    assert make_kv_cache_config(specs, memory_bytes=per_block * 1000 - 1).num_blocks == 999
    assert make_kv_cache_config(specs, memory_bytes=per_block * 2).num_blocks == 2


def test_memory_budget_uses_slot_count_not_layer_count() -> None:
    # 42 alternating layers: 21 slots, so one block id costs 21 pages, not 42.
    specs: list[KVCacheSpec] = [sliding(4096, torch.bfloat16) if i % 2 == 0 else full(torch.bfloat16)
                                for i in range(42)]
    page = 2 * BS * HEADS * DIM * 2
    config = make_kv_cache_config(specs, memory_bytes=page * 21 * 64)
    assert config.num_blocks == 64


def test_explicit_num_blocks() -> None:
    config = make_kv_cache_config([full()], num_blocks=123)
    assert config.num_blocks == 123


def test_memory_budget_too_small() -> None:
    specs = gemma3_layers(26)
    per_block = 2 * BS * HEADS * DIM * 2 * 4
    with pytest.raises(ValueError, match="at least 2"):
        make_kv_cache_config(specs, memory_bytes=per_block * 2 - 1)
    with pytest.raises(ValueError):
        make_kv_cache_config(specs, memory_bytes=0)


def test_budget_or_count_exactly_one() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        make_kv_cache_config([full()])
    with pytest.raises(ValueError, match="exactly one"):
        make_kv_cache_config([full()], memory_bytes=1 << 20, num_blocks=10)


def test_pool_of_fewer_than_two_blocks_is_rejected() -> None:
    for n in (1, 0, -3):
        with pytest.raises(ValueError):
            KVCacheManager(make_kv_cache_config([full()], num_blocks=n))


# ---- mismatches and bad sizes ------------------------------------------------------------------


def test_mismatched_block_size_names_layers() -> None:
    specs: list[KVCacheSpec] = [full(), sliding(64), full(), SlidingWindowSpec(32, HEADS, DIM, window=64)]
    with pytest.raises(ValueError, match=r"layer 3.*block_size 32.*layer 0.*16"):
        make_kv_cache_config(specs, num_blocks=10)


def test_mismatched_page_size_names_layers() -> None:
    # Same block size, twice the heads: pages twice as large.
    specs: list[KVCacheSpec] = [full(), sliding(64), SlidingWindowSpec(BS, 2 * HEADS, DIM, window=64)]
    with pytest.raises(ValueError, match=r"layer 2.*\b32768\b.*layer 0.*\b16384\b"):
        make_kv_cache_config(specs, num_blocks=10)
    # A dtype change alone changes the page size too.
    with pytest.raises(ValueError, match="layer 1"):
        make_kv_cache_config([full(torch.float16), full(torch.float32)], num_blocks=10)
    # Equal bytes are not enough: the groups share one page tensor per slot, so an fp32 layer
    # with half the heads of an fp16 layer is refused (PagedKVCache would give it fp16 pages).
    with pytest.raises(ValueError, match=r"layer 1 pages are \[16, 2, 64\] float32.*"
                                         r"layer 0 pages are \[16, 4, 64\] float16"):
        make_kv_cache_config(
            [full(torch.float16), FullAttentionSpec(BS, HEADS // 2, DIM, torch.float32)], num_blocks=10)


def test_mismatch_is_raised_for_budget_sizing_too() -> None:
    with pytest.raises(ValueError, match="layer 1"):
        make_kv_cache_config([full(), FullAttentionSpec(8, HEADS, DIM)], memory_bytes=1 << 30)


def test_empty_layer_list() -> None:
    with pytest.raises(ValueError):
        make_kv_cache_config([], num_blocks=10)


@pytest.mark.parametrize("window", [0, -1, -128, 2.5, "8", None])
def test_invalid_window(window: object) -> None:
    with pytest.raises(ValueError, match="window"):
        SlidingWindowSpec(BS, HEADS, DIM, window=window)  # type: ignore[arg-type]


def test_window_is_required() -> None:
    # No default: a sliding spec must say how wide it is.
    with pytest.raises(TypeError, match="window"):
        SlidingWindowSpec(BS, HEADS, DIM)  # type: ignore[call-arg]


@pytest.mark.parametrize("field", ["block_size", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "4", None])
def test_invalid_sizes(field: str, value: object) -> None:
    kwargs: dict[str, object] = {"block_size": BS, "num_kv_heads": HEADS, "head_dim": DIM}
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        FullAttentionSpec(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        SlidingWindowSpec(**kwargs, window=8)  # type: ignore[arg-type]


def test_window_of_one_and_huge_window_are_valid() -> None:
    assert sliding(1).sliding_window == 1
    assert sliding(1 << 20).sliding_window == 1 << 20


def test_bools_and_tiny_block_counts_are_rejected_at_config_time() -> None:
    with pytest.raises(ValueError, match="window"):
        SlidingWindowSpec(4, 1, 8, window=True)
    with pytest.raises(ValueError, match="block_size"):
        FullAttentionSpec(True, 1, 8)
    for bad in (1, 0, -3, 2.5):
        with pytest.raises(ValueError, match="num_blocks"):
            make_kv_cache_config([FullAttentionSpec(4, 1, 8)], num_blocks=bad)


# ---- spec types are siblings; the window rule lives on the spec ---------------------------------


def test_sliding_and_full_specs_are_siblings() -> None:
    assert not isinstance(sliding(8), FullAttentionSpec)
    assert not isinstance(full(), SlidingWindowSpec)
    assert isinstance(sliding(8), AttentionSpec) and isinstance(full(), AttentionSpec)
    with pytest.raises(TypeError, match="base"):
        AttentionSpec(BS, HEADS, DIM)


@pytest.mark.parametrize(("window", "num_computed", "first"), [
    (None, 0, 0), (None, 100, 0),
    (1, 0, 0), (1, 5, 5),  # W = 1: a query sees only itself
    (16, 15, 0), (16, 16, 1), (16, 40, 25),  # W a multiple of the block size
    (1000, 40, 0),  # W longer than the sequence
])
def test_first_needed_position(window: int | None, num_computed: int, first: int) -> None:
    spec = full() if window is None else sliding(window)
    assert spec.first_needed_position(num_computed) == first
    # Pages wholly before the first needed position are not resident.
    assert spec.num_resident_blocks(num_computed, num_computed + 1) == (
        -(-(num_computed + 1) // BS) - first // BS)


def test_manager_type_by_spec_type() -> None:
    pool = BlockPool(4)
    copies = PendingCopies(pool)
    assert type(make_manager(pool, full(), 0, copies)) is MANAGER_TYPES[FullAttentionSpec]
    assert type(make_manager(pool, sliding(8), 1, copies)) is SlidingWindowManager

    @dataclass(frozen=True)
    class OtherSpec(AttentionSpec):
        pass

    with pytest.raises(TypeError, match="OtherSpec"):
        make_manager(pool, OtherSpec(BS, HEADS, DIM), 0, copies)  # type: ignore[arg-type]
