"""One physical KV page and the intrusive free list eviction policies order free pages with."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

#: `KVCacheBlock.hint` of a full-attention page a lookup's verified chain ended at.
BRANCH_POINT = 2
#: `KVCacheBlock.hint` of a full-attention page holding output tokens of the request that
#: cached it (set when that request is freed).
OUTPUT = 3


class KVCacheBlock:
    """One page of the pool: ref count, cached identity, and free-list links."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "pin_cnt",
        "group_id",
        "block_hash",
        "token_ids",
        "serial",
        "parent_serial",
        "prev_free",
        "next_free",
        "uses",
        "orphan",
        "free_tag",
        "hint",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # References held by pending copies (included in ref_cnt).
        self.pin_cnt = 0
        # Group whose layers this page's bytes belong to (set on allocation, kept while cached).
        self.group_id = -1
        # Set while the block is in the full-block hash index.
        self.block_hash: int | None = None
        # The token ids the block holds while it is indexed (full or a finished partial block).
        self.token_ids: tuple[int, ...] | None = None
        # Content identity of a full cached block; equal serials mean equal content and prefix.
        self.serial = 0
        # Serial of the block before it in the request that cached it (or the salt's root serial).
        self.parent_serial = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        # References taken by hits, pins and forks since the page was last allocated.
        self.uses = 0
        # Set when every page holding this page's parent content has been evicted.
        self.orphan = False
        # Which of an eviction policy's free lists holds the page (policy-defined; -1: none).
        self.free_tag = -1
        # Set by a sliding-window group when it frees the page: 1 if it sits within the window
        # before a likely hit end (prompt end, output end, branch point), 0 if not. On a
        # full-attention page, BRANCH_POINT: a lookup's verified chain ended right after it,
        # so hits are likely to end there; OUTPUT: it holds output of the request that cached
        # it. -1 for every other page (reset on allocation).
        self.hint = -1

    @property
    def is_null(self) -> bool:
        """Whether this is the null block (block 0), the placeholder for dropped pages."""
        return self.block_id == 0

    @property
    def is_cached(self) -> bool:
        """Whether the block holds indexed content (full hash entry or partial entry)."""
        return self.token_ids is not None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, group={self.group_id}, "
            f"hash={'-' if self.block_hash is None else hex(self.block_hash)[:10]})"
        )


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks; head is evicted first. `size` is the
    number of blocks in it (read-only outside the queue)."""

    __slots__ = ("_head", "_tail", "size")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.size = 0
        self.extend(list(blocks))

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (the next block to evict)."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("pop from an empty FreeBlockQueue")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first n blocks, in order."""
        if n < 0:
            raise ValueError(f"cannot pop a negative number of blocks ({n})")
        if n > self.size:
            raise IndexError(f"cannot pop {n} blocks from a queue of {self.size}")
        out = []
        node = self._head.next_free
        for _ in range(n):
            assert node is not None
            out.append(node)
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node = nxt
        self._head.next_free = node
        assert node is not None
        node.prev_free = self._head
        self.size -= n
        return out

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        last = self._tail.prev_free
        assert last is not None
        self._splice((block,), last, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block at the head (evicted first)."""
        first = self._head.next_free
        assert first is not None
        self._splice((block,), self._head, first)

    def extend(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the tail, in order (the last of them is evicted last)."""
        last = self._tail.prev_free
        assert last is not None
        self._splice(blocks, last, self._tail)

    def extendleft(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the head, in order (the first of them is evicted first)."""
        first = self._head.next_free
        assert first is not None
        self._splice(blocks, self._head, first)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def _splice(self, blocks: Sequence[KVCacheBlock], prev: KVCacheBlock,
                nxt: KVCacheBlock) -> None:
        """Link blocks not in any queue, in order, between two adjacent nodes."""
        for block in blocks:
            if block.prev_free is not None or block.next_free is not None:
                raise ValueError(f"block {block.block_id} is already in the free queue")
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = nxt
        nxt.prev_free = prev
        self.size += len(blocks)

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.size -= 1
