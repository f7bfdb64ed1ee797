"""write_kv and copy_blocks: bit-exact against Python references, on both backends."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvstore.kernels import copy_blocks, write_kv
from kvstore.kernels.reference import copy_blocks_reference, write_kv_reference

HAS_KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """View as integers so NaN payloads and signed zeros compare exactly."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def _pool(nb, bs, hkv, d, dtype, seed, layout="nbhd"):
    g = torch.Generator().manual_seed(seed)
    if layout == "nbhd":
        return torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    # head-major storage seen through a [nb, bs, hkv, d] view (non-contiguous)
    return torch.randn(nb, hkv, bs, d, generator=g).to(dtype).permute(0, 2, 1, 3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nbhd", "nhbd"])
def test_write_kv_exact(backend, dtype, layout):
    nb, bs, hkv, d, t = 6, 16, 2, 80, 23
    kc, vc = _pool(nb, bs, hkv, d, dtype, 0, layout), _pool(nb, bs, hkv, d, dtype, 1, layout)
    g = torch.Generator().manual_seed(2)
    key = torch.randn(t, hkv, d, generator=g).to(dtype)
    value = torch.randn(t, hkv, d, generator=g).to(dtype)
    key[0, 0, 0] = float("nan")  # values are moved, not computed on
    key[1, 0, 0] = -0.0
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[[3, 9, 15]] = -1  # padding tokens
    ek, ev = kc.clone(), vc.clone()
    write_kv_reference(key, value, ek, ev, slots)
    write_kv(key, value, kc, vc, slots.int() if backend == "triton" else slots, backend=backend)
    assert torch.equal(_bits(kc), _bits(ek)) and torch.equal(_bits(vc), _bits(ev))


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_all_padding_and_empty(backend):
    kc, vc = _pool(3, 16, 1, 16, torch.float16, 0), _pool(3, 16, 1, 16, torch.float16, 1)
    before = kc.clone(), vc.clone()
    key = torch.randn(4, 1, 16).half()
    write_kv(key, key, kc, vc, torch.full((4,), -1), backend=backend)
    write_kv(key[:0], key[:0], kc, vc, torch.zeros(0, dtype=torch.long), backend=backend)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_write_kv_rejects_bad_input():
    kc = vc = torch.zeros(3, 16, 2, 16)
    key = torch.zeros(2, 2, 16)
    with pytest.raises(TypeError, match="dtype"):
        write_kv(key.half(), key.half(), kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="fit"):
        write_kv(torch.zeros(2, 1, 16), torch.zeros(2, 1, 16), kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(key, key, kc, vc, torch.tensor([0]))
    with pytest.raises(IndexError, match="slot"):
        write_kv(key, key, kc, vc, torch.tensor([0, 48]))
    with pytest.raises(TypeError, match="int32 or int64"):
        write_kv(key, key, kc, vc, torch.tensor([0.0, 1.0]))


def test_write_kv_refuses_repeated_slots_and_empty_pages_on_cpu():
    """A repeated slot let the last write win; block_size 0 divided by zero."""
    kc, vc = torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8)
    key = torch.randn(3, 1, 8)
    for backend in ("torch", "triton") if HAS_KERNELS else ("torch",):
        with pytest.raises(ValueError, match=r"repeats slot\(s\) \[4\]"):
            write_kv(key, key, kc, vc, torch.tensor([4, 4, 5]), backend=backend)
    assert not kc.any() and not vc.any()  # refused before anything was written
    write_kv(key, key, kc, vc, torch.tensor([-1, -1, 5]))  # padding may repeat
    empty = torch.zeros(3, 0, 1, 8)
    with pytest.raises(ValueError, match="block_size >= 1"):
        write_kv(key, key, empty, empty, torch.tensor([-1, -1, -1]))


def test_copy_blocks_ids_are_ints_and_pairs_are_pairs():
    """(1.7, 2) copied block 1; a 3-tuple failed to unpack. Checked as PagedKVCache does."""
    caches = _layers(1, torch.float32)
    before = [t.clone() for kv in caches for t in kv]
    for bad in ([(1.7, 2)], [(True, 2)], [(1, "2")], torch.tensor([[1.0, 2.0]])):
        with pytest.raises(TypeError, match="copy 0: block ids must be ints"):
            copy_blocks(caches, bad)
    for bad in ([(1, 2, 3)], [(1,)], [5], [(3, 4), "ab"]):
        with pytest.raises(ValueError, match=r"copy \d: expected a \(src, dst\) pair"):
            copy_blocks(caches, bad)
    assert all(torch.equal(a, b) for a, b in zip([t for kv in caches for t in kv], before,
                                                 strict=True))
    copy_blocks(caches, [(np.int64(2), np.int32(5)), torch.tensor([3, 6])])
    assert torch.equal(caches[0][0][5], before[0][2]) and torch.equal(caches[0][1][6], before[1][3])


def _layers(n, dtype, seed=0):
    return [(_pool(10, 16, 2, 16, dtype, seed + 2 * i), _pool(10, 16, 2, 16, dtype, seed + 2 * i
                                                              + 1)) for i in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_exact_pairs_of_layers(backend, dtype):
    caches = _layers(3, dtype)
    caches[0][0][2, 0, 0, 0] = float("nan")
    pairs = [(2, 5), (3, 6), (2, 9), (1, 0)]
    expected = [t.clone() for kv in caches for t in kv]
    copy_blocks_reference(expected, pairs)
    copy_blocks(caches, pairs, backend=backend)
    got = [t for kv in caches for t in kv]
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_flat_list_mixed_dtypes_and_layouts(backend):
    """A flat tensor list mixing dtypes and a strided-page layout, pairs given as a tensor."""
    tensors = [
        _pool(10, 16, 2, 16, torch.float32, 0),
        _pool(10, 16, 2, 16, torch.bfloat16, 1),
        _pool(10, 16, 2, 16, torch.float16, 2, layout="nhbd"),
        torch.randn(12, 16, 2, 16)[:10],  # extra blocks beyond the pool: a sliced view
        torch.randn(10, 16, 4, 16)[:, :, :2],  # pages with holes: not one dense run
    ]
    pairs = torch.tensor([[4, 7], [8, 1]])
    expected = [t.clone() for t in tensors]
    copy_blocks_reference(expected, pairs.tolist())
    copy_blocks(tensors, pairs, backend=backend)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(tensors, expected, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_rejects_hazards(backend):
    caches = _layers(2, torch.float16)
    before = [t.clone() for kv in caches for t in kv]
    with pytest.raises(ValueError, match="duplicate destination"):
        copy_blocks(caches, [(1, 3), (2, 3)], backend=backend)
    with pytest.raises(ValueError, match="both a source and a destination"):
        copy_blocks(caches, [(1, 2), (2, 3)], backend=backend)
    with pytest.raises(ValueError, match="both a source and a destination"):
        copy_blocks(caches, [(4, 4)], backend=backend)
    with pytest.raises(ValueError, match=r"in \[0, 10\)"):
        copy_blocks(caches, [(1, 10)], backend=backend)
    with pytest.raises(ValueError, match=r"in \[0, 10\)"):
        copy_blocks(caches, [(-1, 3)], backend=backend)
    with pytest.raises(TypeError, match="caches"):
        copy_blocks([3], [(1, 2)], backend=backend)
    # nothing moved on any rejection; empty batches are no-ops
    copy_blocks(caches, [], backend=backend)
    assert all(torch.equal(a, b) for a, b in
               zip([t for kv in caches for t in kv], before, strict=True))
