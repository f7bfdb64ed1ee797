"""Test-case builders shared by the kernel tests and the benchmark's GPU ``--check`` mode.

A case is a batch of sequences laid out in a paged pool the way the cache manager would:
each sequence gets distinct random blocks, pages wholly before every query's window hold
the null block 0 in the table, and *every* position that is not legitimately readable
(block 0, unused blocks, slots past ``seq_len``, slots before the window) is NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .metadata import AttentionMetadata
from .reference import visible_key_range


@dataclass
class Case:
    """One poisoned paged batch and the attention arguments that go with it."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metadata: AttentionMetadata
    scale: float
    window: int | None
    softcap: float | None
    sinks: torch.Tensor | None = None
    chunk: int | None = None

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float]:
        """The positional arguments of the attention functions: q, caches, metadata, scale."""
        return (self.q, self.key_cache, self.value_cache, self.metadata, self.scale)

    def kwargs(self) -> dict[str, Any]:
        """The per-layer keyword arguments of the attention functions: window, softcap, sinks
        and chunk."""
        return {"window": self.window, "softcap": self.softcap, "sinks": self.sinks,
                "chunk": self.chunk}


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None = None,
    softcap: float | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
    poison_in_table: bool = False,
    q_scale: float = 1.0,
    with_sinks: bool = False,
    sink_scale: float = 3.0,
    chunk: int | None = None,
) -> Case:
    """Build a poisoned paged batch. With ``poison_in_table`` the pages wholly before the
    window point at real NaN-filled blocks instead of the null block. With ``with_sinks``
    the case carries per-head sink logits ``sink_scale * N(0, 1)`` in ``dtype`` (drawn after
    everything else, so the rest of the case is the same as without). ``chunk`` limits each
    query to its chunk, as the window does (pages wholly before the first query's chunk
    are dropped)."""
    assert len(q_lens) == len(seq_lens)
    g = torch.Generator().manual_seed(seed)
    pages = [math.ceil(s / block_size) for s in seq_lens]
    width = max(pages) + 1  # a spare column: an unused entry past the last page
    num_blocks = 1 + sum(pages) + 3  # null block, every page, three never-used blocks
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = torch.full(shape, float("nan"), dtype=torch.float32)
    vc = torch.full(shape, float("nan"), dtype=torch.float32)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    unused = perm[sum(pages):]
    nxt = 0
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        lo, hi = visible_key_range(sl, ql, window, chunk)
        for p in range(pages[i]):
            blk = perm[nxt]
            nxt += 1
            if (p + 1) * block_size <= lo and not poison_in_table:
                continue  # dropped page: the table holds the null block, the block stays NaN
            table[i, p] = blk
            first = max(p * block_size, lo)
            last = min((p + 1) * block_size, hi)
            if first < last:
                n = last - first
                off = first - p * block_size
                kc[blk, off:off + n] = torch.randn(n, num_kv_heads, head_dim, generator=g)
                vc[blk, off:off + n] = torch.randn(n, num_kv_heads, head_dim, generator=g)
        table[i, pages[i]:] = unused[i % len(unused)]  # past the end: a NaN block
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=g) * q_scale
    sinks = None
    if with_sinks:
        sinks = (torch.randn(num_heads, generator=g) * sink_scale).to(dtype).to(device)
    return Case(
        q=q.to(dtype).to(device),
        key_cache=kc.to(dtype).to(device),
        value_cache=vc.to(dtype).to(device),
        metadata=AttentionMetadata(
            block_table=table.to(device),
            cu_seqlens_q=cu.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            max_seqlen_q=max(q_lens),
        ),
        scale=1.0 / math.sqrt(head_dim),
        window=window,
        softcap=softcap,
        sinks=sinks,
        chunk=chunk,
    )


# Length mixes (q_lens, seq_lens).
DECODE = ([1, 1, 1, 1], [37, 1, 64, 90])
MIXED = ([1, 9, 20, 0], [70, 30, 20, 5])  # decode, prefill over a prefix, full prefill, idle
RAGGED = ([3, 17, 1, 5], [3, 45, 70, 33])

