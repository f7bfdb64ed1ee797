"""Continuous batching over kvstore: admit by arrival, chunked prefill, decode, preempt by recompute.

A chunk stops at the first position where a recurrent group takes a checkpoint.

Shared by the engine (real model) and the benchmark simulator (token counts only)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.errors import RequestTooLargeError
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import BlockIds, KVCacheManager
from kvstore.request import Request
from kvstore.utils import cdiv

if TYPE_CHECKING:
    from kvstore.tiers.connector import TierConnector


@dataclass(frozen=True)
class SchedulerConfig:
    """Step budget and admission policy."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # Naive reservation (the pre-paging design): a request reserves pages for its prompt
    # and its whole max output when admitted.
    reserve_full_output: bool = False

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens)."""

    request: Request
    num_new_tokens: int

    @property
    def start(self) -> int:
        """Position of the first token computed this step."""
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step computes the request's last token (so a new one is sampled)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    """A step: what to compute, the copies to run first, and who was preempted."""

    scheduled: list[ScheduledRequest]
    copies: list[tuple[int, int]]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True)
class Fork:
    """The samples a forking request split into at its first sampled token: ``children[k - 1]``
    is sample ``k`` (the parent itself is sample 0)."""

    parent: Request
    children: tuple[Request, ...]


@dataclass
class UpdateResult:
    """What a step's update changed: the requests that finished and the forks it made."""

    finished: list[Request]
    forks: list[Fork]


@dataclass
class SchedulerStats:
    """Counters over the scheduler's life."""

    steps: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    discarded_tokens: int = 0  # computed tokens a preemption threw away
    computed_tokens: int = 0
    finished: int = 0
    peak_blocks_in_use: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)


# The scheduler names sample k of a forking request "<id>#<k>", so request ids must not
# contain it.
FORK_SEP = "#"


