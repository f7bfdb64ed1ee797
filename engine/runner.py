"""The worker side of one engine step: copies, a flat ragged batch, paged attention, logits.

A step's work arrives as a :class:`~kvstore.engine.scheduler.SchedulerOutput`. The runner

1. runs the step's copy-on-write block copies on the device cache (before any write),
2. lays every scheduled request's new tokens out one request after another (prefill
   chunks and decodes alike), with per-group block tables and slot mappings,
3. runs the model with a :class:`PagedAttention` that, for layer ``i``, writes the new K/V
   into the pages of the layer's group and reads the whole visible context back through
   :func:`kvstore.kernels.attention`,
4. returns the logits of the last token of every request whose step ends its known
   tokens (the ones that sample).

A hybrid's recurrent layers read and write each request's working state page
(:meth:`PagedAttention.layer_states`, see :mod:`kvstore.models.recurrent`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvstore import kernels
from kvstore.engine.scheduler import SchedulerOutput
from kvstore.kernels import mla as mla_kernels
from kvstore.kernels._triton import HAS_TRITON, is_interpreted
from kvstore.kernels.mla import split_latent
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.paged_kv_cache import PagedKVCache
from kvstore.specs import AttentionSpec, FullAttentionSpec, MLASpec, RecurrentStateSpec, dtype_name

if TYPE_CHECKING:
    from kvstore.models.hf import HFCausalLM
    from kvstore.tiers.connector import TierTransfers

__all__ = ["ATTENTION_BACKENDS", "BatchInputs", "ModelRunner", "ModelRunnerOutput",
           "PagedAttention", "build_batch", "check_attention_backend"]

ATTENTION_BACKENDS = ("reference", "triton", "auto")


@dataclass
class BatchInputs:
    """A step's flat ragged batch, on the cache's device.

    Per KV cache group ``g``: ``attn_metadata[g]``, the attention metadata every layer of
    the group reads (the group's block table, int32 ``[B, max_blocks]`` with rows padded
    with the null block, and the ``cu_seqlens_q``, ``seq_lens`` and ``max_seqlen_q`` that
    all groups share), and ``slot_mappings[g]`` (int64 ``[T]``, the page slot each new
    token's K/V goes to). Sequence ``i`` owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of
    ``input_ids`` and ``positions``; its queries are the last of its ``seq_lens[i]``
    tokens. ``logits_indices`` are the rows whose logits are needed, one per id in
    ``sample_request_ids``.

    For recurrent layers: ``query_ranges[i]`` (host ints) are sequence ``i``'s rows,
    ``has_state[i]`` whether its working state holds earlier tokens (its step starts past
    position 0), and ``state_pages[g][i]`` its working state page in recurrent group ``g``
    (empty for an attention group). A recurrent group's ``attn_metadata`` and
    ``slot_mappings`` entries are placeholders (a null table, every slot padding).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[kernels.AttentionMetadata]
    slot_mappings: list[torch.Tensor]
    logits_indices: torch.Tensor
    sample_request_ids: list[str]
    query_ranges: list[tuple[int, int]] = field(default_factory=list)
    has_state: list[bool] = field(default_factory=list)
    state_pages: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this batch."""
        return int(self.input_ids.shape[0])


@dataclass
class ModelRunnerOutput:
    """Next-token logits of the requests that sample this step: row ``i`` is for
    ``request_ids[i]`` (``[N, vocab]``, in scheduling order)."""

    request_ids: list[str]
    logits: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        """request id -> its logits row."""
        return {rid: self.logits[i] for i, rid in enumerate(self.request_ids)}


def build_batch(output: SchedulerOutput, manager: KVCacheManager, block_size: int,
                num_groups: int, device: torch.device | str = "cpu") -> BatchInputs:
    """Lay out a scheduler step as a flat ragged batch with per-group tables and slots.

    Reads each request's progress *before* the step (``request.num_computed_tokens``), so
    call it before ``Scheduler.update``. Raises RuntimeError if a new token would land in
    the null block (a block table that does not cover the step)."""
    sched = output.scheduled
    b = len(sched)
    starts = np.fromiter((s.start for s in sched), dtype=np.int64, count=b)
    lens = np.fromiter((s.num_new_tokens for s in sched), dtype=np.int64, count=b)
    cu = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    total = int(cu[-1])
    seq_of_token = np.repeat(np.arange(b), lens)
    positions = np.arange(total, dtype=np.int64) - cu[:-1][seq_of_token] + starts[seq_of_token]
    if b:
        input_ids = np.concatenate([
            np.asarray(s.request.token_ids[s.start:s.start + s.num_new_tokens], dtype=np.int64)
            for s in sched])
    else:
        input_ids = np.zeros(0, dtype=np.int64)
    # Per-group block tables, padded to the longest with the null block (id 0).
    tables = [manager.block_table(s.request.request_id) for s in sched]
    block_tables: list[np.ndarray] = []
    slot_mappings: list[np.ndarray] = []
    state_pages: list[list[int]] = []
    offsets = positions % block_size
    block_index = positions // block_size
    groups = manager.config.groups
    for g in range(num_groups):
        rows = [t[g] for t in tables]
        if groups[g].is_recurrent:  # one working state page per request, no token slots
            state_pages.append([r[0] for r in rows])
            block_tables.append(np.zeros((b, 1), dtype=np.int32))
            slot_mappings.append(np.full(total, -1, dtype=np.int64))
            continue
        state_pages.append([])
        widths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=b)
        width = int(widths.max()) if b else 0
        table = np.zeros((b, max(width, 1)), dtype=np.int32)
        if b:
            filled = np.arange(table.shape[1])[None, :] < widths[:, None]
            table[filled] = np.fromiter((x for r in rows for x in r), dtype=np.int32,
                                        count=int(widths.sum()))
            if (block_index >= widths[seq_of_token]).any():
                raise RuntimeError(f"group {g}: a block table does not cover the step's tokens")
        blocks = table[seq_of_token, block_index].astype(np.int64)
        if (blocks == 0).any():
            bad = int(np.flatnonzero(blocks == 0)[0])
            raise RuntimeError(
                f"group {g}: token at position {int(positions[bad])} of request "
                f"{sched[int(seq_of_token[bad])].request.request_id!r} maps to the null block")
        block_tables.append(table)
        slot_mappings.append(blocks * block_size + offsets)
    samples = np.fromiter((s.samples for s in sched), dtype=bool, count=b)
    logits_indices = cu[1:][samples] - 1

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    cu_seqlens_q = dev(cu, torch.int32)
    seq_lens = dev(starts + lens, torch.int32)
    max_seqlen_q = int(lens.max()) if b else 0
    return BatchInputs(
        input_ids=dev(input_ids, torch.int64),
        positions=dev(positions, torch.int64),
        attn_metadata=[kernels.AttentionMetadata(dev(t, torch.int32), cu_seqlens_q, seq_lens,
                                                 max_seqlen_q) for t in block_tables],
        slot_mappings=[dev(s, torch.int64) for s in slot_mappings],
        logits_indices=dev(logits_indices, torch.int64),
        sample_request_ids=[s.request.request_id for s, keep in zip(sched, samples, strict=True)
                            if keep],
        query_ranges=[(int(cu[i]), int(cu[i + 1])) for i in range(b)],
        has_state=[s.start > 0 for s in sched],
        state_pages=state_pages,
    )


def check_attention_backend(backend: str, device: torch.device) -> None:
    """ValueError unless `backend` can run on `device`: one of ``"reference"``, ``"triton"``
    (needs Triton; off CUDA, kernels interpreted: ``TRITON_INTERPRET=1`` set before they
    were imported) and ``"auto"``."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend != "triton":
        return
    if not HAS_TRITON:
        raise ValueError("attention_backend='triton': Triton is not installed; use 'reference'")
    from kvstore.kernels.triton_attention import _paged_attn_kernel

    if device.type != "cuda" and not is_interpreted(_paged_attn_kernel):
        raise ValueError(f"attention_backend='triton' on {device} needs TRITON_INTERPRET=1 set "
                         "before kvstore.kernels is imported; use 'reference' or 'auto' there")


class ModelRunner:
    """Runs scheduler steps of an :class:`~kvstore.models.hf.HFCausalLM` over a
    :class:`PagedKVCache`.

    ``attention_backend`` is passed to :func:`kvstore.kernels.attention`: ``"reference"`` (PyTorch),
    ``"triton"`` (the paged-attention kernel; on CPU only under ``TRITON_INTERPRET=1``) or
    ``"auto"`` (Triton on CUDA, the reference elsewhere)."""

    def __init__(self, model: HFCausalLM, cache: PagedKVCache,
                 attention_backend: str = "reference") -> None:
        check_attention_backend(attention_backend, cache.device)
        self.model = model
        self.cache = cache
        self.attention_backend = attention_backend
        self.num_groups = len(cache.config.groups)
        check_cache_matches_model(model, cache)
        self._group_of = [cache.group_of(i) for i in range(_cache_layers(model))]
        self._windows = [model.layer_window(i) for i in range(model.config.num_layers)]
        self._chunks = [model.layer_chunk(i) for i in range(model.config.num_layers)]

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, manager: KVCacheManager,
                transfers: TierTransfers | None = None) -> ModelRunnerOutput:
        """Run one step: its tier transfers (offloads, then loads into fresh pages), its
        copies, then the forward over its tokens; call before ``Scheduler.update``.
        Returns the logits of the requests that sample."""
        if transfers:
            transfers.run(self.cache)
        self.cache.copy_blocks(output.copies)
        vocab = self.model.config.vocab_size
        if not output.scheduled:
            return ModelRunnerOutput([], torch.empty(0, vocab, device=self.cache.device))
        batch = build_batch(output, manager, self.cache.block_size, self.num_groups,
                            self.cache.device)
        # Every row samples (a step of decodes): keep them all rather than index each.
        every_row = len(batch.sample_request_ids) == batch.num_tokens
        logits = self.model(batch.input_ids, batch.positions, PagedAttention(self, batch),
                            None if every_row else batch.logits_indices)
        return ModelRunnerOutput(batch.sample_request_ids, logits)


