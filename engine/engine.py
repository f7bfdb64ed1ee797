"""A minimal LLM engine over kvstore: the worked example of embedding the cache layer.

Per step: ``Scheduler.schedule`` (which asks the ``KVCacheManager`` for prefix hits and
pages, and takes the pending copies) -> ``ModelRunner.execute`` (copies, K/V writes and
paged attention on the ``PagedKVCache``) -> sampling -> ``Scheduler.update`` (progress,
forks for ``n > 1``, frees of finished requests). See ``docs/engine.md``.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvstore.engine.runner import (
    ATTENTION_BACKENDS,
    ModelRunner,
    ModelRunnerOutput,
    check_attention_backend,
)
from kvstore.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvstore.kv_cache_manager import CacheConfig, KVCacheManager
from kvstore.paged_kv_cache import PagedKVCache
from kvstore.request import Request, as_token_list, check_count
from kvstore.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLASpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    dtype_name,
    make_kv_cache_config,
)
from kvstore.tiers.connector import WINDOW_OFFLOADS
from kvstore.utils import check_seconds, hit_rate

if TYPE_CHECKING:
    from kvstore.models.hf import HFCausalLM
    from kvstore.tiers.connector import TierConnector, TierTransfers

__all__ = [
    "CompletionOutput",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "kv_cache_specs",
]

@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    ``temperature == 0`` is greedy (argmax); otherwise tokens are drawn from
    ``softmax(logits / temperature)`` with a generator seeded by ``seed`` (random when
    None). ``n > 1`` yields ``n`` samples that share the prompt's pages (forked at the
    first sampled token). A sample stops after ``max_tokens`` tokens or at a token in
    ``stop_token_ids``. ``return_logits`` keeps each chosen step's full logits row.
    Checked when made: counts as :func:`kvstore.request.as_count` takes them, a finite
    ``temperature``, a ``seed`` in ``[0, 2**63)``, a sequence of token ids and a bool.
    """

    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    return_logits: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_tokens", check_count(self.max_tokens, "max_tokens", 1))
        object.__setattr__(self, "n", check_count(self.n, "n", 1))
        t = self.temperature
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Real):
            raise TypeError(f"temperature must be a float, got {type(t).__name__} {t!r:.60}")
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {t!r}")
        if self.seed is not None:
            seed = check_count(self.seed, "seed")
            if seed >= 2**63:
                raise ValueError(f"seed must be < 2**63, got {seed}")
            object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "stop_token_ids",
                           tuple(as_token_list(self.stop_token_ids, "stop_token_ids")))
        if not isinstance(self.return_logits, bool):
            raise TypeError(f"return_logits must be a bool, got "
                            f"{type(self.return_logits).__name__} {self.return_logits!r:.60}")


@dataclass
class CompletionOutput:
    """One sample: its generated tokens, why it stopped, and per token the log-probability
    under the model's distribution (before temperature); ``logits`` ``[len, vocab]`` when
    asked for."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float]
    logits: torch.Tensor | None = None


@dataclass
class RequestOutput:
    """A finished request: its prompt and its ``n`` samples. ``num_cached_tokens`` is the
    prefix-cache hit (full and partial) at its first admission; with recurrent layers,
    ``hit_checkpoint_kind`` says why the checkpoint that hit was taken
    (``KVCacheManager.hit_checkpoint_kind``; None without a hit)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    hit_checkpoint_kind: str | None = None

    @property
    def finished(self) -> bool:
        """Whether every sample has finished."""
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass
class EngineStats:
    """Cache, scheduler and worker counters of one engine, merged."""

    steps: int
    computed_tokens: int
    lookups: int
    queried_tokens: int
    hit_tokens: int
    partial_hits: int
    partial_hit_tokens: int
    evictions: int
    preemptions: int
    recomputed_tokens: int
    copies_queued: int
    copies_executed: int
    fork_copies: int
    peak_blocks_in_use: int
    num_blocks: int
    finished: int
    # Tiers below the device (0 without them): prompt tokens admitted from each tier, blocks
    # loaded into and offloaded from device pages, and stored values that failed to verify.
    host_hit_tokens: int = 0
    store_hit_tokens: int = 0
    tier_loaded_blocks: int = 0
    tier_offloaded_blocks: int = 0
    tier_rejected_values: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens."""
        return hit_rate(self.hit_tokens, self.queried_tokens)

    @property
    def total_hit_rate(self) -> float:
        """Device, host and store hit tokens over queried tokens."""
        return hit_rate(self.hit_tokens + self.host_hit_tokens + self.store_hit_tokens,
                        self.queried_tokens)

    def as_dict(self) -> dict[str, float]:
        """Every counter plus the hit rate."""
        out: dict[str, float] = dict(self.__dict__)
        out["hit_rate"] = self.hit_rate
        return out


@dataclass
class _Sample:
    """Engine-side state of one running sequence (the parent or a forked child)."""

    group: _Group
    index: int
    generator: torch.Generator | None
    logprobs: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Drawn:
    """One step's draw for a sampling request: n tokens, their logprobs, the logits row."""

    tokens: list[int]
    logprobs: list[float]
    logits: torch.Tensor | None