class Scheduler:
    """Waiting queue by arrival, running list by admission; the newest running request is
    preempted first when the pool is full.

    With a `connector` (tiers below the device pool, attached to `manager` here), a waiting
    request's device hit is extended by what the connector holds: the manager admits it
    with those tokens as external ones, and the connector queues their loads (its
    `take_transfers` hands them to the worker)."""

    def __init__(self, manager: KVCacheManager, config: SchedulerConfig | None = None,
                 connector: TierConnector | None = None) -> None:
        if connector is not None:
            connector.attach(manager)
        self.manager = manager
        self.connector = connector
        self.config = config or SchedulerConfig()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[str, str] = {}  # request id -> finish reason
        self.num_samples: dict[str, int] = {}  # request id -> n (forked at its first sample)
        self._computed_before_preemption: dict[str, int] = {}
        self.stats = SchedulerStats()

    @property
    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    def add_request(self, request: Request, n: int = 1) -> None:
        """Queue a request; with n > 1 it forks into n samples at its first sampled token."""
        self.check_request(request, n)
        self.waiting.append(request)
        if n > 1:
            self.num_samples[request.request_id] = n

    def check_request(self, request: Request, n: int = 1) -> None:
        """Raise the error `add_request` would raise for the request and its n samples;
        changes nothing."""
        if FORK_SEP in request.request_id:
            raise ValueError(f"request id {request.request_id!r} must not contain {FORK_SEP!r} "
                             "(the scheduler names forked samples with it)")
        if not 1 <= n <= self.config.max_num_seqs:
            raise ValueError(f"n must be in 1..max_num_seqs={self.config.max_num_seqs}, got {n}")
        if request.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r} has max_tokens {request.max_tokens}; "
                             "it must generate at least one token")
        need = self.max_blocks_needed(request, n)
        if need > self.manager.num_usable_blocks:
            raise RequestTooLargeError(
                f"request {request.request_id!r} ({request.num_prompt_tokens} prompt + "
                f"{request.max_tokens} output tokens) may need {need} blocks; the pool has "
                f"{self.manager.num_usable_blocks}", request_id=request.request_id,
                blocks_needed=need, blocks_available=self.manager.num_usable_blocks)

    def max_blocks_needed(self, request: Request, n: int = 1) -> int:
        """Most pages the request (and its n - 1 forks, which share the prompt's pages) can
        hold at once over its life, over all groups."""
        bs = self.manager.block_size
        total = request.num_prompt_tokens + request.max_tokens
        need = 0
        for group in self.manager.config.groups:
            tokens = group.spec.resident_span(total, self.config.max_num_batched_tokens)
            # Each fork owns the pages its outputs fill, plus a copy of the shared last page.
            own = min(tokens, request.max_tokens + bs)
            need += cdiv(tokens, bs) + (n - 1) * (cdiv(own, bs) + 1)
        return need

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work; running requests first, then waiting ones by arrival."""
        budget = self.config.max_num_batched_tokens
        manager = self.manager
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._stop_at_checkpoint(
                request, min(request.num_tokens - request.num_computed_tokens, budget))
            while manager.grow(request, num_new,
                               num_lookahead_tokens=self._lookahead(
                                   request, request.num_computed_tokens + num_new)) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1
                continue
            break
        if not preempted:
            # A request that will fork holds its samples' seats from admission on.
            seats = sum(self.num_samples.get(r.request_id, 1) for r in self.running)
            while self.waiting and budget > 0:
                request = self.waiting[0]
                n = self.num_samples.get(request.request_id, 1)
                if seats + n > self.config.max_num_seqs:
                    break
                computed = manager.get_computed_blocks(request)
                external = 0 if self.connector is None else self.connector.lookup(request, computed)
                num_hit = (computed.num_full_hit_tokens + external if external
                           else computed.num_computed_tokens)
                num_new = min(request.num_tokens - num_hit, budget)
                num_new = self._stop_at_checkpoint(request, num_new, computed, num_hit)
                lookahead = self._lookahead(request, num_hit + num_new)
                if self._admit(request, num_new, computed, lookahead, external) is None:
                    break
                self.waiting.popleft()
                self.running.append(request)
                seats += n
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                before = self._computed_before_preemption.pop(request.request_id, 0)
                self.stats.recomputed_tokens += max(0, before - request.num_computed_tokens)
        copies = manager.take_pending_copies()
        self.stats.steps += 1
        self.stats.peak_blocks_in_use = max(self.stats.peak_blocks_in_use,
                                            manager.num_usable_blocks
                                            - manager.num_free_blocks)
        return SchedulerOutput(scheduled, copies, preempted)

    def _admit(self, request: Request, num_new: int, computed: ComputedBlocks, lookahead: int,
               external: int) -> BlockIds | None:
        """Admit on the device hit plus `external` tokens from the connector, which is told
        what was allocated; a hit whose pages exceed the whole pool at once falls back to
        the device hit."""
        connector = self.connector
        try:
            ids = self.manager.admit(request, num_new, computed, lookahead, external)
        except RequestTooLargeError:
            if not external:
                raise
            assert connector is not None
            connector.drop_oversized(request)
            external = 0
            ids = self.manager.admit(request, num_new, computed, lookahead)
        if ids is not None and connector is not None:
            connector.admitted(request, computed, external)
        return ids

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> UpdateResult:
        """Advance progress after the step ran; `sampled[rid]` holds the tokens sampled for
        each request whose last token was computed (n tokens at a forking request's first
        sample, the k-th going to sample k). Returns the requests that finished and the
        forks made."""
        done: list[Request] = []
        forks: list[Fork] = []
        for item in output.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            self.stats.computed_tokens += item.num_new_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue
            tokens = sampled[request.request_id]
            n = self.num_samples.pop(request.request_id, 1)
            if len(tokens) != n:
                raise ValueError(f"request {request.request_id!r} needs {n} sampled tokens, got "
                                 f"{len(tokens)}")
            family = [request]
            for k in range(1, n):
                child = request.fork(f"{request.request_id}{FORK_SEP}{k}")
                self.manager.fork(request, child)
                self.running.append(child)
                family.append(child)
            if n > 1:
                forks.append(Fork(request, tuple(family[1:])))
            for member, token in zip(family, tokens, strict=True):
                member.append_token_ids(token)
                if member.num_output_tokens >= member.max_tokens:
                    self.finish(member, "length")
                    done.append(member)
        return UpdateResult(done, forks)

    def finish(self, request: Request, reason: str) -> None:
        """Remove a running request and free its pages."""
        self.running.remove(request)
        self.manager.free(request)
        self._count_finished(request, reason)

    def _count_finished(self, request: Request, reason: str) -> None:
        self.finished[request.request_id] = reason
        self.stats.finished += 1
        self.stats.finish_reasons[reason] = self.stats.finish_reasons.get(reason, 0) + 1

    def abort(self, request_id: str, reason: str = "abort") -> list[Request]:
        """Remove a request and the samples forked from it, waiting or running (finish
        reason `reason`), releasing their pages and what their lookups hold; returns them
        (empty when none is live under that id)."""
        prefix = request_id + FORK_SEP

        def ours(r: Request) -> bool:
            return r.request_id == request_id or r.request_id.startswith(prefix)

        waiting = [r for r in self.waiting if ours(r)]
        running = [r for r in self.running if ours(r)]
        for request in waiting:
            self.manager.drop_lookup(request)
            if self.connector is not None:
                self.connector.drop_lookup(request)
            self.waiting.remove(request)
        for request in running:
            self.running.remove(request)
            self.manager.free(request)
        out = waiting + running
        for request in out:
            self.num_samples.pop(request.request_id, None)
            self._computed_before_preemption.pop(request.request_id, None)
            self._count_finished(request, reason)
        return out

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        self._computed_before_preemption[request.request_id] = request.num_computed_tokens
        self.stats.discarded_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.stats.preemptions += 1

    def _stop_at_checkpoint(self, request: Request, num_new: int,
                            computed: ComputedBlocks | None = None, num_hit: int = -1) -> int:
        """`num_new` cut at the first position where a recurrent group takes a checkpoint
        (`KVCacheManager.next_checkpoints`), so the model's state there is written out. For
        a waiting request, `computed` is its lookup and `num_hit` the tokens it is admitted
        with (past the lookup's when a connector's tiers add some)."""
        start = request.num_computed_tokens if computed is None else computed.num_computed_tokens
        if num_hit < 0:
            num_hit = start
        stops = [p for p in self.manager.next_checkpoints(request, num_hit - start + num_new,
                                                          computed) if p > num_hit]
        return stops[0] - num_hit if stops else num_new

    def _lookahead(self, request: Request, num_tokens_after: int) -> int:
        if not self.config.reserve_full_output:
            return 0
        return max(0, request.num_prompt_tokens + request.max_tokens - num_tokens_after)
