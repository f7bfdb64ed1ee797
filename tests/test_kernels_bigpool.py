"""Index arithmetic past 2^31 elements: block * stride must be computed in int64.

The pools are views over a *sparse* file mapping (``torch.from_file(shared=True)``): the
address space spans 2^32+ fp16 elements (8 GiB) but only the few pages the test touches
ever get memory or disk. The used blocks sit where ``block * stride`` exceeds 2^32, so an
int32 product wraps to a small offset -- a region filled with NaN: any int32 index math
turns the output into NaN or wrong values instead of passing.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvstore.kernels import (
    AttentionMetadata,
    copy_blocks,
    paged_attention,
    paged_attention_reference,
    write_kv,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)

BS, HKV, D, H = 16, 1, 16, 4
PAGE = BS * HKV * D  # elements per page
POISON = 1 << 21  # elements [0, POISON) of the storage hold NaN


@pytest.fixture
def sparse_storage(tmp_path):
    numel = (1 << 32) + (1 << 22)
    path = tmp_path / "pool.bin"
    flat = torch.from_file(str(path), shared=True, size=numel, dtype=torch.float16)
    flat[:POISON] = float("nan")
    yield flat
    del flat
    path.unlink()


def _fill_pages(cache: torch.Tensor, blocks: list[int], gen: torch.Generator) -> None:
    for b in blocks:
        cache[b] = torch.randn(BS, HKV, D, generator=gen).half()


def _check_attention(kc, vc, blocks_per_seq, q_lens, seq_lens):
    gen = torch.Generator().manual_seed(1)
    width = max(len(b) for b in blocks_per_seq)
    table = torch.tensor([b + [b[-1]] * (width - len(b)) for b in blocks_per_seq],
                         dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(table, cu, sl, max(q_lens))
    q = torch.randn(sum(q_lens), H, D, generator=gen).half()
    ref = paged_attention_reference(q, kc, vc, meta, 1 / math.sqrt(D))
    assert not torch.isnan(ref).any()
    for splits in (1, 2):
        out = paged_attention(q, kc, vc, meta, 1 / math.sqrt(D), num_splits=splits,
                              block_m=16, block_n=16)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)


def test_large_page_stride(sparse_storage):
    """A page stride under 2^31 (passed to the kernel as int32) times a block id > 2^31."""
    stride_b = (1 << 30) + 1024
    nb = 5
    kc = sparse_storage.as_strided((nb, BS, HKV, D), (stride_b, HKV * D, D, 1), 0)
    vc = sparse_storage.as_strided((nb, BS, HKV, D), (stride_b, HKV * D, D, 1), 1 << 20)
    # int32 wrap of block 4: 4 * stride_b - 2^32 = 4096 (K) / 2^20 + 4096 (V): poisoned
    assert 4 * stride_b > 1 << 32 and (4 * stride_b) % (1 << 32) + (1 << 20) < POISON
    gen = torch.Generator().manual_seed(0)
    _fill_pages(kc, [1, 4], gen)
    _fill_pages(vc, [1, 4], gen)
    _check_attention(kc, vc, [[1, 4], [4]], [3, 1], [20, 9])


def test_huge_block_ids(sparse_storage):
    """A dense pool of 2^24+ pages: block ids themselves push offsets past 2^32."""
    nb = (1 << 24) + 8
    pool = sparse_storage[: nb * PAGE].view(nb, BS, HKV, D)
    hi = 1 << 24  # block hi starts at element 2^32: wraps to 0 under int32
    used = [hi + 1, hi + 3, hi + 2]
    gen = torch.Generator().manual_seed(0)
    _fill_pages(pool, used, gen)
    # K and V share the pool (they are any two page tensors; sharing keeps it to 8 GiB).
    _check_attention(pool, pool, [[hi + 1, hi + 3], [hi + 2]], [1, 5], [30, 16])

    # write path and block copy on the same huge ids
    key = torch.randn(3, HKV, D, generator=gen).half()
    slots = torch.tensor([(hi + 5) * BS + 2, -1, (hi + 5) * BS + 7], dtype=torch.int64)
    for backend in ("torch", "triton"):
        write_kv(key, key, pool, pool, slots, backend=backend)
        assert torch.equal(pool[hi + 5, 2], key[0]) and torch.equal(pool[hi + 5, 7], key[2])
        copy_blocks([pool], [(hi + 5, hi + 6)], backend=backend)
        assert torch.equal(pool[hi + 6], pool[hi + 5])
        pool[hi + 5].zero_()
        pool[hi + 6].zero_()
    assert torch.isnan(sparse_storage[:POISON]).all()  # nothing wrapped into the low region