@dataclass
class _Group:
    """Engine-side state of one added request and its samples."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    samples: list[_Sample | None]
    requests: list[Request | None]
    num_cached_tokens: int | None = None
    hit_checkpoint_kind: str | None = None


def kv_cache_specs(model: HFCausalLM, block_size: int
                   ) -> list[KVCacheSpec | RecurrentStateSpec]:
    """Per layer, the cache spec of a model: full attention, its sliding window, its
    attention chunk, its latent (multi-head latent attention), or a hybrid's recurrent
    state; then, for DeepSeek sparse attention, one full-attention layer per indexer (the
    indexer keys of layer ``i`` are cache layer ``num_layers + i``)."""
    c = model.config
    specs: list[KVCacheSpec | RecurrentStateSpec] = []
    dtype = dtype_name(c.dtype)
    layer_state = getattr(model, "layer_state", None)
    for i in range(c.num_layers):
        state = layer_state(i) if layer_state is not None else None
        if state is not None:
            specs.append(RecurrentStateSpec(block_size, state.shapes, state.dtypes))
            continue
        window, chunk, latent = model.layer_window(i), model.layer_chunk(i), model.layer_latent(i)
        if latent is not None:
            specs.append(MLASpec(block_size, dtype=dtype, kv_lora_rank=latent[0],
                                 rope_dim=latent[1]))
        elif chunk is not None:
            specs.append(ChunkedLocalAttentionSpec(block_size, c.num_kv_heads, c.head_dim, dtype,
                                                   chunk=chunk))
        elif window is None:
            specs.append(FullAttentionSpec(block_size, c.num_kv_heads, c.head_dim, dtype))
        else:
            specs.append(SlidingWindowSpec(block_size, c.num_kv_heads, c.head_dim, dtype,
                                           window=window))
    layer_indexer = getattr(model, "layer_indexer", None)
    for i in range(c.num_layers):
        # The indexer keys of layer i, in pages shaped as the latents.
        if layer_indexer is not None and layer_indexer(i) is not None:
            specs.append(FullAttentionSpec(block_size, 1, c.head_dim, dtype))
    return specs


@dataclass(frozen=True)
class TierConfig:
    """Tiers below device memory (docs/tiers.md): a host-memory tier of `host_tier_bytes`
    and/or the shared store at `store_url` (`valkey://...`, `valkey+cluster://...`), whose
    calls give up after `store_timeout_s` seconds. `model_name` names the K/V layout in
    the store's keys (default: a fingerprint of the model's config, weights and block
    size); `window_offload` is which released sliding-window pages are offloaded
    (`"ends"`, `"all"`, `"none"`); `store_key` (an operator secret of 16+ bytes, or a key file's path)
    seals the store's values per tenant and keys its keys."""

    host_tier_bytes: int | None = None
    store_url: str | None = None
    model_name: str | None = None
    store_timeout_s: float = 0.5
    window_offload: str = "ends"
    store_key: bytes | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.host_tier_bytes is not None:
            object.__setattr__(self, "host_tier_bytes",
                               check_count(self.host_tier_bytes, "TierConfig.host_tier_bytes"))
        for name in ("store_url", "model_name"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"TierConfig.{name} must be a str or None, got "
                                f"{type(value).__name__} {value!r:.60}")
        check_seconds(self.store_timeout_s, "TierConfig.store_timeout_s")
        if self.window_offload not in WINDOW_OFFLOADS:
            raise ValueError(f"TierConfig.window_offload must be one of "
                             f"{', '.join(WINDOW_OFFLOADS)}, got {self.window_offload!r:.60}")
        if self.store_key is not None and not self.store_url:
            raise ValueError("store_key seals store values: it needs a store_url")
        if not self.host_tier_bytes and not self.store_url:
            raise ValueError("a TierConfig needs host_tier_bytes or a store_url")


@dataclass(frozen=True)
class EngineConfig:
    """An `LLMEngine`'s settings, checked when made.

    The pool holds `num_blocks` pages (the null block included) or as many as
    `memory_bytes` holds (exactly one is given), of `block_size` tokens;
    `max_num_batched_tokens` bounds the tokens of one step (longer prompts are prefilled
    in chunks) and `max_num_seqs` the running requests; `attention_backend` is
    ``"reference"``, ``"triton"`` or ``"auto"`` (see
    :class:`~kvstore.engine.runner.ModelRunner`); `typical_tokens`, the length a request
    usually reaches, lets a hybrid model's cache keep a few sliding layers whole
    where that packs the layers without padding (see :func:`kvstore.specs.group_layers`);
    `cache` says how the manager caches (:class:`~kvstore.CacheConfig`: its hash function,
    eviction policy, ...); `tiers` adds a host tier and a shared store."""

    num_blocks: int | None = None
    memory_bytes: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    attention_backend: str = "reference"
    typical_tokens: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    tiers: TierConfig | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = check_count(getattr(self, name), f"EngineConfig.{name}", 1)
            object.__setattr__(self, name, value)
        for name, minimum in (("num_blocks", 2), ("memory_bytes", 1), ("typical_tokens", 1)):
            if (value := getattr(self, name)) is not None:
                object.__setattr__(self, name, check_count(value, f"EngineConfig.{name}", minimum))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"EngineConfig.attention_backend must be one of "
                             f"{', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if not isinstance(self.cache, CacheConfig):
            raise TypeError(f"EngineConfig.cache must be a CacheConfig, got "
                            f"{type(self.cache).__name__}")
        if self.tiers is not None and not isinstance(self.tiers, TierConfig):
            raise TypeError(f"EngineConfig.tiers must be a TierConfig or None, got "
                            f"{type(self.tiers).__name__}")
        if (self.num_blocks is None) == (self.memory_bytes is None):
            raise ValueError("EngineConfig needs exactly one of num_blocks and memory_bytes (the "
                             f"pool's size), got {self.num_blocks!r} and {self.memory_bytes!r}")


def _fork_seed(seed: int, k: int) -> int:
    """A distinct, reproducible seed for the k-th sample of a seeded request."""
    return (seed * 0x9E3779B97F4A7C15 + k * 0xBF58476D1CE4E5B9) % (2**63 - 1)


def _model_device(model: HFCausalLM, device: torch.device | str | None) -> torch.device:
    """`device`, or the model's when None; ValueError if the model's parameters are
    elsewhere (the cache must be where the model computes K/V)."""
    own = next(model.parameters()).device
    if device is None:
        return own
    device = torch.device(device)
    if device.type == own.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != own.type or (device.index is not None and own.index is not None
                                   and device.index != own.index):
        raise ValueError(f"device {device} is not the model's ({own}): move the model there "
                         "or leave device None")
    return device


class LLMEngine:
    """Continuous batching with prefix caching over one model and one paged KV cache,
    set up by an :class:`EngineConfig` (which sizes the pool) on `device` (the model's;
    None: where its parameters are)."""

    def __init__(self, model: HFCausalLM, config: EngineConfig,
                 device: torch.device | str | None = None) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        from kvstore.models.hf import HFCausalLM

        if not isinstance(model, HFCausalLM):
            raise TypeError(f"model must be an HFCausalLM (kvstore.models.hf: wrap a transformers "
                            f"model with HFCausalLM(model)), got {type(model).__name__}")
        device = _model_device(model, device)
        check_attention_backend(config.attention_backend, device)
        self.engine_config = config
        self.config: KVCacheConfig = make_kv_cache_config(
            kv_cache_specs(model, config.block_size), memory_bytes=config.memory_bytes,
            num_blocks=config.num_blocks, typical_tokens=config.typical_tokens)
        self.tiers: TierConnector | None = None
        tiers = config.tiers
        self.manager = KVCacheManager(self.config, config.cache)
        if tiers is not None:
            from kvstore.engine.fingerprint import model_fingerprint
            from kvstore.tiers.connector import TierConnector

            self.tiers = TierConnector.create(
                self.config, tiers.model_name or model_fingerprint(model, config.block_size),
                host_tier_bytes=tiers.host_tier_bytes, store_url=tiers.store_url,
                store_timeout_s=tiers.store_timeout_s, window_offload=tiers.window_offload,
                store_key=tiers.store_key)
        try:
            self.scheduler = Scheduler(self.manager, SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs), self.tiers)
            self.cache = PagedKVCache(self.config, device=device)
            self.cache.bind(self.manager)
            self.runner = ModelRunner(model, self.cache, config.attention_backend)
        except BaseException:
            if self.tiers is not None:  # stop the tiers' threads
                self.tiers.close()
            raise
        self.model = model.eval()
        self._groups: dict[str, _Group] = {}
        self._samples: dict[str, _Sample] = {}  # running sequence id -> its state
        self._next_id = 0  # the number of the next automatic request id
        self._idle_steps = 0

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int] | np.ndarray | torch.Tensor,
                    sampling: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None) -> str:
        """Queue a prompt; returns its request id (when not given, the next ``req-<n>`` that
        no live request has). Bad input raises before anything is queued."""
        next_id = self._next_id
        if request_id is None:
            (request_id,), next_id = self._auto_ids(1)
        self._queue(self._new_request(prompt_token_ids, sampling, request_id, cache_salt),
                    sampling)
        self._next_id = next_id
        return request_id

    def _auto_ids(self, count: int) -> tuple[list[str], int]:
        """The next `count` automatic request ids that no live request has, and the number
        to go on from."""
        ids: list[str] = []
        n = self._next_id
        while len(ids) < count:
            if (rid := f"req-{n}") not in self._groups:
                ids.append(rid)
            n += 1
        return ids, n

    def _new_request(self, prompt_token_ids: Sequence[int] | np.ndarray | torch.Tensor,
                     sampling: SamplingParams, request_id: str, cache_salt: str | None
                     ) -> Request:
        """A checked request that the scheduler takes; queues nothing."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if isinstance(prompt_token_ids, torch.Tensor):
            prompt_token_ids = prompt_token_ids.tolist()
        request = Request(request_id, prompt_token_ids, cache_salt=cache_salt,
                          max_tokens=sampling.max_tokens)
        if request_id in self._groups:
            raise ValueError(f"duplicate request id {request_id!r}")
        limit = getattr(self.model.config, "max_positions", None)
        if limit is not None and request.num_prompt_tokens + request.max_tokens > limit:
            raise ValueError(f"request {request_id!r}: {request.num_prompt_tokens} prompt + "
                             f"{request.max_tokens} output tokens exceed the model's "
                             f"{limit} positions (max_position_embeddings)")
        vocab = self.model.config.vocab_size
        if max(request.token_ids) >= vocab:
            raise ValueError(f"token id {max(request.token_ids)} is outside the vocabulary "
                             f"({vocab})")
        self.scheduler.check_request(request, sampling.n)
        return request

    def _queue(self, request: Request, sampling: SamplingParams) -> None:
        """Queue a request `_new_request` checked."""
        seed = sampling.seed
        if sampling.temperature > 0 and seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        rid = request.request_id
        group = _Group(rid, list(request.token_ids), sampling, [None] * sampling.n,
                       [None] * sampling.n)
        group.samples[0] = self._new_sample(group, 0, seed)
        group.requests[0] = request
        self.scheduler.add_request(request, sampling.n)
        self._groups[rid] = group
        self._samples[rid] = group.samples[0]  # type: ignore[assignment]

    def _new_sample(self, group: _Group, index: int, seed: int | None) -> _Sample:
        gen = None
        if group.params.temperature > 0:
            assert seed is not None
            gen = torch.Generator().manual_seed(seed if index == 0 else _fork_seed(seed, index))
        return _Sample(group, index, gen)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (waiting or running, with every sample it forked) and release its
        pages; it produces no output. Returns whether it was unfinished."""
        return self._abort(request_id, "abort")

    def _abort(self, request_id: str, reason: str) -> bool:
        """`abort_request` with finish reason `reason`."""
        if self._groups.pop(request_id, None) is None:
            return False
        for request in self.scheduler.abort(request_id, reason):
            self._samples.pop(request.request_id, None)
        return True

    @property
    def has_unfinished_requests(self) -> bool:
        """Whether any request waits or runs."""
        return self.scheduler.has_unfinished

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; returns the requests that finished in it. If
        running or sampling the step raises, its requests end (finish reason ``"error"``,
        no output, their pages freed) and the error propagates."""
        output = self.scheduler.schedule()
        if not output.scheduled:
            self.runner.execute(output, self.manager, self._take_transfers())  # still runs copies
            self._idle_steps += 1
            if self.scheduler.has_unfinished and self._idle_steps > 2:
                raise RuntimeError("the scheduler made no progress for 3 steps; is the pool "
                                   "too small for the waiting requests?")
            return []
        self._idle_steps = 0
        for item in output.scheduled:
            group = self._samples[item.request.request_id].group
            if group.num_cached_tokens is None:
                group.num_cached_tokens = item.start
                group.hit_checkpoint_kind = self.manager.hit_checkpoint_kind(
                    item.request.request_id)
        try:
            drawn = self._sample(self.runner.execute(output, self.manager, self._take_transfers()))
        except BaseException:
            self._fail(output)
            raise
        update = self.scheduler.update(output, {rid: d.tokens for rid, d in drawn.items()})
        reasons = {r.request_id: "length" for r in update.finished}
        children = {f.parent.request_id: f.children for f in update.forks}
        for rid, d in drawn.items():
            self._record(rid, d, children.get(rid, ()), reasons)
        self._release_when_idle()
        return self._collect(reasons)

    def _release_when_idle(self) -> None:
        if not self.scheduler.has_unfinished:
            # Idle: this step's copies have run, so release their sources' pins now rather
            # than at the next schedule (nothing can have queued new copies).
            self._run_transfers()
            self.cache.copy_blocks(self.manager.take_pending_copies())

    def _fail(self, output: SchedulerOutput) -> None:
        """End the requests of a step that raised, with every sample of theirs."""
        for item in output.scheduled:
            # The step may have written part of a recurrent state: cache nothing of it.
            item.request.num_computed_tokens = 0
        # Latest scheduled first: a request admitted on pages another one's step was to
        # compute (a hit in flight) lets go of them before that one is freed.
        for rid in dict.fromkeys(self._samples[item.request.request_id].group.request_id
                                 for item in reversed(output.scheduled)):
            self._abort(rid, "error")
        self._release_when_idle()

    def _sample(self, result: ModelRunnerOutput) -> dict[str, _Drawn]:
        """n tokens for a forking request's first sample, one for every other sampler."""
        if not result.request_ids:
            return {}
        logits = result.logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        greedy = logits.argmax(dim=-1).tolist()
        drawn: dict[str, _Drawn] = {}
        for i, rid in enumerate(result.request_ids):
            sample = self._samples[rid]
            params = sample.group.params
            n = self.scheduler.num_samples.get(rid, 1)
            if params.temperature == 0:
                tokens = [greedy[i]] * n
            else:
                probs = torch.softmax(logits[i].cpu() / params.temperature, dim=-1)
                tokens = torch.multinomial(probs, n, replacement=True,
                                           generator=sample.generator).tolist()
            drawn[rid] = _Drawn(tokens, logprobs[i, tokens].tolist(),
                                logits[i].clone() if params.return_logits else None)
        return drawn

    def _record(self, rid: str, drawn: _Drawn, children: Sequence[Request],
                reasons: dict[str, str]) -> None:
        """Attach the step's sampled tokens to the sample(s) of `rid` (adopting the children
        the scheduler forked from it, sample k = children[k - 1]) and finish samples that
        hit a stop token."""
        sample = self._samples[rid]
        group = sample.group
        family = [(rid, sample)]
        seed = sample.generator.initial_seed() if sample.generator is not None else None
        for k, request in enumerate(children, start=1):
            child = self._new_sample(group, k, seed)
            group.samples[k] = child
            group.requests[k] = request
            self._samples[request.request_id] = child
            family.append((request.request_id, child))
        for k, (member_id, member) in enumerate(family):
            member.logprobs.append(drawn.logprobs[k])
            if drawn.logits is not None:
                member.logits.append(drawn.logits)
            if member_id in reasons:
                member.finish_reason = reasons[member_id]
            elif drawn.tokens[k] in group.params.stop_token_ids:
                stopped = group.requests[member.index]
                assert stopped is not None
                self.scheduler.finish(stopped, "stop")
                member.finish_reason = reasons[member_id] = "stop"

    def _collect(self, reasons: dict[str, str]) -> list[RequestOutput]:
        """RequestOutputs of groups whose last sample finished this step."""
        done = []
        for member_id in reasons:
            sample = self._samples.pop(member_id)
            group = sample.group
            if group.request_id not in self._groups:
                continue
            if all(s is not None and s.finish_reason is not None for s in group.samples):
                done.append(self._make_output(group))
                del self._groups[group.request_id]
        return done

    @staticmethod
    def _make_output(group: _Group) -> RequestOutput:
        outputs = []
        for sample, request in zip(group.samples, group.requests, strict=True):
            assert sample is not None and request is not None
            outputs.append(CompletionOutput(
                index=sample.index,
                token_ids=request.token_ids[request.num_prompt_tokens:],
                finish_reason=sample.finish_reason,
                logprobs=sample.logprobs,
                logits=torch.stack(sample.logits) if sample.logits else None,
            ))
        return RequestOutput(group.request_id, group.prompt, outputs, group.num_cached_tokens or 0,
                             group.hit_checkpoint_kind)

    def generate(self, prompts: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
                 sampling: SamplingParams | Sequence[SamplingParams],
                 on_step: Callable[[list[RequestOutput]], None] | None = None
                 ) -> list[RequestOutput]:
        """Run the prompts to completion (with whatever else is queued); outputs in input
        order. Every prompt is checked before any is queued; if a step raises, the prompts'
        unfinished requests are aborted. `on_step(finished)` is called after each step with
        the outputs of the prompts finished so far."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) \
            else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids, next_id = self._auto_ids(len(prompts))
        requests = [self._new_request(p, sp, rid, None)
                    for p, sp, rid in zip(prompts, params, ids, strict=True)]
        for request, sp in zip(requests, params, strict=True):
            self._queue(request, sp)
        self._next_id = next_id
        results: dict[str, RequestOutput] = {}
        try:
            while len(results) < len(ids) and self.has_unfinished_requests:
                for out in self.step():
                    results[out.request_id] = out
                if on_step is not None:
                    on_step(list(results.values()))
        except BaseException:
            for rid in ids:
                self._abort(rid, "abort")
            raise
        return [results[i] for i in ids if i in results]

    # ---- stats -------------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """Merged counters of the cache manager, the scheduler and the device cache."""
        m, s = self.manager.stats, self.scheduler.stats
        return EngineStats(
            steps=s.steps, computed_tokens=s.computed_tokens, lookups=m.lookups,
            queried_tokens=m.queried_tokens, hit_tokens=m.hit_tokens,
            partial_hits=m.partial_hits, partial_hit_tokens=m.partial_hit_tokens,
            evictions=m.evictions, preemptions=s.preemptions,
            recomputed_tokens=s.recomputed_tokens, copies_queued=m.copies_queued,
            copies_executed=self.cache.copies_executed, fork_copies=m.fork_copies,
            peak_blocks_in_use=s.peak_blocks_in_use, num_blocks=self.config.num_blocks,
            finished=s.finished, **self._tier_counters())

    def _tier_counters(self) -> dict[str, int]:
        if self.tiers is None:
            return {}
        t = self.tiers.stats
        return {"host_hit_tokens": t.host_hit_tokens, "store_hit_tokens": t.store_hit_tokens,
                "tier_loaded_blocks": t.loaded_blocks, "tier_offloaded_blocks": t.offloaded_blocks,
                "tier_rejected_values": t.rejected_values}

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Each tier's own counters by name (``host``, ``store``); empty without tiers."""
        return {} if self.tiers is None else self.tiers.tier_stats()

    # ---- tiers -------------------------------------------------------------------------------
    def _take_transfers(self) -> TierTransfers | None:
        """This step's tier offloads and loads (None without tiers)."""
        if self.tiers is None:
            return None
        return self.tiers.take_transfers()

    def _run_transfers(self) -> None:
        """Run pending tier transfers now (the offloads of requests that just finished)."""
        transfers = self._take_transfers()
        if transfers:
            transfers.run(self.cache)

    def flush_tiers(self, timeout: float | None = None) -> bool:
        """Offload what finished requests left and wait until queued store writes are
        written or dropped; False on timeout. True without tiers."""
        if self.tiers is None:
            return True
        self._run_transfers()
        return self.tiers.flush(timeout)

    def close(self) -> None:
        """Stop the tiers' background writers and close their connections."""
        if self.tiers is not None:
            self.tiers.close()

    def describe(self) -> dict[str, Any]:
        """The cache layout: groups (window, layers), slots, block size and bytes."""
        return {
            "num_blocks": self.config.num_blocks,
            "block_size": self.config.block_size,
            "num_slots": self.config.num_slots,
            "padding_layers": self.config.num_padding_layers,
            "bytes_per_block": self.config.bytes_per_block,
            "cache_bytes": self.cache.num_bytes,
            "groups": [(g.spec.sliding_window, g.layer_ids) for g in self.config.groups],
        }
