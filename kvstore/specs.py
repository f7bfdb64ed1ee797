"""KV cache specs per layer type, and the grouping of a model's layers over one shared pool."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any, Literal

from kvstore.request import as_count
from kvstore.utils import cdiv

#: A computed count no request reaches: where a page that never leaves the window leaves it.
NEVER = 1 << 62

# Bytes per element of the page dtypes a cache can hold, by torch's dtype name. The specs
# keep the name, so the bookkeeping core never imports torch.
DTYPE_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
                  "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_name(dtype: Any) -> str:
    """The name of a page dtype given as a torch dtype or its name (``torch.bfloat16``,
    ``"bfloat16"``); ValueError for a dtype a cache cannot hold."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"unsupported KV cache dtype {dtype!r}; expected one of {sorted(DTYPE_ITEMSIZE)}")
    return name


@dataclass(frozen=True)
class AttentionSpec:
    """The page layout every layer type shares. ``dtype`` is a torch dtype or its name; it
    is stored as the name (``"float16"``)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        if type(self) is AttentionSpec:
            raise TypeError("AttentionSpec is a base: use FullAttentionSpec, SlidingWindowSpec "
                            "or ChunkedLocalAttentionSpec")
        for name in ("block_size", "num_kv_heads", "head_dim"):
            _positive_field(self, name)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def sliding_window(self) -> int | None:
        """The window W, or None for a layer that attends to the whole context."""
        raise NotImplementedError

    @property
    def attention_chunk(self) -> int | None:
        """The chunk C of a chunked local layer, None for any other layer."""
        return None

    @property
    def local_span(self) -> int | None:
        """Most positions before and at a query that it attends (the window W or the chunk
        C), None for a layer that attends to the whole context."""
        return self.sliding_window

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: K and V."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_ITEMSIZE[self.dtype]

    def first_needed_position(self, num_computed_tokens: int) -> int:
        """The earliest position the next query (at `num_computed_tokens`) attends; pages
        wholly before it can be freed."""
        raise NotImplementedError

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """The first block the next query (at `num_computed_tokens`) attends; blocks before
        it are out of the window."""
        raise NotImplementedError

    def leaves_window_at(self, block_index: int) -> int:
        """The smallest computed count whose first needed block is past block
        `block_index` (from it on the page is out of the window; `NEVER` for full
        attention)."""
        raise NotImplementedError

    def hit_end_range(self, end: int) -> tuple[int, int]:
        """Table indexes [start, stop) of the pages a hit ending at `end` tokens (or at the
        block boundary before it) needs in a group of this spec, and the page holding `end`
        itself."""
        bs = self.block_size
        return self.first_needed_block(end // bs * bs), -(-end // bs)

    def resident_span(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most token positions a request of up to `num_tokens` tokens, growing by at most
        `max_step_tokens` a step, keeps pages for at once in a group of this spec."""
        raise NotImplementedError

    def num_resident_blocks(self, num_computed_tokens: int, num_tokens: int) -> int:
        """Pages a request of `num_tokens` tokens holds in a group of this spec once its next
        query is at `num_computed_tokens`."""
        return cdiv(num_tokens, self.block_size) - self.first_needed_block(num_computed_tokens)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """A layer that keeps every token's K/V."""

    @property
    def sliding_window(self) -> int | None:
        """None: attends to the whole context."""
        return None

    def first_needed_position(self, num_computed_tokens: int) -> int:
        """0: every position stays visible."""
        return 0

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """0: every block stays visible."""
        return 0

    def leaves_window_at(self, block_index: int) -> int:
        """`NEVER`: every page stays visible."""
        return NEVER

    def resident_span(self, num_tokens: int, max_step_tokens: int) -> int:
        """Every position: `num_tokens`."""
        return num_tokens


