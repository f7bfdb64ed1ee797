"""Copy-on-write end to end: the manager's bookkeeping driving a real PagedKVCache on CPU.

Every token's K/V is a deterministic function of (salt, the request's token ids up to and
including it, layer), so a dense, unshared cache is known exactly. After every scheduler
step each live request's K/V, read through its block tables, must equal those values.
The salt is mixed in on purpose: real K/V does not depend on it, but then a cross-salt
share would be invisible to the content check.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from invariants import check_manager, internals

from kvstore.kv_cache_manager import KVCacheManager
from kvstore.paged_kv_cache import PagedKVCache
from kvstore.request import Request
from kvstore.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)

BS = 4
HEADS = 2
DIM = 4
MASK24 = (1 << 24) - 1
# Added to every token's base value; distinct per (head, dim); integers keep it exact.
PATTERN = torch.arange(HEADS * DIM, dtype=torch.float32).reshape(HEADS, DIM)


def full_config(num_blocks: int, num_layers: int = 2) -> KVCacheConfig:
    spec = FullAttentionSpec(BS, HEADS, DIM, torch.float32)
    return make_kv_cache_config([spec] * num_layers, num_blocks=num_blocks)


def hybrid_config(num_blocks: int, windows: tuple[int, int] = (3, 5)) -> KVCacheConfig:
    """Layer 0 full, layers 1 and 2 sliding: three groups of one layer each."""
    specs: list[KVCacheSpec] = [FullAttentionSpec(BS, HEADS, DIM, torch.float32)]
    specs += [SlidingWindowSpec(BS, HEADS, DIM, torch.float32, window=w) for w in windows]
    return make_kv_cache_config(specs, num_blocks=num_blocks)


def num_layers(config: KVCacheConfig) -> int:
    return sum(len(g.layer_ids) for g in config.groups)


# --------------------------------------------------------------------- the dense oracle


@dataclass
class Dense:
    """What a dense, unshared cache holds for one request: per layer, per position, (k, v)."""

    salt: str | None
    num_layers: int
    prefix_hash: int = 0
    k: list[list[float]] = field(default_factory=list)
    v: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefix_hash = 0 if self.salt is None else 1 + zlib.crc32(self.salt.encode())
        self.k = [[] for _ in range(self.num_layers)]
        self.v = [[] for _ in range(self.num_layers)]

    def extend(self, token_ids: Sequence[int]) -> None:
        """Values of the tokens beyond those already known (token ids only ever grow)."""
        for tok in token_ids[len(self.k[0]):]:
            self.prefix_hash = hash((self.prefix_hash, tok)) & ((1 << 61) - 1)
            for layer in range(self.num_layers):
                h = hash((self.prefix_hash, layer))
                self.k[layer].append((h & MASK24) / (1 << 24))
                self.v[layer].append(((h >> 24) & MASK24) / (1 << 24))

    def copy(self) -> Dense:
        out = Dense(self.salt, self.num_layers)
        out.prefix_hash = self.prefix_hash
        out.k = [list(x) for x in self.k]
        out.v = [list(x) for x in self.v]
        return out

    def kv(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.tensor(self.k[layer][start:end], dtype=torch.float32)[:, None, None] + PATTERN
        v = torch.tensor(self.v[layer][start:end], dtype=torch.float32)[:, None, None] - PATTERN
        return k, v


class Harness:
    """A manager and a real cache, run with the scheduler/worker protocol."""

    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.manager = KVCacheManager(config)
        self.cache = PagedKVCache(config, device="cpu")
        self.layers = num_layers(config)
        self.dense: dict[str, Dense] = {}
        self.windows = [g.spec.sliding_window for g in config.groups]

    # ---- requests ----------------------------------------------------------------------------
    def new_request(self, rid: str, tokens: Sequence[int], salt: str | None = None) -> Request:
        req = Request(rid, list(tokens), cache_salt=salt)
        self.dense[rid] = Dense(salt, self.layers)
        self.dense[rid].extend(req.token_ids)
        return req

    def admit(self, req: Request, n: int | None = None) -> bool:
        computed = self.manager.get_computed_blocks(req)
        n = req.num_tokens - computed.num_computed_tokens if n is None else n
        return self.manager.allocate_slots(req, n, computed) is not None

    def fork(self, parent: Request, child_id: str) -> Request:
        child = parent.fork(child_id)
        self.manager.fork(parent, child)
        self.dense[child_id] = self.dense[parent.request_id].copy()
        return child

    def append(self, req: Request, tok: int) -> None:
        req.append_token_ids(tok)
        self.dense[req.request_id].extend(req.token_ids)

    # ---- worker ------------------------------------------------------------------------------
    def run_copies(self) -> list[tuple[int, int]]:
        copies = self.manager.take_pending_copies()
        self.cache.copy_blocks(copies)
        return copies

    def write(self, batch: Sequence[tuple[Request, int]]) -> None:
        """Write K/V of positions [num_computed, num_computed + n) of every (request, n)."""
        if not batch:
            return
        pool = internals(self.manager).pool
        group_slots: list[list[int]] = []
        for g in range(len(self.config.groups)):
            slots: list[int] = []
            for req, n in batch:
                start = req.num_computed_tokens
                table = self.manager.block_table(req.request_id)[g]
                for p in range(start, start + n):
                    block_id = table[p // BS]
                    assert block_id != 0, f"{req.request_id} writes position {p} into the null block"
                    block = pool.blocks[block_id]
                    writer = internals(self.manager).coordinator.pending_writer(block)
                    if writer is not None:  # indexed for a hit in flight: its request writes it
                        assert writer is req, f"{req.request_id} writes {writer.request_id}'s page"
                    else:
                        assert block.block_hash is None, f"write into cached full block {block_id}"
                        assert block.ref_cnt - block.pin_cnt == 1, (
                            f"{req.request_id} writes into block {block_id} shared by "
                            f"{block.ref_cnt - block.pin_cnt} tables")
                    slots.append(block_id * BS + p % BS)
            assert len(set(slots)) == len(slots), "two writes of one step hit the same slot"
            group_slots.append(slots)
        for layer in range(self.layers):
            kvs = [self.dense[req.request_id].kv(layer, req.num_computed_tokens,
                                                 req.num_computed_tokens + n) for req, n in batch]
            self.cache.write(layer, torch.cat([k for k, _ in kvs]), torch.cat([v for _, v in kvs]),
                             torch.tensor(group_slots[self.cache.group_of(layer)]))

    def step(self, batch: Sequence[tuple[Request, int]]) -> list[tuple[int, int]]:
        """Copies, then writes, then the scheduler advances progress."""
        copies = self.run_copies()
        self.write(batch)
        for req, n in batch:
            req.num_computed_tokens += n
        return copies

    # ---- checks ------------------------------------------------------------------------------
    def check(self) -> None:
        check_manager(self.manager)
        # Checked between steps: every queued copy has been handed out and run.
        assert self.cache.copies_executed == self.manager.stats.copies_queued
        for rid, req in self.manager.requests.items():
            self.check_request(req, self.manager.block_table(rid))

    def check_request(self, req: Request, tables: tuple[list[int], ...]) -> None:
        nc = req.num_computed_tokens
        dense = self.dense[req.request_id]
        for layer in range(self.layers):
            g = self.cache.group_of(layer)
            w = self.windows[g]
            start = 0 if w is None else max(0, nc - w + 1)
            if start >= nc:
                continue
            table = tables[g]
            assert len(table) * BS >= nc
            needed = table[start // BS:(nc - 1) // BS + 1]
            assert 0 not in needed, (
                f"{req.request_id} group {g}: null block among the pages of positions {start}..{nc}")
            k, v = self.cache.gather(layer, table, start, nc)
            ek, ev = dense.kv(layer, start, nc)
            if not (torch.equal(k, ek) and torch.equal(v, ev)):
                bad = sorted({start + int(i) for i in
                              torch.nonzero((k != ek).flatten(1).any(1) | (v != ev).flatten(1).any(1))})
                raise AssertionError(
                    f"{req.request_id} (salt {req.cache_salt!r}) layer {layer} group {g}: K/V wrong "
                    f"at positions {bad} of {start}..{nc}; table {table}")


# --------------------------------------------------------------------- random driver


class Sim:
    """One seeded random run of a scheduler and its worker over a small pool.

    Each step: maybe one arrival; then, in random order, allocations for running requests
    (chunked prefill or one decode token), admissions of waiting ones (a prefix hit, then
    a chunk), forks and frees/preemptions; allocation failures skip the request (and may
    preempt another). Then the worker runs the copies and the writes, progress advances,
    and requests with every token computed finish or sample (and maybe fork) one token.
    """

    def __init__(self, seed: int, hybrid: bool, free_scheduled: bool) -> None:
        self.seed = seed
        self.hybrid = hybrid
        # Whether requests already allocated for in this step may be preempted or aborted
        # before the forward (a scheduler that needs their pages for another request).
        self.free_scheduled = free_scheduled
        self.log: list[str] = []
        rng = self.rng = random.Random(seed)
        self.max_len = rng.randint(10, 26)
        config: KVCacheConfig
        if hybrid:
            windows = (rng.choice([1, 2, 3, 4, 5, 8, 11]), rng.choice([1, 3, 4, 6, 9]))
            # A prefill chunk holds all its pages in every group until the next allocation.
            per_req = 3 * (-(-self.max_len // BS))
            config = hybrid_config(per_req + 1 + rng.randint(0, 14), windows)
        else:
            config = full_config(-(-self.max_len // BS) + 1 + rng.randint(0, 10),
                                 num_layers=rng.choice([2, 3]))
        self.h = Harness(config)
        self.vocab = rng.choice([3, 8, 50])
        self.bases = [[rng.randrange(self.vocab) for _ in range(self.max_len)] for _ in range(3)]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.target: dict[str, int] = {}
        self.next_id = 0

    # ---- helpers -----------------------------------------------------------------------------
    def _rid(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def new_prompt(self) -> list[int]:
        rng = self.rng
        if rng.random() < 0.85:
            base = rng.choice(self.bases)
            cut = rng.randint(1, self.max_len - 2)
            prompt = base[:cut] + [rng.randrange(self.vocab) for _ in range(rng.randint(0, 4))]
        else:
            prompt = [rng.randrange(self.vocab) for _ in range(rng.randint(1, 12))]
        return prompt[:self.max_len - 1]

    def arrive(self) -> None:
        rng = self.rng
        req = self.h.new_request(self._rid(), self.new_prompt(), rng.choice([None, None, "a"]))
        self.target[req.request_id] = min(self.max_len, req.num_tokens + rng.randint(0, 6))
        self.waiting.append(req)

    def free(self, req: Request, batch: dict[str, tuple[Request, int]], preempt: bool) -> None:
        self.log.append(f"{'preempt' if preempt else 'free'} {req.request_id}")
        mgr = self.h.manager
        if req.request_id in batch:  # scheduled: refused once a hit in flight took its pages
            before = internals(mgr).pool.block_states()
            try:
                mgr.free(req)
            except RuntimeError as exc:
                assert "before its step ran" in str(exc)
                assert internals(mgr).pool.block_states() == before
                self.log.append("  refused: a hit in flight holds its pages")
                return
        else:
            mgr.free(req)
        self.running.remove(req)
        batch.pop(req.request_id, None)
        if preempt:
            req.num_computed_tokens = 0
            self.waiting.append(req)
        else:
            del self.h.dense[req.request_id]

    def victims(self, batch: dict[str, tuple[Request, int]]) -> list[Request]:
        if self.free_scheduled:
            return self.running
        return [r for r in self.running if r.request_id not in batch]

    def pick_chunk(self, req: Request, start: int) -> int:
        left = req.num_tokens - start
        return left if self.rng.random() < 0.5 else self.rng.randint(1, left)

    # ---- one scheduler step ------------------------------------------------------------------
    def step(self) -> None:
        rng, h = self.rng, self.h
        mgr = h.manager
        batch: dict[str, tuple[Request, int]] = {}
        if len(self.waiting) < 3 and (rng.random() < 0.6 or not self.running):
            self.arrive()
        ops = ["run"] * len(self.running) + ["admit"] * len(self.waiting) + ["fork", "free"]
        rng.shuffle(ops)
        for op in ops:
            if op == "run":
                todo = [r for r in self.running
                        if r.request_id not in batch and r.num_computed_tokens < r.num_tokens]
                if not todo:
                    continue
                req = rng.choice(todo)
                n = self.pick_chunk(req, req.num_computed_tokens)
                self.log.append(f"alloc {req.request_id} {n}")
                if mgr.allocate_slots(req, n) is not None:
                    batch[req.request_id] = (req, n)
                elif rng.random() < 0.5 and (victims := self.victims(batch)):
                    self.free(rng.choice(victims), batch, preempt=True)
            elif op == "admit":
                if not self.waiting:
                    continue
                req = self.waiting[0] if rng.random() < 0.7 else rng.choice(self.waiting)
                computed = mgr.get_computed_blocks(req)
                hit = computed.num_computed_tokens
                assert 0 <= hit < req.num_tokens
                n = self.pick_chunk(req, hit)
                self.log.append(f"admit {req.request_id} salt={req.cache_salt} "
                                f"tokens={req.token_ids} hit={hit} n={n}")
                if mgr.allocate_slots(req, n, computed) is None:
                    continue
                # The full-block hit alone when only the partial copy's page did not fit.
                assert req.num_computed_tokens in (hit, computed.num_full_hit_tokens)
                self.waiting.remove(req)
                self.running.append(req)
                batch[req.request_id] = (req, n)
            elif op == "fork" and self.running and rng.random() < 0.3:
                parent = rng.choice(self.running)
                scheduled = batch.get(parent.request_id)
                child = h.fork(parent, self._rid())
                self.log.append(f"fork {parent.request_id} -> {child.request_id}")
                self.running.append(child)
                self.target[child.request_id] = self.target[parent.request_id]
                if scheduled is not None:
                    # The parent writes its shared pages this step: the child, sharing them,
                    # must be scheduled for the same tokens (its allocation copies them first).
                    self.log.append(f"alloc {child.request_id} {scheduled[1]}")
                    if mgr.allocate_slots(child, scheduled[1]) is None:
                        self.free(child, batch, preempt=False)
                    else:
                        batch[child.request_id] = (child, scheduled[1])
            elif op == "free" and rng.random() < 0.15 and (victims := self.victims(batch)):
                self.free(rng.choice(victims), batch, preempt=rng.random() < 0.5)
        self.log.append(f"step {[(r.request_id, n) for r, n in batch.values()]}")
        h.step(list(batch.values()))
        # Sampling: a request whose every token is computed finishes or gets one more.
        for req in list(self.running):
            if req.num_computed_tokens < req.num_tokens:
                continue
            if req.num_tokens >= self.target[req.request_id]:
                self.free(req, batch, preempt=False)
                continue
            if rng.random() < 0.25:
                child = h.fork(req, self._rid())
                self.log.append(f"fork {req.request_id} -> {child.request_id}")
                self.running.append(child)
                self.target[child.request_id] = self.target[req.request_id]
                h.append(child, rng.randrange(self.vocab))
            h.append(req, rng.randrange(self.vocab))
        h.check()

    def run(self, num_steps: int) -> None:
        try:
            for _ in range(num_steps):
                self.step()
            for req in list(self.running):
                self.free(req, {}, preempt=False)
            self.h.run_copies()
            self.h.run_copies()
            check_manager(self.h.manager)
            pool = internals(self.h.manager).pool
            assert pool.num_free_blocks == pool.num_usable_blocks
        except Exception as exc:
            tail = "\n".join(self.log[-25:])
            raise AssertionError(f"seed {self.seed} hybrid={self.hybrid}: {exc}\n{tail}") from exc


def run_seeds(seeds: range, hybrid: bool, free_scheduled: bool) -> dict[str, int]:
    totals = {"partial_hits": 0, "fork_copies": 0, "copies": 0, "evictions": 0, "preemptions": 0}
    for seed in seeds:
        sim = Sim(seed, hybrid, free_scheduled)
        sim.run(NUM_STEPS)
        stats = sim.h.manager.stats
        totals["partial_hits"] += stats.partial_hits
        totals["fork_copies"] += stats.fork_copies
        totals["copies"] += sim.h.cache.copies_executed
        totals["evictions"] += stats.evictions
        totals["preemptions"] += sum(line.startswith("preempt") for line in sim.log)
    return totals


NUM_STEPS = 40
SEEDS_PER_CHUNK = 50


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(3))
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_random_schedules_keep_every_requests_kv(hybrid: bool, chunk: int) -> None:
    """Frees and preemptions between steps (of requests not scheduled in the current one)."""
    totals = run_seeds(range(chunk * SEEDS_PER_CHUNK, (chunk + 1) * SEEDS_PER_CHUNK), hybrid,
                       free_scheduled=False)
    # The runs exercised what they are meant to.
    assert all(v > 0 for v in totals.values()), totals


@pytest.mark.slow
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_random_schedules_with_preemption_of_scheduled_requests(hybrid: bool) -> None:
    """As above, but the scheduler may also preempt or abort a request it already allocated
    for in this step (to make room for another), before the worker runs the step."""
    totals = run_seeds(range(1000, 1060), hybrid, free_scheduled=True)
    assert all(v > 0 for v in totals.values()), totals


# --------------------------------------------------------------------- unit tests


def write_all(h: Harness, req: Request) -> None:
    """Admit `req` and compute its whole prompt in one step."""
    assert h.admit(req)
    h.step([(req, req.num_tokens - req.num_computed_tokens)])
    h.check()


def page(h: Harness, layer: int, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = h.cache.layer_caches(layer)
    return k[block_id].clone(), v[block_id].clone()


CONFIGS = {
    "full": lambda n: full_config(n, num_layers=2),
    "hybrid": lambda n: hybrid_config(n, (3, 5)),
}


@pytest.mark.parametrize("kind", CONFIGS)
def test_block_aligned_cached_prompt_recomputes_one_token(kind: str) -> None:
    h = Harness(CONFIGS[kind](24))
    mgr = h.manager
    groups = len(h.config.groups)
    prompt = list(range(10, 18))  # exactly two blocks
    a = h.new_request("a", prompt)
    write_all(h, a)
    a_table = mgr.block_table("a")
    mgr.free(a)

    b = h.new_request("b", prompt)
    computed = mgr.get_computed_blocks(b)
    # Full-block caching alone would recompute the whole last block; the partial hit copies
    # its first block_size - 1 tokens and recomputes one.
    assert computed.num_full_hit_tokens == BS
    assert computed.num_partial_tokens == BS - 1
    assert computed.num_computed_tokens == len(prompt) - 1
    assert mgr.allocate_slots(b, 1, computed) is not None
    assert b.num_computed_tokens == len(prompt) - 1
    assert (mgr.stats.partial_hits, mgr.stats.partial_hit_tokens) == (1, BS - 1)
    assert mgr.stats.copies_queued == groups and mgr.stats.fork_copies == 0
    b_table = mgr.block_table("b")
    for g in range(groups):
        w = h.windows[g]
        # The full hit is shared (or already dropped: out of the window of the query at 7).
        expect_first = 0 if w is not None and 7 - w + 1 >= BS else a_table[g][0]
        assert b_table[g][0] == expect_first
        assert b_table[g][1] != a_table[g][1]  # the cached full block is copied, not written

    copies = mgr.take_pending_copies()
    assert sorted(copies) == sorted((a_table[g][1], b_table[g][1]) for g in range(groups))
    before = {layer: page(h, layer, a_table[h.cache.group_of(layer)][1]) for layer in range(h.layers)}
    h.cache.copy_blocks(copies)
    assert h.cache.copies_executed == groups
    # The copy landed in every layer's pages.
    for layer in range(h.layers):
        g = h.cache.group_of(layer)
        k, v = page(h, layer, b_table[g][1])
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
    h.write([(b, 1)])
    b.num_computed_tokens += 1
    h.check()
    # The source, a cached full block, still holds a's content.
    for layer in range(h.layers):
        g = h.cache.group_of(layer)
        assert torch.equal(page(h, layer, a_table[g][1])[0], before[layer][0])
    mgr.free(b)
    h.run_copies()
    check_manager(mgr)


@pytest.mark.parametrize("kind", CONFIGS)
def test_partial_hit_on_a_finished_requests_partial_last_block(kind: str) -> None:
    h = Harness(CONFIGS[kind](24))
    mgr = h.manager
    a = h.new_request("a", [1, 2, 3, 4, 5, 6])  # block 1 holds two tokens when a finishes
    write_all(h, a)
    a_tail = [t[1] for t in mgr.block_table("a")]
    mgr.free(a)

    b = h.new_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    computed = mgr.get_computed_blocks(b)
    assert (computed.num_full_hit_tokens, computed.num_partial_tokens) == (BS, 2)
    assert [s.block_id if s else None for s in computed.partial_sources] == a_tail
    assert mgr.allocate_slots(b, 2, computed) is not None
    assert b.num_computed_tokens == 6
    copies = h.step([(b, 2)])
    assert [src for src, _ in copies] == a_tail
    assert [dst for _, dst in copies] == [t[1] for t in mgr.block_table("b")]
    h.check()

    # A shorter match on the same source, while b still runs.
    c = h.new_request("c", [1, 2, 3, 4, 5, 9, 9])
    computed = mgr.get_computed_blocks(c)
    assert (computed.num_full_hit_tokens, computed.num_partial_tokens) == (BS, 1)
    assert mgr.allocate_slots(c, 2, computed) is not None
    h.step([(c, 2)])
    h.check()
    assert (mgr.stats.partial_hits, mgr.stats.partial_hit_tokens) == (2, 3)

    # Same tokens under a different first block: a different parent, no partial hit.
    d = h.new_request("d", [0, 2, 3, 4, 5, 6, 7])
    computed = mgr.get_computed_blocks(d)
    assert computed.num_computed_tokens == 0
    assert computed.partial_sources == (None,) * len(h.config.groups)


@pytest.mark.parametrize("first", ["parent", "child"])
def test_fork_then_divergence(first: str) -> None:
    h = Harness(full_config(12, num_layers=3))
    mgr = h.manager
    parent = h.new_request("p", [1, 2, 3, 4, 5, 6])
    write_all(h, parent)
    child = h.fork(parent, "c")
    assert mgr.block_table("c") == mgr.block_table("p")
    shared_tail = mgr.block_table("p")[0][1]
    h.check()
    h.append(parent, 10)
    h.append(child, 20)
    writers = [parent, child] if first == "parent" else [child, parent]

    assert mgr.allocate_slots(writers[0], 1) is not None
    assert mgr.stats.fork_copies == 1
    # The first writer got a private copy; the other still holds the original.
    assert mgr.block_table(writers[0].request_id)[0][1] != shared_tail
    assert mgr.block_table(writers[1].request_id)[0][1] == shared_tail
    # The second writer is now the block's last sharer: it writes in place, no copy.
    assert mgr.allocate_slots(writers[1], 1) is not None
    assert mgr.stats.fork_copies == 1 and mgr.stats.copies_queued == 1
    assert mgr.block_table(writers[1].request_id)[0][1] == shared_tail
    copies = h.step([(parent, 1), (child, 1)])
    assert copies == [(shared_tail, mgr.block_table(writers[0].request_id)[0][1])]
    h.check()
    # Block 0 is still shared; the two sides' position 6 differ.
    assert mgr.block_table("p")[0][0] == mgr.block_table("c")[0][0]
    kp, _ = h.cache.gather(0, mgr.block_table("p")[0], 6, 7)
    kc, _ = h.cache.gather(0, mgr.block_table("c")[0], 6, 7)
    assert not torch.equal(kp, kc)

    # Decode on both until they cross a block boundary; the pin goes with the next batch.
    for tok in (11, 12, 13):
        for req in (parent, child):
            h.append(req, tok + (req is child))
            assert mgr.allocate_slots(req, 1) is not None
        h.step([(parent, 1), (child, 1)])
        h.check()
    assert internals(mgr).pool.blocks[shared_tail].pin_cnt == 0
    assert mgr.stats.fork_copies == 1
    mgr.free(parent)
    mgr.free(child)
    h.run_copies()
    check_manager(mgr)
    assert mgr.num_free_blocks == mgr.num_usable_blocks


def test_pending_copy_source_is_not_evicted() -> None:
    h = Harness(full_config(5, num_layers=2))  # four usable blocks
    mgr = h.manager
    a = h.new_request("a", [1, 2, 3, 4, 5, 6])
    write_all(h, a)
    a0, a1 = mgr.block_table("a")[0]
    mgr.free(a)
    # Free queue, head first: the two never-used blocks, then a's tail, then a's root.
    assert [b.block_id for b in internals(mgr).pool.free_queue][2:] == [a1, a0]

    b = h.new_request("b", [1, 2, 3, 4, 5, 6, 7])
    assert h.admit(b, 1)
    assert mgr.num_free_blocks == 1
    src = internals(mgr).pool.blocks[a1]
    assert src.pin_cnt == 1 and src.ref_cnt == 1
    # Another request of this step wants two pages: one is free, the other would be the
    # pinned copy source, so it must wait.
    c = h.new_request("c", [50, 51, 52, 53, 54])
    assert mgr.allocate_slots(c, 5) is None
    # One page it gets, and not the copy source.
    c1 = h.new_request("c1", [60, 61])
    assert mgr.allocate_slots(c1, 2) is not None
    assert a1 not in mgr.block_table("c1")[0]
    assert src.token_ids == (5, 6)
    copies = h.step([(b, 1), (c1, 2)])
    assert copies == [(a1, mgr.block_table("b")[0][1])]
    h.check()
    # Handed out but not released until the next batch is taken.
    assert src.pin_cnt == 1
    mgr.free(c1)
    assert mgr.allocate_slots(c, 5) is None
    h.step([])
    assert src.pin_cnt == 0 and src.ref_cnt == 0
    # Now it may be reused.
    assert mgr.allocate_slots(c, 5) is not None
    assert a1 in mgr.block_table("c")[0]
    h.step([(c, 5)])
    h.check()


def test_salted_request_never_copies_another_salts_block() -> None:
    h = Harness(hybrid_config(40, (2, 4)))
    mgr = h.manager
    groups = len(h.config.groups)
    aligned = list(range(20, 28))
    plain = h.new_request("plain", [1, 2, 3, 4, 5, 6])
    plain8 = h.new_request("plain8", aligned)
    write_all(h, plain)
    write_all(h, plain8)
    plain_blocks = {i for t in mgr.block_table("plain") + mgr.block_table("plain8") for i in t}
    mgr.free(plain)
    mgr.free(plain8)

    for rid, tokens in (("s1", [1, 2, 3, 4, 5, 6, 7]), ("s2", aligned), ("s3", [1, 2, 3, 4, 5, 6])):
        req = h.new_request(rid, tokens, salt="a")
        computed = mgr.get_computed_blocks(req)
        # s3 hits the block s1 computed, under the same salt (in flight: s1 has not been
        # allocated since), never a block of the unsalted requests.
        assert not {b.block_id for blocks in computed.blocks for b in blocks} & plain_blocks
        assert computed.inflight is (mgr.requests["s1"] if rid == "s3" else None)
        assert computed.num_computed_tokens == (4 if rid == "s3" else 0)
        assert computed.partial_sources == (None,) * groups
        assert h.admit(req)
        assert not set(i for t in mgr.block_table(rid) for i in t) & plain_blocks
        h.step([(req, req.num_tokens - req.num_computed_tokens)])
        h.check()
    assert mgr.stats.partial_hits == 0 and mgr.stats.copies_queued == 0
    salted_s1 = {t[1] for t in mgr.block_table("s1")}
    for rid in ("s1", "s2", "s3"):
        mgr.free(mgr.requests[rid])

    # Under its own salt the partial hit works, from the salted block.
    t = h.new_request("t", [1, 2, 3, 4, 5, 6, 7, 9], salt="a")
    computed = mgr.get_computed_blocks(t)
    assert computed.num_computed_tokens == 7
    assert {s.block_id for s in computed.partial_sources if s} <= salted_s1
    assert h.admit(t)
    copies = h.step([(t, 1)])
    assert {src for src, _ in copies} <= salted_s1
    h.check()
    # And an unsalted request does not copy from salted blocks.
    u = h.new_request("u", [1, 2, 3, 4, 5, 6, 7, 9])
    computed = mgr.get_computed_blocks(u)
    assert computed.num_computed_tokens == 6  # its own salt's blocks (plain's two tokens)
    assert {s.block_id for s in computed.partial_sources if s} <= plain_blocks
    assert h.admit(u)
    h.step([(u, 2)])
    h.check()


def test_chained_copies_in_one_batch() -> None:
    """A partial-hit destination forked (twice) and written in the step it is admitted."""
    h = Harness(full_config(12, num_layers=2))
    mgr = h.manager
    a = h.new_request("a", [1, 2, 3, 4, 5, 6])
    write_all(h, a)
    a1 = mgr.block_table("a")[0][1]
    mgr.free(a)

    b = h.new_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert h.admit(b, 2)
    dst_b = mgr.block_table("b")[0][1]
    c = h.fork(b, "c")
    assert mgr.allocate_slots(c, 2) is not None
    dst_c = mgr.block_table("c")[0][1]
    d = h.fork(c, "d")
    assert mgr.allocate_slots(d, 2) is not None
    dst_d = mgr.block_table("d")[0][1]
    assert len({a1, dst_b, dst_c, dst_d}) == 4
    assert mgr.stats.fork_copies == 2
    # Queued: a1 -> dst_b, dst_b -> dst_c, dst_c -> dst_d; dst_b and dst_c hold nothing
    # yet, so every copy must read the original source.
    copies = h.step([(b, 2), (c, 2), (d, 2)])
    assert sorted(copies) == sorted([(a1, dst_b), (a1, dst_c), (a1, dst_d)])
    h.check()
    for req, tok in ((b, 100), (c, 200), (d, 300)):
        h.append(req, tok)
        assert mgr.allocate_slots(req, 1) is not None
    h.step([(b, 1), (c, 1), (d, 1)])
    h.check()


def test_partial_hit_on_a_block_whose_own_copy_is_pending() -> None:
    """b is admitted with a partial hit and preempted before the forward: its destination is
    indexed with content still to be copied. A later partial hit on it in the same batch must
    read what it will hold."""
    h = Harness(full_config(12, num_layers=2))
    mgr = h.manager
    a = h.new_request("a", [1, 2, 3, 4, 5, 6])
    write_all(h, a)
    a1 = mgr.block_table("a")[0][1]
    mgr.free(a)
    b = h.new_request("b", [1, 2, 3, 4, 5, 6, 7])
    assert h.admit(b, 1)
    dst_b = mgr.block_table("b")[0][1]
    mgr.free(b)  # preempted before the step ran
    b.num_computed_tokens = 0
    e = h.new_request("e", [1, 2, 3, 4, 5, 6, 8, 9])
    computed = mgr.get_computed_blocks(e)
    # b's destination and a's tail match equally well (two tokens); the lookup picks the
    # destination here, which only holds them once the batch has run.
    assert computed.partial_sources[0] is internals(mgr).pool.blocks[dst_b]
    assert computed.num_computed_tokens == 6
    assert mgr.allocate_slots(e, 2, computed) is not None
    copies = h.step([(e, 2)])
    assert copies == [(a1, dst_b), (a1, mgr.block_table("e")[0][1])]
    h.check()


def test_freed_copy_destination_is_not_reused_by_the_same_batch() -> None:
    """Known bug repro. A pending copy's destination is freed in the same step (its request
    is preempted before the forward) and handed out again as another copy's destination:
    the batch has one destination twice and cannot run."""
    h = Harness(full_config(4, num_layers=1))  # three usable blocks
    mgr = h.manager
    a = h.new_request("a", [1, 2, 3, 4, 5, 6])
    write_all(h, a)
    mgr.free(a)
    b = h.new_request("b", [1, 2, 3, 4, 5, 9, 9])  # partial hit on a's tail: copy a1 -> x
    assert h.admit(b, 2)
    mgr.free(b)  # preempted before the forward; x returns to the free queue
    e = h.new_request("e", [1, 2, 3, 4, 5, 6, 8])  # partial hit on a's tail again
    # Its copy's destination may be x only if x's pending copy is dropped; waiting is fine too.
    batch = [(e, 1)] if h.admit(e, 1) else []
    check_batch_runs(h, batch)


def check_batch_runs(h: Harness, batch: list[tuple[Request, int]]) -> None:
    copies = h.manager.take_pending_copies()
    dsts = [dst for _, dst in copies]
    assert len(set(dsts)) == len(dsts), f"one batch copies into a block twice: {copies}"
    h.cache.copy_blocks(copies)
    h.write(batch)
    for req, n in batch:
        req.num_computed_tokens += n
    h.check()


def test_freed_fork_copy_destination_is_not_reused_by_the_same_batch() -> None:
    """Known bug repro, fork path: the same, with copy-on-write copies of a shared block."""
    h = Harness(full_config(4, num_layers=1))  # three usable blocks
    mgr = h.manager
    p = h.new_request("p", [1, 2, 3, 4, 5])
    write_all(h, p)
    c = h.fork(p, "c")
    d = h.fork(p, "d")
    for req, tok in ((p, 6), (c, 7), (d, 8)):
        h.append(req, tok)
    assert mgr.allocate_slots(p, 1) is not None  # copy p1 -> x, the last free block
    mgr.free(p)  # preempted before the forward; x returns to the free queue
    p.num_computed_tokens = 0
    # p1 is still shared with d: c needs a copy of it, into x (or it must wait).
    batch = [(c, 1)] if mgr.allocate_slots(c, 1) is not None else []
    check_batch_runs(h, batch)
