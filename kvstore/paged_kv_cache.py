"""The device side: K/V page tensors per layer slot, written by slot mapping, copied on write;
with recurrent layers, state tensors carved from the same memory as large pages."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.kernels import copy_blocks, write_kv
from kvstore.request import as_count
from kvstore.specs import KVCacheConfig, RecurrentStateSpec


class PagedKVCache:
    """K and V pages `[num_blocks, block_size, num_kv_heads, head_dim]` for every layer slot.

    Layer `group.layer_ids[j]` of every group uses slot j; groups draw disjoint block
    ids from the one pool, so they never touch each other's pages.

    With recurrent groups (`config.has_recurrent`) every page lives in one byte buffer,
    `[num_blocks, bytes_per_block]`: block b holds K and V of b in every slot, and large
    page j (id `num_blocks + j`) is the bytes of blocks [j*k, (j+1)*k), in which the state
    tensors of every layer of a recurrent group are laid out one after another
    (`state_views`). Attention and states thus share one memory budget, as in the pool."""

    def __init__(self, config: KVCacheConfig, device: torch.device | str = "cpu") -> None:
        spec = config.attention_spec
        self.config = config
        self.dtype = getattr(torch, spec.dtype)
        self.device = torch.device(device)
        self.block_size = spec.block_size
        shape = (config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self._pages: torch.Tensor | None = None  # [num_large, k * bytes_per_block] bytes
        self._state_views: dict[int, tuple[torch.Tensor, ...]] = {}
        if config.has_recurrent:
            self.key_caches, self.value_caches = self._carve(shape)
        else:
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

    def _carve(self, shape: tuple[int, int, int, int]
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Allocate the one byte buffer; return the K and V views of every slot and lay the
        recurrent groups' state tensors out in the large pages."""
        config = self.config
        per_block = config.bytes_per_block
        page = config.page_size_bytes // 2  # K (or V) of one block of one slot
        buffer = torch.zeros(config.num_blocks, per_block, dtype=torch.uint8, device=self.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for s in range(config.num_slots):
            for out, half in ((keys, 0), (values, 1)):
                start = (2 * s + half) * page
                out.append(buffer[:, start:start + page].view(self.dtype).view(shape))
        k = config.large_page_blocks
        pages = buffer.view(config.num_blocks // k, k * per_block)
        self._pages = pages
        for group in config.groups:
            spec = group.spec
            if not isinstance(spec, RecurrentStateSpec):
                continue
            offset = 0
            for layer in group.layer_ids:
                views = []
                for dims, name in zip(spec.shapes, spec.dtypes, strict=True):
                    dtype = getattr(torch, name)
                    item = torch.empty((), dtype=dtype).element_size()
                    offset = -(-offset // item) * item
                    numel = int(np.prod(dims))
                    end = offset + numel * item
                    if end > pages.shape[1]:
                        raise ValueError(f"layer {layer}: the states of its group do not fit a "
                                         f"large page of {pages.shape[1]} bytes once aligned")
                    views.append(pages[:, offset:end].view(dtype).view(pages.shape[0], *dims))
                    offset = end
                self._state_views[layer] = tuple(views)
        return keys, values

    @property
    def num_bytes(self) -> int:
        """Bytes held by all page tensors."""
        if self._pages is not None:
            return self._pages.numel()
        return sum(t.numel() * t.element_size() for t in self.key_caches + self.value_caches)

    def state_views(self, layer: int, page_id: int) -> tuple[torch.Tensor, ...]:
        """The state tensors (`RecurrentStateSpec.shapes`) of recurrent `layer` in large page
        `page_id` (a pool id, `num_blocks + j`): views, written in place by the model.
        ValueError for an attention layer or an id that is no large page."""
        views = self._state_views.get(layer)
        if views is None:
            self._lookup(layer)
            raise ValueError(f"layer {layer} keeps no recurrent state in this cache")
        j = self._large_index(page_id, "page_id")
        return tuple(v[j] for v in views)

    def _large_index(self, page_id: object, name: str) -> int:
        """j of large page id `num_blocks + j` (never the null block's page 0)."""
        if isinstance(page_id, (bool, np.bool_)) or not isinstance(page_id, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(page_id).__name__} {page_id!r}")
        assert self._pages is not None
        n = self.config.num_blocks
        j = int(page_id) - n
        if not 1 <= j < self._pages.shape[0]:
            raise ValueError(f"{name} {page_id} is not a large page of this cache "
                             f"({n + 1} to {n + self._pages.shape[0] - 1})")
        return j

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
        num_blocks - 1 (block 0 is the null block), or, with recurrent groups, a large page
        (`num_blocks + 1` on), copied whole onto another large page in the batch's order; a
        block destination may appear once and may not also be a block source; a batch
        another manager than the bound one (`bind`) handed out is refused. ValueError or
        TypeError otherwise, before anything is copied."""
        issuer = getattr(pairs, "issuer", None)
        if issuer is not None and self.owner is not None and issuer is not self.owner:
            raise ValueError("these copies were handed out by another manager than the one "
                             "this device cache is bound to")
        checked = self._check_pairs(pairs)
        if not checked:
            return
        n = self.config.num_blocks
        small = [(s, d) for s, d in checked if s < n]
        if small:
            copy_blocks(list(zip(self.key_caches, self.value_caches, strict=True)), small)
        if self._pages is not None:
            for src, dst in checked:
                if src >= n:
                    self._pages[dst - n].copy_(self._pages[src - n])
        self.copies_executed += len(checked)

    def _check_pairs(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        if isinstance(pairs, torch.Tensor):
            pairs = pairs.tolist()
        num_blocks = self.config.num_blocks
        num_large = 0 if self._pages is None else self._pages.shape[0]
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
                if not (1 <= value < num_blocks or num_blocks < value < num_blocks + num_large):
                    raise ValueError(f"copy {k}: {name} block id {value} is not a page of this "
                                     f"cache (1 to {num_blocks - 1}; 0 is the null block"
                                     + (f"; large pages {num_blocks + 1} to "
                                        f"{num_blocks + num_large - 1}" if num_large else "")
                                     + ")")
                ids.append(int(value))
            if (ids[0] < num_blocks) != (ids[1] < num_blocks):
                raise ValueError(f"copy {k}: {ids[0]} -> {ids[1]} copies between a block and a "
                                 "large page")
            out.append((ids[0], ids[1]))
        return out

    def gather(self, layer: int, block_ids: Sequence[int], start: int, end: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end) of a sequence with this block table (0 <=
        start <= end <= the table's tokens; ValueError otherwise, or for an id that is not a
        block of this cache)."""
        k_cache, v_cache = self.layer_caches(layer)
        ids = [as_count(b) for b in block_ids]
        first, last = as_count(start), as_count(end)
        if first is None or last is None or not 0 <= first <= last <= len(ids) * self.block_size:
            raise ValueError(f"positions [{start!r}, {end!r}) are not in a table of {len(ids)} "
                             f"blocks of {self.block_size} tokens")
        for given, i in zip(block_ids, ids, strict=True):
            if i is None or not 0 <= i < k_cache.shape[0]:
                raise ValueError(f"block id {given!r} is not a block of this cache (0 to "
                                 f"{k_cache.shape[0] - 1})")
        pos = torch.arange(first, last, device=self.device)
        blocks = torch.as_tensor(ids, device=self.device)[pos // self.block_size]
        offs = pos % self.block_size
        return k_cache[blocks, offs], v_cache[blocks, offs]

    def _lookup(self, layer: int) -> tuple[int, int]:
        try:
            return self.layer_to_group_slot[layer]
        except KeyError:
            raise ValueError(f"layer {layer} is not in this cache (layers "
                             f"0..{len(self.layer_to_group_slot) - 1})") from None