@dataclass(frozen=True)
class MLASpec(FullAttentionSpec):
    """A multi-head latent attention layer (DeepSeek-V2/V3): every token keeps one
    compressed latent of `kv_lora_rank + rope_dim` elements, shared by all query heads,
    instead of K and V per head. The full-attention manager serves it.

    The latent fills one slot's K and V pages as one head of half its size: elements
    [0, latent / 2) in the K page, the rest in the V page, so a page holds exactly
    `block_size` latents and groups with other layers by the pool's rules (one page shape).
    `num_kv_heads` is 1 and `head_dim` half the latent; both are derived (given, they must
    agree). ValueError for an odd latent (it does not fill the two halves)."""

    num_kv_heads: int = 1
    head_dim: int = 0
    kv_lora_rank: int = field(kw_only=True)
    rope_dim: int = field(kw_only=True)

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "rope_dim"):
            _positive_field(self, name)
        latent = self.kv_lora_rank + self.rope_dim
        if latent % 2:
            raise ValueError(f"MLASpec: a latent of {latent} elements (kv_lora_rank "
                             f"{self.kv_lora_rank} + rope_dim {self.rope_dim}) does not fit the "
                             "page: it is stored as two halves and must be even")
        if self.num_kv_heads != 1 or self.head_dim not in (0, latent // 2):
            raise ValueError(f"MLASpec: num_kv_heads {self.num_kv_heads!r} and head_dim "
                             f"{self.head_dim!r} must be 1 and half the latent ({latent // 2})")
        object.__setattr__(self, "head_dim", latent // 2)
        super().__post_init__()

    @property
    def latent_dim(self) -> int:
        """Elements of one token's latent: `kv_lora_rank + rope_dim`."""
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A layer whose query at q attends keys q - W < k <= q."""

    window: int = field(kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_field(self, "window")

    @property
    def sliding_window(self) -> int | None:
        """The window W."""
        return self.window

    def first_needed_position(self, num_computed_tokens: int) -> int:
        """The query at q attends q - W < k <= q."""
        return max(0, num_computed_tokens - self.window + 1)

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """The block of the first position the query at q attends, q - W + 1."""
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def leaves_window_at(self, block_index: int) -> int:
        """The next query is past the block's last position by the window."""
        return (block_index + 1) * self.block_size + self.window - 1

    def resident_span(self, num_tokens: int, max_step_tokens: int) -> int:
        """The window, one step and one partly filled block, at most `num_tokens`."""
        return min(num_tokens, self.window + max_step_tokens + self.block_size)


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """A layer whose query at q attends keys floor(q / C) * C <= k <= q: the positions are
    cut into chunks of C and a query sees its own chunk up to itself (Llama 4). C need not
    be a multiple of the block size."""

    chunk: int = field(kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_field(self, "chunk")

    @property
    def sliding_window(self) -> int | None:
        """None: the key range starts at the query's chunk, not a fixed distance back."""
        return None

    @property
    def attention_chunk(self) -> int | None:
        """The chunk C."""
        return self.chunk

    @property
    def local_span(self) -> int | None:
        """The chunk C."""
        return self.chunk

    def first_needed_position(self, num_computed_tokens: int) -> int:
        """The start of the next query's chunk."""
        return num_computed_tokens // self.chunk * self.chunk

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """The block holding the start of the next query's chunk."""
        return num_computed_tokens // self.chunk * self.chunk // self.block_size

    def leaves_window_at(self, block_index: int) -> int:
        """The first chunk start past the block's last position."""
        return -(-(block_index + 1) * self.block_size // self.chunk) * self.chunk

    def resident_span(self, num_tokens: int, max_step_tokens: int) -> int:
        """A chunk, one step and one partly filled block, at most `num_tokens`."""
        return min(num_tokens, self.chunk + max_step_tokens + self.block_size)


@dataclass(frozen=True)
class RecurrentStateSpec:
    """A recurrent layer (linear attention, state-space, short convolution): no K/V per
    token, one fixed-size state per sequence, overwritten in place at every token.

    `shapes` are the layer's state tensors (e.g. a convolution state and a matrix state) and
    `dtypes` their dtypes (one per shape, or one for all); `block_size` is the token grid of
    the cache, on which checkpoints (copies of the state at a block boundary) are taken. A
    page of a recurrent group holds one state of every layer of the group."""

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...] = ("float16",)

    def __post_init__(self) -> None:
        _positive_field(self, "block_size")
        if not isinstance(self.shapes, (tuple, list)) or not self.shapes:
            raise ValueError(f"RecurrentStateSpec.shapes needs at least one state shape, got "
                             f"{self.shapes!r}")
        for shape in self.shapes:
            if not isinstance(shape, (tuple, list)) or not shape or not all(
                    _is_int(d) and d > 0 for d in shape):
                raise ValueError(f"RecurrentStateSpec: state shape {shape!r} must be a non-empty "
                                 "tuple of positive ints (shapes is a tuple of them: ((3, 5),) "
                                 "for one state)")
        shapes = tuple(tuple(shape) for shape in self.shapes)
        dtypes = (tuple(self.dtypes) if isinstance(self.dtypes, (tuple, list))
                  else (self.dtypes,))  # one name or torch dtype for every state
        if len(dtypes) == 1:
            dtypes = dtypes * len(shapes)
        if len(dtypes) != len(shapes):
            raise ValueError(f"RecurrentStateSpec: {len(dtypes)} dtypes for {len(shapes)} state "
                             "shapes (give one, or one per shape)")
        object.__setattr__(self, "shapes", tuple(tuple(int(d) for d in s) for s in shapes))
        object.__setattr__(self, "dtypes", tuple(dtype_name(d) for d in dtypes))

    @property
    def sliding_window(self) -> int | None:
        """0: a recurrent layer sees no past token's K/V, only its state."""
        return 0

    @property
    def state_bytes(self) -> int:
        """Bytes of one state of one layer (every state tensor)."""
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            n = DTYPE_ITEMSIZE[dtype]
            for d in shape:
                n *= d
            total += n
        return total

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Past every block: the state carries everything before the next query."""
        return NEVER

    def resident_span(self, num_tokens: int, max_step_tokens: int) -> int:
        """0: no page per token position."""
        return 0

    def num_resident_blocks(self, num_computed_tokens: int, num_tokens: int) -> int:
        """0 small pages (the working state is one large page, counted apart)."""
        return 0


#: The kinds of KV cache groups: full attention, sliding window, recurrent state.
GroupKind = Literal["full", "sliding", "recurrent"]
#: The specs of layers that keep K/V pages per token.
KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | MLASpec
#: The specs of layers whose key range starts at a function of the query position.
LocalAttentionSpec = SlidingWindowSpec | ChunkedLocalAttentionSpec
#: The spec of any layer a cache holds.
LayerSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | RecurrentStateSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table; layer_ids[j] uses the pages of slot j.
    `kept_whole`: sliding-window layers of a full-attention group, whose pages are kept like
    full attention so the layers pack into groups without padding (see `group_layers`)."""

    spec: LayerSpec
    layer_ids: tuple[int, ...]
    kept_whole: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("layer_ids", "kept_whole"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)) or not all(
                    _is_int(i) and i >= 0 for i in value):
                raise ValueError(f"KVCacheGroup.{name} must be a tuple of layer ids (ints >= 0), "
                                 f"got {value!r:.60}")
            object.__setattr__(self, name, tuple(int(i) for i in value))

    @property
    def is_recurrent(self) -> bool:
        """Whether the group's layers keep a recurrent state (large pages), not K/V pages."""
        return isinstance(self.spec, RecurrentStateSpec)

    @property
    def kind(self) -> GroupKind:
        """"recurrent", "full" (attention over every past token) or "sliding" (a window)."""
        if self.is_recurrent:
            return "recurrent"
        return "full" if self.spec.sliding_window is None else "sliding"

    @property
    def state_bytes(self) -> int:
        """Bytes of one state of every layer of a recurrent group (one large page's content);
        0 for an attention group."""
        spec = self.spec
        return spec.state_bytes * len(self.layer_ids) if isinstance(spec, RecurrentStateSpec) else 0


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole cache: groups over one pool of `num_blocks` blocks, `num_slots` pages each.

    Every attention group's pages have one shape and dtype (they share the slot tensors);
    ValueError for a config that breaks this or holds a layer twice. Recurrent groups hold
    one state per page in large pages of `large_page_blocks` consecutive blocks (0: derived,
    the fewest blocks holding the largest recurrent group's state); `num_blocks` is then a
    multiple of it, with room for at least one large page beside the one holding the null
    block. ValueError for a state larger than the pool or than `large_page_blocks` blocks."""

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]
    num_slots: int
    large_page_blocks: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.num_blocks) or self.num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (one is the null block), got "
                             f"{self.num_blocks!r}")
        if not _is_int(self.num_slots) or self.num_slots < 1:
            raise ValueError(f"num_slots must be a positive int, got {self.num_slots!r}")
        if not isinstance(self.groups, (tuple, list)) or not self.groups or not all(
                isinstance(g, KVCacheGroup) for g in self.groups):
            raise ValueError(f"a cache config needs a tuple of KVCacheGroups, got "
                             f"{self.groups!r:.60}")
        groups = tuple(self.groups)
        object.__setattr__(self, "groups", groups)
        for g, group in enumerate(groups):
            if not isinstance(group.spec, (AttentionSpec, RecurrentStateSpec)):
                raise ValueError(f"group {g} has no layer spec (an AttentionSpec or a "
                                 f"RecurrentStateSpec): {group.spec!r:.60}")
        layers = [layer for g in groups for layer in g.layer_ids]
        if len(set(layers)) != len(layers):
            raise ValueError(f"a layer is in two groups: {sorted(layers)}")
        attention = [g for g, group in enumerate(groups) if not group.is_recurrent]
        if not attention:
            raise ValueError("a cache config needs at least one attention group (recurrent "
                             "groups share its block size and its pool)")
        first = groups[attention[0]].spec
        assert isinstance(first, AttentionSpec)
        for g, group in enumerate(groups):
            if isinstance(group.spec, RecurrentStateSpec):
                if not group.layer_ids:
                    raise ValueError(f"group {g} has no layers")
                if group.spec.block_size != first.block_size:
                    raise ValueError(f"group {g} has block_size {group.spec.block_size}, group "
                                     f"{attention[0]} has {first.block_size}: all groups of one "
                                     "pool must use one block size")
                continue
            assert isinstance(group.spec, AttentionSpec)
            if not 1 <= len(group.layer_ids) <= self.num_slots:
                raise ValueError(f"group {g} has {len(group.layer_ids)} layers for "
                                 f"{self.num_slots} slots")
            problem = _page_mismatch(group.spec, first, f"group {g}", f"group {attention[0]}")
            if problem:
                raise ValueError(problem)
        self._check_large_pages(first.page_size_bytes * self.num_slots)

    def _check_large_pages(self, bytes_per_block: int) -> None:
        """Derive or check `large_page_blocks` against the recurrent groups and the pool."""
        k = self.large_page_blocks
        state = max((g.state_bytes for g in self.groups), default=0)
        if not state:
            if k not in (0, 1) or not _is_int(k):
                raise ValueError(f"large_page_blocks={k!r} without a recurrent group")
            return
        needed = -(-state // bytes_per_block)
        if k == 0:
            k = needed
            object.__setattr__(self, "large_page_blocks", k)
        elif not _is_int(k) or k < 1:
            raise ValueError(f"large_page_blocks must be a positive int, got {k!r}")
        elif k < needed:
            raise ValueError(f"a recurrent state of {state} bytes cannot be carved from "
                             f"{k} blocks of {bytes_per_block} bytes: it needs {needed}")
        if self.num_blocks < 2 * k:
            raise ValueError(f"a recurrent state of {state} bytes needs {k} blocks of "
                             f"{bytes_per_block} bytes; a pool of {self.num_blocks} blocks holds "
                             "no large page beside the null block's")
        if self.num_blocks % k:
            raise ValueError(f"num_blocks={self.num_blocks} is not a multiple of the large page "
                             f"({k} blocks)")

    @property
    def has_recurrent(self) -> bool:
        """Whether some group is recurrent (the pool then has pages of two sizes)."""
        return any(g.is_recurrent for g in self.groups)

    @property
    def attention_spec(self) -> AttentionSpec:
        """The page layout of the attention groups (the first one's spec)."""
        for group in self.groups:
            if isinstance(group.spec, AttentionSpec):
                return group.spec
        raise AssertionError("checked when made")

    @property
    def block_size(self) -> int:
        """Tokens per block, the same in every group."""
        return self.groups[0].spec.block_size

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer slot."""
        return self.attention_spec.page_size_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across all slots."""
        return self.page_size_bytes * self.num_slots

    @property
    def num_padding_layers(self) -> int:
        """Slots left unused by attention groups smaller than `num_slots`."""
        return sum(self.num_slots - len(g.layer_ids) for g in self.groups if not g.is_recurrent)

    @property
    def num_kept_whole_layers(self) -> int:
        """Sliding-window layers kept whole in full-attention groups (`group_layers`)."""
        return sum(len(g.kept_whole) for g in self.groups)

    def layer_to_group_slot(self) -> dict[int, tuple[int, int]]:
        """layer id -> (group id, slot); a recurrent layer's slot is its index in its group."""
        return {layer: (g, j) for g, group in enumerate(self.groups)
                for j, layer in enumerate(group.layer_ids)}


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _positive_field(spec: Any, name: str) -> None:
    """Check that a spec's field is a positive count (`as_count`) and store it as an int."""
    value = getattr(spec, name)
    n = as_count(value)
    if n is None or n <= 0:
        raise ValueError(f"{type(spec).__name__}.{name} must be a positive int, got {value!r}")
    object.__setattr__(spec, name, n)


def _page_mismatch(spec: AttentionSpec, first: AttentionSpec, what: str, first_what: str) -> str:
    """Why `spec`'s pages cannot share slot tensors with `first`'s ('' when they can)."""
    if spec.block_size != first.block_size:
        return (f"{what} has block_size {spec.block_size}, {first_what} has {first.block_size}: "
                "all groups of one pool must use one block size")
    if spec.page_size_bytes != first.page_size_bytes:
        return (f"{what} pages are {spec.page_size_bytes} bytes, {first_what} pages are "
                f"{first.page_size_bytes}: groups sharing slot tensors need equal page sizes")
    if (spec.num_kv_heads, spec.head_dim, spec.dtype) != (first.num_kv_heads, first.head_dim,
                                                          first.dtype):
        return (f"{what} pages are [{spec.block_size}, {spec.num_kv_heads}, {spec.head_dim}] "
                f"{spec.dtype}, {first_what} pages are [{first.block_size}, {first.num_kv_heads}, "
                f"{first.head_dim}] {first.dtype}: groups sharing slot tensors need one page "
                "shape (block size, kv heads, head dim) and dtype, even where the bytes match")
    return ""


def group_layers(layer_specs: Sequence[LayerSpec], typical_tokens: int | None = None
                 ) -> tuple[tuple[KVCacheGroup, ...], int]:
    """Group layers by spec into groups of equal size; returns the groups and the slot count.
    ValueError unless every layer has the first layer's block size, page shape and dtype.

    By default every group gets as many layers as the smallest type has, and the last group
    of a larger type is padded up to it. With `typical_tokens` (the length a request usually
    reaches) and one full-attention and one sliding-window type, some sliding layers may be
    kept whole in the full-attention groups instead, where that packs the layers with less
    padding and holds a request of that length in fewer bytes, in no more groups than the
    default (fewer layers kept whole breaks ties)."""
    if not layer_specs:
        raise ValueError("a cache needs at least one layer spec")
    recurrent: dict[RecurrentStateSpec, list[int]] = {}
    for i, spec in enumerate(layer_specs):
        if isinstance(spec, RecurrentStateSpec):
            recurrent.setdefault(spec, []).append(i)
        elif not isinstance(spec, AttentionSpec):
            raise TypeError(f"layer {i}: expected a FullAttentionSpec, SlidingWindowSpec, "
                            f"ChunkedLocalAttentionSpec or RecurrentStateSpec, got "
                            f"{type(spec).__name__}")
    if recurrent:
        # Recurrent layers keep no K/V pages: one group per state spec, after the
        # attention groups, which are grouped as without them.
        attention = [(i, s) for i, s in enumerate(layer_specs)
                     if not isinstance(s, RecurrentStateSpec)]
        if not attention:
            raise ValueError("a cache needs at least one attention layer beside its recurrent "
                             "layers")
        inner, num_slots = group_layers([s for _, s in attention], typical_tokens)
        ids = [i for i, _ in attention]
        out: list[KVCacheGroup] = [KVCacheGroup(g.spec, tuple(ids[j] for j in g.layer_ids),
                                                tuple(ids[j] for j in g.kept_whole))
                                   for g in inner]
        out += [KVCacheGroup(spec, tuple(layers)) for spec, layers in recurrent.items()]
        return tuple(out), num_slots
    specs = [s for s in layer_specs
             if isinstance(s, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec))]
    first = specs[0]
    for i, spec in enumerate(specs):
        problem = _page_mismatch(spec, first, f"layer {i}", "layer 0")
        if problem:
            raise ValueError(problem)
    if typical_tokens is not None and (not _is_int(typical_tokens) or typical_tokens < 1):
        raise ValueError(f"typical_tokens must be a positive int, got {typical_tokens!r}")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    # Every group gets as many layers as the smallest type has, so each block id's
    # page in every slot is used; the largest types are split into several groups.
    group_size = min(len(layers) for layers in by_spec.values())
    kinds = sorted(by_spec, key=lambda spec: spec.sliding_window is not None)
    if (typical_tokens is not None and len(kinds) == 2 and kinds[0].sliding_window is None
            and kinds[1].sliding_window is not None):
        full, window = by_spec[kinds[0]], by_spec[kinds[1]]
        group_size, num_whole = _packing(len(full), len(window), kinds[1].sliding_window,
                                         typical_tokens, group_size)
        if num_whole:
            whole = window[len(window) - num_whole:]
            full_layers = sorted(full + whole)
            window = window[:len(window) - num_whole]
            groups = [KVCacheGroup(kinds[0], tuple(full_layers[s:s + group_size]),
                                   tuple(i for i in full_layers[s:s + group_size] if i in whole))
                      for s in range(0, len(full_layers), group_size)]
            groups += [KVCacheGroup(kinds[1], tuple(window[s:s + group_size]))
                       for s in range(0, len(window), group_size)]
            return tuple(groups), group_size
    groups = []
    for spec, layers in by_spec.items():
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroup(spec, tuple(layers[start:start + group_size])))
    return tuple(groups), group_size


def _packing(num_full: int, num_window: int, window: int, typical_tokens: int,
             default_size: int) -> tuple[int, int]:
    """(group size, sliding layers kept whole) that hold a request of `typical_tokens` in
    the fewest slot-tokens, in no more groups than the default grouping has."""
    def cost(size: int, full_groups: int, window_groups: int) -> int:
        return size * (full_groups * typical_tokens + window_groups * min(typical_tokens, window))

    f0, w0 = -(-num_full // default_size), -(-num_window // default_size)
    best = ((cost(default_size, f0, w0), 0, f0 + w0), default_size, 0)  # the default pads
    for size in range(1, num_full + num_window + 1):
        f = -(-num_full // size)
        whole = min(f * size - num_full, num_window)  # window layers fill the full groups
        w = -(-(num_window - whole) // size)
        if size == default_size or f + w > f0 + w0:
            continue
        key = (cost(size, f, w), whole, f + w)
        if key < best[0]:
            best = (key, size, whole)
    return best[1], best[2]


def make_kv_cache_config(layer_specs: Sequence[LayerSpec], memory_bytes: int | None = None,
                         num_blocks: int | None = None, typical_tokens: int | None = None,
                         large_page_blocks: int = 0) -> KVCacheConfig:
    """Group the layers (`typical_tokens`: see `group_layers`) and size the pool from a
    byte budget (or an explicit block count); both are ints (a float budget is refused
    rather than rounded). With recurrent layers the pool is rounded down to whole large
    pages (`large_page_blocks`: see `KVCacheConfig`)."""
    groups, num_slots = group_layers(layer_specs, typical_tokens)
    first = next(g.spec for g in groups if isinstance(g.spec, AttentionSpec))
    bytes_per_block = first.page_size_bytes * num_slots
    state = max((g.state_bytes for g in groups), default=0)
    k = large_page_blocks or (-(-state // bytes_per_block) if state else 1)
    if (memory_bytes is None) == (num_blocks is None):
        raise ValueError("give exactly one of memory_bytes and num_blocks")
    if num_blocks is None:
        assert memory_bytes is not None
        if not _is_int(memory_bytes):
            raise ValueError(f"memory_bytes must be an int number of bytes, got "
                             f"{type(memory_bytes).__name__} {memory_bytes!r}")
        num_blocks = int(memory_bytes) // bytes_per_block
        if state and _is_int(k) and k > 0:
            num_blocks -= num_blocks % k
        if num_blocks < 2:
            raise ValueError(
                f"memory_bytes={memory_bytes} holds {num_blocks} blocks of {bytes_per_block} bytes; "
                "need at least 2 (one is the null block)")
    elif not _is_int(num_blocks) or num_blocks < 2:
        raise ValueError(f"num_blocks must be an int >= 2 (one is the null block), got {num_blocks!r}")
    return KVCacheConfig(num_blocks=int(num_blocks), groups=groups, num_slots=num_slots,
                         large_page_blocks=large_page_blocks)
