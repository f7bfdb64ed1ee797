"""The device side: K/V page tensors per layer slot, written by slot mapping, copied on write."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.kernels import copy_blocks, write_kv
from kvstore.specs import KVCacheConfig


class PagedKVCache:
    """K and V pages `[num_blocks, block_size, num_kv_heads, head_dim]` for every layer slot.

    Layer `group.layer_ids[j]` of every group uses slot j; groups draw disjoint block
    ids from the one pool, so they never touch each other's pages."""

    def __init__(self, config: KVCacheConfig, device: torch.device | str = "cpu") -> None:
        spec = config.attention_spec
        self.config = config
        self.dtype = getattr(torch, spec.dtype)
        self.device = torch.device(device)
        self.block_size = spec.block_size
        shape = (config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.key_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                           for _ in range(config.num_slots)]
        self.value_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                             for _ in range(config.num_slots)]
        self.layer_to_group_slot = config.layer_to_group_slot()
        self.copies_executed = 0
        # The manager whose copy batches this cache runs (`bind`); None: any.
        self.owner: object | None = None

    def bind(self, manager: object) -> None:
        """Run only the copy batches `manager` hands out (`take_pending_copies`) from now on;
        ValueError if another manager is bound already."""
        if self.owner is not None and self.owner is not manager:
            raise ValueError("this device cache already runs another manager's copies")
        self.owner = manager

    @property
    def num_bytes(self) -> int:
        """Bytes held by all page tensors."""
        return sum(t.numel() * t.element_size() for t in self.key_caches + self.value_caches)

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of a layer."""
        _, slot = self._lookup(layer)
        return self.key_caches[slot], self.value_caches[slot]

    def group_of(self, layer: int) -> int:
        """The KV cache group a layer belongs to."""
        return self._lookup(layer)[0]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store K/V `[T, num_kv_heads, head_dim]` at slots `block * block_size + offset`
        (negative = padding, skipped)."""
        k_cache, v_cache = self.layer_caches(layer)
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy page src onto page dst in every layer slot, for each (src, dst).

        Every id must be an int (not a bool or a float) naming a real page, 1 to
        num_blocks - 1 (block 0 is the null block); a destination may appear once and may not
        also be a source; a batch another manager than the bound one (`bind`) handed out is
        refused. ValueError or TypeError otherwise, before anything is copied."""
        issuer = getattr(pairs, "issuer", None)
        if issuer is not None and self.owner is not None and issuer is not self.owner:
            raise ValueError("these copies were handed out by another manager than the one "
                             "this device cache is bound to")
        checked = self._check_pairs(pairs)
        if not checked:
            return
        copy_blocks(list(zip(self.key_caches, self.value_caches, strict=True)), checked)
        self.copies_executed += len(checked)

    def _check_pairs(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        if isinstance(pairs, torch.Tensor):
            pairs = pairs.tolist()
        num_blocks = self.config.num_blocks
        out = []
        for k, pair in enumerate(pairs):
            if isinstance(pair, torch.Tensor):
                pair = pair.tolist()
            try:
                src, dst = pair
            except (TypeError, ValueError):
                raise ValueError(f"copy {k}: expected a (src, dst) pair of block ids, got "
                                 f"{pair!r:.60}") from None
            ids = []
            for name, value in (("src", src), ("dst", dst)):
                if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                    raise TypeError(f"copy {k}: {name} block id must be an int, got "
                                    f"{type(value).__name__} {value!r}")
                if not 1 <= value < num_blocks:
                    raise ValueError(f"copy {k}: {name} block id {value} is not a page of this "
                                     f"cache (1 to {num_blocks - 1}; 0 is the null block)")
                ids.append(int(value))
            out.append((ids[0], ids[1]))
        return out

    def gather(self, layer: int, block_ids: Sequence[int], start: int, end: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end) of a sequence with this block table."""
        k_cache, v_cache = self.layer_caches(layer)
        pos = torch.arange(start, end, device=self.device)
        blocks = torch.as_tensor(list(block_ids), device=self.device)[pos // self.block_size]
        offs = pos % self.block_size
        return k_cache[blocks, offs], v_cache[blocks, offs]

    def _lookup(self, layer: int) -> tuple[int, int]:
        try:
            return self.layer_to_group_slot[layer]
        except KeyError:
            raise ValueError(f"layer {layer} is not in this cache (layers "
                             f"0..{len(self.layer_to_group_slot) - 1})") from None
