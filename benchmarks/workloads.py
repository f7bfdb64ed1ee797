"""Seeded token-level workloads for the prefix-cache benchmarks, and their ideal reuse."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from kvstore.utils import common_prefix_len, hit_rate

DEFAULT_VOCAB_SIZE = 32000
_INTERN_MAX_VOCAB = 1 << 18
SECONDS_PER_OUTPUT_TOKEN = 0.02  # a chat's next turn waits for the previous output


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: arrival (s), prompt, tokens to decode and, when scripted, those tokens."""

    request_id: str
    arrival: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    output_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Workload:
    """A named list of requests, sorted by arrival."""

    name: str
    requests: list[RequestSpec]
    description: str

    @property
    def num_prompt_tokens(self) -> int:
        """Total prompt tokens over all requests."""
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Total tokens to decode over all requests."""
        return sum(r.max_tokens for r in self.requests)


@lru_cache(maxsize=4)
def _int_table(vocab_size: int) -> np.ndarray:
    return np.array(list(range(vocab_size)), dtype=object)


def tokens_to_tuple(tokens: np.ndarray, vocab_size: int | None = None) -> tuple[int, ...]:
    """Token ids as a tuple of ints; with a ``vocab_size`` up to 2**18, equal ids share one."""
    arr = np.asarray(tokens, dtype=np.int64)
    if vocab_size is None or vocab_size > _INTERN_MAX_VOCAB:
        return tuple(arr.tolist())
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        raise ValueError(f"token ids out of range for vocab_size={vocab_size}")
    return tuple(_int_table(vocab_size)[arr])


def _random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    return rng.integers(0, vocab_size, size=int(n), dtype=np.int64)


def _uniform_lengths(rng: np.random.Generator, n: int, bounds: tuple[int, int], what: str) -> np.ndarray:
    low, high = int(bounds[0]), int(bounds[1])
    if low < 0 or high < low:
        raise ValueError(f"{what} must be (low, high) with 0 <= low <= high, got {bounds}")
    return rng.integers(low, high + 1, size=n, dtype=np.int64)


def _check_common(num: int, vocab_size: int, what: str) -> None:
    if num < 0:
        raise ValueError(f"{what} must be >= 0, got {num}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")


def arrival_times(seed: int | np.random.Generator, n: int, rate: float) -> np.ndarray:
    """``n`` Poisson arrival times (s) from 0 at ``rate`` per second (``math.inf``: all at 0)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if n <= 0 or math.isinf(rate):
        return np.zeros(max(n, 0), dtype=np.float64)
    return np.concatenate(([0.0], np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1))))


def heavy_tailed_lengths(seed: int | np.random.Generator, n: int, *, median: float = 128,
                         sigma: float = 1.2, low: int = 1, high: int = 2048) -> np.ndarray:
    """``n`` lengths from a lognormal of this median and log-sigma, clipped to ``[low, high]``."""
    if median <= 0 or sigma < 0:
        raise ValueError(f"need median > 0 and sigma >= 0, got {median}, {sigma}")
    if low < 0 or high < low:
        raise ValueError(f"need 0 <= low <= high, got {low}, {high}")
    draws = np.random.default_rng(seed).lognormal(mean=math.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(draws), low, high).astype(np.int64)


def _outputs(median: float, sigma: float, high: int) -> str:
    return f"lognormal outputs (median {median}, sigma {sigma}, max {high})"


def _prefixed(rng: np.random.Generator, name: str, id_prefix: str, prefixes: Sequence[np.ndarray],
              which: np.ndarray, tail_len: tuple[int, int], what: str,
              outputs: tuple[float, float, int], rate: float, vocab_size: int, head: str,
              seed: int) -> Workload:
    # Request i is prefixes[which[i]] + a random tail; draws: tail lengths, tails, outputs, arrivals.
    n = len(which)
    lens = _uniform_lengths(rng, n, tail_len, what)
    tails = np.split(_random_tokens(rng, lens.sum(), vocab_size), np.cumsum(lens)[:-1])
    median, sigma, high = outputs
    outs = heavy_tailed_lengths(rng, n, median=median, sigma=sigma, high=high)
    arrivals = arrival_times(rng, n, rate)
    requests = [RequestSpec(f"{id_prefix}-{i:05d}", float(arrivals[i]), tokens_to_tuple(
        np.concatenate((prefixes[which[i]], tails[i])), vocab_size), int(outs[i]))
        for i in range(n)]
    requests.sort(key=lambda r: r.arrival)
    return Workload(name, requests, f"{head}; {_outputs(*outputs)}; poisson arrivals at {rate}/s; "
                                    f"seed {seed}")