class PagedAttention:
    """One batch's attention over the paged cache: for layer ``i``, write the step's K/V
    into the pages of the layer's group, then run :func:`kvstore.kernels.attention` over the
    visible context with the layer's window and the scaling, softcap and sinks of the
    caller (a transformers attention module's own settings)."""

    def __init__(self, runner: ModelRunner, batch: BatchInputs) -> None:
        self.runner = runner
        self.batch = batch

    @property
    def positions(self) -> torch.Tensor:
        """The absolute position of each of the batch's tokens (``[T]``)."""
        return self.batch.positions

    def layer_states(self, layer: int) -> list[tuple[torch.Tensor, ...]]:
        """Per sequence of the batch, the state tensors of recurrent ``layer`` in its working
        state page (views, written in place)."""
        runner = self.runner
        pages = self.batch.state_pages[runner._group_of[layer]]
        return [runner.cache.state_views(layer, page) for page in pages]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Write ``k``, ``v`` ``[T, num_kv_heads, head_dim]`` of ``layer`` into its pages and
        return the attention output ``[T, num_heads, head_dim]`` of ``q``."""
        runner, batch = self.runner, self.batch
        g = runner._group_of[layer]
        runner.cache.write(layer, k, v, batch.slot_mappings[g])
        key_cache, value_cache = runner.cache.layer_caches(layer)
        return kernels.attention(
            q, key_cache, value_cache, batch.attn_metadata[g], scale,
            window=runner._windows[layer], softcap=softcap, sinks=sinks,
            chunk=runner._chunks[layer], backend=runner.attention_backend)

    def attend_latent(self, layer: int, latent: torch.Tensor, q_latent: torch.Tensor,
                      q_rope: torch.Tensor, *, scale: float) -> torch.Tensor:
        """Multi-head latent attention: write ``latent`` ``[T, kv_lora_rank + rope_dim]`` of
        ``layer`` into its pages and return the absorbed-form output ``[T, heads,
        kv_lora_rank]`` of ``q_latent`` ``[T, heads, kv_lora_rank]`` and ``q_rope``
        (:func:`kvstore.kernels.mla_attention`)."""
        runner, batch = self.runner, self.batch
        g = runner._group_of[layer]
        key, value = split_latent(latent)
        runner.cache.write(layer, key, value, batch.slot_mappings[g])
        key_cache, value_cache = runner.cache.layer_caches(layer)
        return kernels.mla_attention(q_latent, q_rope, key_cache, value_cache,
                                     batch.attn_metadata[g], scale,
                                     backend=runner.attention_backend)

    def attend_indexed(self, layer: int, latent: torch.Tensor, q_latent: torch.Tensor,
                       q_rope: torch.Tensor, *, scale: float, index_key: torch.Tensor,
                       index_q: torch.Tensor, index_weights: torch.Tensor, index_scale: float,
                       topk: int) -> torch.Tensor:
        """DeepSeek sparse attention: write ``index_key`` ``[T, D]`` into the pages of the
        layer's indexer cache layer, select each query's ``topk`` tokens with
        :func:`kvstore.kernels.mla.indexer_topk` (queries ``index_q`` ``[T, H, D]``,
        weights ``index_weights`` ``[T, H]``), then as :meth:`attend_latent` over the
        selected tokens only (the PyTorch reference)."""
        runner, batch = self.runner, self.batch
        index_layer = runner.model.layer_indexer(layer)
        if index_layer is None:
            raise ValueError(f"layer {layer} has no indexer cache")
        gi = runner._group_of[index_layer]
        width = 2 * runner.cache.layer_caches(index_layer)[0].shape[3]
        key, value = split_latent(torch.nn.functional.pad(index_key, (0, width - index_key.shape[1])))
        runner.cache.write(index_layer, key, value, batch.slot_mappings[gi])
        selected = mla_kernels.indexer_topk(index_q, index_weights,
                                            *runner.cache.layer_caches(index_layer),
                                            batch.attn_metadata[gi], index_scale, topk,
                                            index_key.shape[1])
        g = runner._group_of[layer]
        key, value = split_latent(latent)
        runner.cache.write(layer, key, value, batch.slot_mappings[g])
        return mla_kernels.mla_attention_reference(q_latent, q_rope,
                                                   *runner.cache.layer_caches(layer),
                                                   batch.attn_metadata[g], scale, selected)


def _cache_layers(model: HFCausalLM) -> int:
    """How many layers a model's cache holds: its own, then one per DeepSeek sparse attention
    layer for the indexer keys."""
    layer_indexer = getattr(model, "layer_indexer", None)
    n = model.config.num_layers
    return n + sum(layer_indexer is not None and layer_indexer(i) is not None for i in range(n))


def _latent_of(spec: AttentionSpec) -> tuple[int, int] | None:
    """(kv_lora_rank, rope_dim) of an MLA spec, None for any other."""
    return (spec.kv_lora_rank, spec.rope_dim) if isinstance(spec, MLASpec) else None


def check_cache_matches_model(model: HFCausalLM, cache: PagedKVCache) -> None:
    """Raise ValueError unless every layer's cache group fits the layer (window, chunk,
    heads, head dim, dtype)."""
    c = model.config
    layer_to_group = cache.config.layer_to_group_slot()
    num_cache_layers = _cache_layers(model)
    if sorted(layer_to_group) != list(range(num_cache_layers)):
        raise ValueError(f"the cache holds layers {sorted(layer_to_group)}, the model has "
                         f"{num_cache_layers}")
    problems: list[str] = []
    for i in range(c.num_layers):
        group = cache.config.groups[layer_to_group[i][0]]
        spec = group.spec
        layer_state = getattr(model, "layer_state", None)
        state = layer_state(i) if layer_state is not None else None
        if isinstance(spec, RecurrentStateSpec):
            if state is None:
                problems.append(f"layer {i}: the cache keeps a recurrent state, the model's "
                                "layer runs attention")
            elif (spec.shapes, spec.dtypes) != (state.shapes, state.dtypes):
                problems.append(f"layer {i}: cache state {spec.shapes} {spec.dtypes} vs model "
                                f"{state.shapes} {state.dtypes}")
            continue
        if state is not None:
            problems.append(f"layer {i}: the model's layer keeps a recurrent state, the cache "
                            "has K/V pages for it")
            continue
        window = spec.sliding_window
        if window is None and i in group.kept_whole:
            window = model.layer_window(i)  # its window is read from pages kept whole
        want: Sequence[tuple[str, object, object]] = (
            ("window", window, model.layer_window(i)),
            ("chunk", spec.attention_chunk, model.layer_chunk(i)),
            ("latent", _latent_of(spec), model.layer_latent(i)),
            ("num_kv_heads", spec.num_kv_heads, c.num_kv_heads),
            ("head_dim", spec.head_dim, c.head_dim),
            ("dtype", spec.dtype, dtype_name(c.dtype)),
        )
        problems += [f"layer {i}: cache {name} {got} vs model {exp}"
                     for name, got, exp in want if got != exp]
    for i in range(c.num_layers, num_cache_layers):  # indexer keys: in pages shaped as latents'
        spec = cache.config.groups[layer_to_group[i][0]].spec
        keys = FullAttentionSpec(spec.block_size, 1, c.head_dim, dtype_name(c.dtype))
        if spec != keys:
            problems.append(f"layer {i}: cache {spec} vs the model's indexer keys {keys}")
    if problems:
        raise ValueError("KV cache config does not match the model: " + "; ".join(problems))