# (name, lens, heads, kv_heads, head_dim, block_size, window, softcap, splits, dtype,
#  block_m, block_n). Each axis value appears in several cases; not the full product.
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
GRID = [
    ("dec-full-r1", DECODE, 4, 4, 64, 16, None, None, 1, f32, None, None),
    ("dec-w1-r4", DECODE, 8, 2, 64, 16, 1, None, 1, f32, None, 16),
    ("dec-w15-r5-split", DECODE, 10, 2, 80, 16, 15, None, 3, f32, None, 16),
    ("dec-w16-cap-bf16", DECODE, 8, 2, 64, 16, 16, 2.0, 1, bf16, None, 16),
    ("dec-w17-split-f16", DECODE, 4, 4, 80, 16, 17, None, 2, f16, None, 16),
    ("dec-w20-bs32-split4", DECODE, 10, 2, 64, 32, 20, 2.0, 4, f32, None, 16),
    ("dec-wlong-bs32", DECODE, 8, 2, 80, 32, 1000, None, 1, bf16, None, None),
    ("mix-full-r4", MIXED, 8, 2, 64, 16, None, None, 1, f32, None, None),
    ("mix-w1-r5", MIXED, 10, 2, 64, 16, 1, 2.0, 1, f32, 16, 16),
    ("mix-w31-bs32-split", MIXED, 8, 2, 64, 32, 31, None, 2, f16, 16, 16),
    ("mix-w32-bs32-r1", MIXED, 4, 4, 80, 32, 32, None, 1, f32, 16, 32),
    ("mix-w33-bs32-cap", MIXED, 8, 2, 80, 32, 33, 2.0, 1, bf16, None, 32),
    ("mix-w20-r5-split3", MIXED, 10, 2, 80, 16, 20, None, 3, f32, None, 16),
    ("mix-wlong-cap-f16", MIXED, 4, 4, 64, 16, 1000, 2.0, 1, f16, None, None),
    ("rag-w15-r4", RAGGED, 8, 2, 64, 16, 15, None, 1, f32, 16, 16),
    ("rag-w16-r5-f16", RAGGED, 10, 2, 64, 16, 16, None, 2, f16, 32, 16),
    ("rag-w17-cap-split", RAGGED, 4, 4, 64, 16, 17, 2.0, 3, f32, 16, 32),
    ("rag-full-bs32-bf16", RAGGED, 8, 2, 80, 32, None, None, 2, bf16, None, 16),
    ("rag-w1-bs32-r1", RAGGED, 4, 4, 64, 32, 1, None, 1, f16, None, 32),
    ("rag-w45-bs32-r5", RAGGED, 10, 2, 80, 32, 45, 2.0, 1, f32, None, 64),
]

TOL = {
    # interpreter / fp32 math: only the output rounding differs from the reference
    "cpu": {f32: (2e-5, 2e-5), f16: (2e-3, 2e-3), bf16: (1.6e-2, 1.6e-2)},
    # compiled GPU: 16-bit tensor-core dots with P rounded to the value dtype
    "cuda": {f32: (1e-4, 1e-4), f16: (4e-3, 4e-3), bf16: (3e-2, 3e-2)},
}


def tolerance(dtype: torch.dtype, device: torch.device | str) -> tuple[float, float]:
    """(atol, rtol) for comparing a kernel output of ``dtype`` with the reference."""
    kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
    return TOL[kind][dtype]

# The grid's windowed cases with the window's size as a chunk instead (chunks 1, below, at
# and past the block size, and longer than every sequence): CHUNK_GRID has GRID's columns,
# the seventh being the chunk.
CHUNK_GRID = [(name.replace("-w", "-c", 1), *rest[:5], window, *rest[6:])
              for name, *rest in GRID if (window := rest[5]) is not None]


def make_mla_case(q_lens: list[int], seq_lens: list[int], num_heads: int, rank: int, rope: int,
                  block_size: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                  device: str | torch.device = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """An MLA batch ``(q_latent, q_rope, key pages, value pages, metadata)``: latents of
    ``rank + rope`` elements paged as :class:`kvstore.MLASpec` lays them out, with every
    position no query may read (null block, unused blocks, slots past ``seq_len``) NaN."""
    from .mla import split_latent

    g = torch.Generator().manual_seed(seed)
    half = (rank + rope) // 2
    pages = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(pages) + 2
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    kc = torch.full((num_blocks, block_size, 1, half), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    table = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
    nxt = 0
    for i, sl in enumerate(seq_lens):
        for p in range(pages[i]):
            blk = perm[nxt]
            nxt += 1
            table[i, p] = blk
            n = min(block_size, sl - p * block_size)
            k, v = split_latent(torch.randn(n, rank + rope, generator=g))
            kc[blk, :n], vc[blk, :n] = k, v
        table[i, pages[i]:] = perm[-1]  # past the end: a NaN block
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    total = int(cu[-1])
    q_latent = torch.randn(total, num_heads, rank, generator=g).to(dtype)
    q_rope = torch.randn(total, num_heads, rope, generator=g).to(dtype)
    md = AttentionMetadata(table.to(device), cu.to(device),
                           torch.tensor(seq_lens, dtype=torch.int32, device=device), max(q_lens))
    return (q_latent.to(device), q_rope.to(device), kc.to(dtype).to(device), vc.to(dtype).to(device), md)


MLA_DECODE = ([1, 1, 1, 0, 1], [37, 1, 64, 5, 90])  # one sequence idle
# (heads, kv_lora_rank, rope_dim, block size, dtype, block_n): MLA decode cases for the
# interpreter; the GPU check adds DeepSeek-V3's shapes (rank 512, rope 64).
MLA_GRID = [
    (1, 12, 4, 4, f32, 16), (4, 16, 8, 16, f32, 32), (16, 32, 16, 16, f32, 16),
    (5, 24, 8, 8, f16, 32), (8, 48, 16, 16, bf16, 64), (20, 28, 4, 4, f32, 16),
    (128, 48, 16, 16, f32, 32),
]