def shared_system_prompts(num_requests: int = 200, *, num_prompts: int = 4,
                          system_lens: Sequence[int] = (200, 500, 1000, 2000),
                          user_len: tuple[int, int] = (16, 256), output_median: float = 128,
                          output_sigma: float = 1.2, output_max: int = 2048, rate: float = 10.0,
                          vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> Workload:
    """Requests that each open with one of ``num_prompts`` shared system prompts (prompt
    ``i`` of length ``system_lens[i % len(system_lens)]``), then a unique user message."""
    _check_common(num_requests, vocab_size, "num_requests")
    if num_prompts < 1 or not system_lens:
        raise ValueError("need num_prompts >= 1 and at least one system length")
    rng = np.random.default_rng(seed)
    lens = [int(system_lens[i % len(system_lens)]) for i in range(num_prompts)]
    systems = [_random_tokens(rng, n, vocab_size) for n in lens]
    which = rng.integers(0, num_prompts, size=num_requests)
    head = (f"{num_requests} requests over {num_prompts} shared system prompts of lengths {lens} "
            f"+ unique user messages of {user_len[0]}..{user_len[1]} tokens")
    return _prefixed(rng, "shared_system_prompts", "sys", systems, which, user_len, "user_len",
                     (output_median, output_sigma, output_max), rate, vocab_size, head, seed)


def multi_turn_chat(num_conversations: int = 20, turns: int | tuple[int, int] = 4, *,
                    system_len: int = 0, user_len: tuple[int, int] = (32, 256),
                    output_median: float = 128, output_sigma: float = 1.2, output_max: int = 2048,
                    rate: float = 1.0, think_time: float = 5.0,
                    vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> Workload:
    """Conversations of ``turns`` (a count or an inclusive range) opening with ``system_len``
    shared tokens, where turn k+1 is turn k's prompt, its scripted output and a new user
    message, arriving after that output and an exponential think time."""
    _check_common(num_conversations, vocab_size, "num_conversations")
    low, high = (turns, turns) if isinstance(turns, int) else (int(turns[0]), int(turns[1]))
    if low < 1 or high < low:
        raise ValueError(f"turns must be >= 1 (or a (low, high) range), got {turns}")
    if think_time < 0:
        raise ValueError(f"think_time must be >= 0, got {think_time}")
    rng = np.random.default_rng(seed)
    system = _random_tokens(rng, system_len, vocab_size)
    starts = arrival_times(rng, num_conversations, rate)
    n_turns = rng.integers(low, high + 1, size=num_conversations)
    requests: list[RequestSpec] = []
    for c in range(num_conversations):
        nt = int(n_turns[c])
        ulens = _uniform_lengths(rng, nt, user_len, "user_len")
        outs = heavy_tailed_lengths(rng, nt, median=output_median, sigma=output_sigma, high=output_max)
        users = np.split(_random_tokens(rng, ulens.sum(), vocab_size), np.cumsum(ulens)[:-1])
        outputs = np.split(_random_tokens(rng, outs.sum(), vocab_size), np.cumsum(outs)[:-1])
        gaps = rng.exponential(think_time, size=nt) if think_time > 0 else np.zeros(nt)
        pieces: list[np.ndarray] = [system]
        t = float(starts[c])
        for k in range(nt):
            if k > 0:
                pieces.append(outputs[k - 1])
                # Strictly after the previous turn, even with zero think time.
                t += max(outs[k - 1] * SECONDS_PER_OUTPUT_TOKEN + gaps[k], 1e-3)
            pieces.append(users[k])
            requests.append(RequestSpec(f"chat-c{c:04d}-t{k:02d}", t, tokens_to_tuple(
                np.concatenate(pieces), vocab_size), int(outs[k]),
                output_token_ids=tokens_to_tuple(outputs[k], vocab_size)))
    requests.sort(key=lambda r: r.arrival)
    return Workload("multi_turn_chat", requests, (
        f"{num_conversations} conversations of {turns} turns; each turn = previous prompt + "
        f"previous output + new user message ({user_len[0]}..{user_len[1]} tokens); shared "
        f"system prompt of {system_len} tokens; {_outputs(output_median, output_sigma, output_max)}; "
        f"conversations start at {rate}/s (poisson), think time {think_time}s; seed {seed}"))


def few_shot(num_requests: int = 100, num_examples: int = 8, *, num_tasks: int = 1,
             example_len: tuple[int, int] = (40, 200), question_len: tuple[int, int] = (16, 128),
             output_median: float = 64, output_sigma: float = 1.2, output_max: int = 1024,
             rate: float = 10.0, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> Workload:
    """Requests that open with one of ``num_tasks`` prefixes of ``num_examples`` worked
    examples (of odd length: never block-aligned), then ask a unique question."""
    _check_common(num_requests, vocab_size, "num_requests")
    if num_examples < 1 or num_tasks < 1:
        raise ValueError("need num_examples >= 1 and num_tasks >= 1")
    rng = np.random.default_rng(seed)
    prefixes: list[np.ndarray] = []
    for _ in range(num_tasks):
        n = int(_uniform_lengths(rng, num_examples, example_len, "example_len").sum())
        prefixes.append(_random_tokens(rng, n + 1 - n % 2, vocab_size))
    task = rng.integers(0, num_tasks, size=num_requests)
    head = (f"{num_requests} requests over {num_tasks} few-shot prefixes of {num_examples} "
            f"examples (prefix lengths {[len(p) for p in prefixes]}, not block-aligned) + unique "
            f"questions of {question_len[0]}..{question_len[1]} tokens")
    return _prefixed(rng, "few_shot", "fewshot", prefixes, task, question_len, "question_len",
                     (output_median, output_sigma, output_max), rate, vocab_size, head, seed)


def unique_prompts(num_requests: int = 100, *, prompt_len: tuple[int, int] = (64, 2048),
                   output_median: float = 128, output_sigma: float = 1.2, output_max: int = 2048,
                   rate: float = 10.0, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> Workload:
    """Requests with independent random prompts: no intended sharing."""
    _check_common(num_requests, vocab_size, "num_requests")
    head = f"{num_requests} unique prompts of {prompt_len[0]}..{prompt_len[1]} tokens"
    return _prefixed(np.random.default_rng(seed), "unique_prompts", "unique", [np.zeros(0, np.int64)],
                     np.zeros(num_requests, np.int64), prompt_len, "prompt_len",
                     (output_median, output_sigma, output_max), rate, vocab_size, head, seed)


def mixed_default(seed: int = 0, num_requests: int = 300, *, rate: float = 10.0,
                  vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """About 1/3 shared-system-prompt requests, 27% four-turn chats, 20% few-shot and 20%
    unique prompts, interleaved over ``num_requests / rate`` seconds."""
    _check_common(num_requests, vocab_size, "num_requests")
    turns = 4
    n_conv = round(num_requests * 0.27) // turns
    n_sys = min(round(num_requests / 3), num_requests - n_conv * turns)
    rest = num_requests - n_sys - n_conv * turns
    n_few = rest // 2
    n_uni = rest - n_few
    span = max(num_requests / rate, 1e-9)
    seeds = [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(4)]
    jobs: list[tuple[Callable[..., Workload], int, dict[str, Any]]] = [
        (shared_system_prompts, n_sys, {}), (multi_turn_chat, n_conv, {"turns": turns}),
        (few_shot, n_few, {}), (unique_prompts, n_uni, {"prompt_len": (64, 1280)})]
    parts = [gen(n, rate=max(n, 1) / span, vocab_size=vocab_size, seed=s, output_median=100,
                 output_sigma=1.2, output_max=2048, **kw)
             for (gen, n, kw), s in zip(jobs, seeds, strict=True)]
    requests = sorted((r for w in parts for r in w.requests), key=lambda r: r.arrival)
    return Workload("mixed_default", requests, (
        f"mixed: {n_sys} shared-system-prompt requests, {n_conv} chats x {turns} turns, "
        f"{n_few} few-shot, {n_uni} unique; ~{rate} req/s overall; seed {seed}"))


WORKLOADS: dict[str, Callable[..., Workload]] = {f.__name__: f for f in (
    shared_system_prompts, multi_turn_chat, few_shot, unique_prompts, mixed_default)}


def make_workload(name: str, seed: int = 0, **kw: object) -> Workload:
    """The registered workload ``name`` built with ``seed`` and generator keywords ``kw``."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    return WORKLOADS[name](seed=seed, **kw)


class IdealHits(NamedTuple):
    """Infinite-cache prefix reuse: total hit tokens, per request (as given), prompt tokens."""

    total: int
    per_request: list[int]
    prompt_tokens: int

    @property
    def rate(self) -> float:
        """Hit tokens over prompt tokens (0 for an empty workload)."""
        return hit_rate(self.total, self.prompt_tokens)


def ideal_hit_tokens(requests: Sequence[RequestSpec], block_size: int | None = None, *,
                     include_outputs: bool = False) -> IdealHits:
    """Hits with an infinite cache: each request's longest common prefix with an earlier one
    of its ``cache_salt`` (``include_outputs``: with its scripted outputs), at most its prompt
    less one token, in whole blocks with ``block_size``."""
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    per = [0] * len(requests)
    seen: dict[str | None, list[tuple[int, ...]]] = {}
    for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival):
        r = requests[i]
        p = r.prompt_token_ids
        earlier = seen.setdefault(r.cache_salt, [])
        pos = bisect_left(earlier, p)
        # The closest earlier sequences in lexicographic order hold the longest LCP.
        lcp = max((common_prefix_len(p, earlier[j]) for j in (pos - 1, pos) if 0 <= j < len(earlier)),
                  default=0)
        hit = max(0, min(lcp, len(p) - 1))
        per[i] = hit - hit % block_size if block_size is not None else hit
        if include_outputs and r.output_token_ids:
            insort(earlier, p + r.output_token_ids)
        else:
            earlier.insert(pos, p)
    return IdealHits(sum(per), per, sum(len(r.prompt_token_ids) for r in requests))
