"""Loaders for the public traces in ``shared/traces`` (see its README).

- Mooncake FAST'25 traces: per-request arrival, lengths and prefix-chained 512-token
  block hashes. :func:`mooncake_to_workload` expands them into token-level requests
  whose prompts share exactly the blocks the hashes say they share.
- Azure LLM inference 2023: arrivals and lengths only; prompts become unique tokens.
- The hit-rate-vs-capacity points read off the Mooncake paper, and
  :func:`mooncake_lru_replay`, a plain LRU over hash ids that reproduces the paper's
  counting and serves as an oracle for the block pool.
"""

from __future__ import annotations

import csv
import json
import os
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.benchmarks.workloads import DEFAULT_VOCAB_SIZE, RequestSpec, Workload, tokens_to_tuple
from kvstore.utils import cdiv, hit_rate

MOONCAKE_BLOCK_TOKENS = 512

TRACE_FILES: dict[str, str] = {
    "mooncake_conversation": "mooncake_conversation_trace.jsonl",
    "mooncake_synthetic": "mooncake_synthetic_trace.jsonl",
    "azure_code": "azure_llm_inference_2023_code.csv",
    "azure_conv": "azure_llm_inference_2023_conv.csv",
    "mooncake_paper_points": "mooncake_hit_rate_vs_capacity.csv",
}

ENV_VAR = "KVSTORE_TRACES"

# Where each trace comes from (a pip install ships none of them): repository, path there.
TRACE_SOURCES: dict[str, tuple[str, str]] = {
    "mooncake_conversation": ("https://github.com/kvcache-ai/Mooncake",
                              "FAST25-release/traces/conversation_trace.jsonl"),
    "mooncake_synthetic": ("https://github.com/kvcache-ai/Mooncake",
                           "FAST25-release/traces/synthetic_trace.jsonl"),
    "azure_code": ("https://github.com/Azure/AzurePublicDataset",
                   "data/AzureLLMInferenceTrace_code.csv"),
    "azure_conv": ("https://github.com/Azure/AzurePublicDataset",
                   "data/AzureLLMInferenceTrace_conv.csv"),
}


def leading_run(ids: Sequence[int], present: Container[int]) -> int:
    """How many of ``ids``, from the first, are in ``present`` (a prefix hit in blocks)."""
    k = 0
    while k < len(ids) and ids[k] in present:
        k += 1
    return k


def default_trace_dir() -> Path:
    """The trace directory: ``$KVSTORE_TRACES`` when set, else ``shared/traces`` next
    to the repository root.

    Raises FileNotFoundError when the chosen directory does not exist.
    """
    env = os.environ.get(ENV_VAR)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"${ENV_VAR}={env!r} is not a directory")
        return path
    repo_root = Path(__file__).resolve().parent.parent
    path = repo_root.parent / "shared" / "traces"
    if not path.is_dir():
        raise FileNotFoundError(f"no trace directory: {ENV_VAR} is not set and {path} does not "
                                f"exist; set {ENV_VAR} to the folder holding the trace files")
    return path


def trace_file(name: str, trace_dir: str | Path | None = None) -> Path:
    """Path of a known trace file by short name (a key of ``TRACE_FILES``)."""
    try:
        fname = TRACE_FILES[name]
    except KeyError:
        raise ValueError(f"unknown trace {name!r}; known: {sorted(TRACE_FILES)}") from None
    return Path(trace_dir if trace_dir is not None else default_trace_dir()) / fname


def trace_source(name: str) -> str:
    """Where to download trace `name` and how to point kvstore at it, in one sentence."""
    fname = TRACE_FILES[name]
    if name in TRACE_SOURCES:
        repo, path = TRACE_SOURCES[name]
        return (f"download {path} from {repo}, then pass --trace PATH, or set {ENV_VAR} to the "
                f"folder holding it as {fname}")
    return (f"it ships only in the source repository's shared/traces folder; set {ENV_VAR} to "
            f"a folder holding it as {fname}")


def locate_trace(name: str) -> Path:
    """The existing file of trace `name` (a key of ``TRACE_FILES``): in ``$KVSTORE_TRACES``,
    else in a source checkout's ``shared/traces``.

    Raises FileNotFoundError saying where to get the file and how to point at it (a pip
    install ships no traces)."""
    try:
        path = trace_file(name)
    except FileNotFoundError as e:  # no trace folder at all
        where = str(e).split(";")[0]
    else:
        if path.is_file():
            return path
        where = f"not in {path.parent}"
    raise FileNotFoundError(f"needs the trace file {TRACE_FILES[name]} ({where}), which a pip "
                            f"install does not ship: {trace_source(name)}")


# ------------------------------------------------------------------------- Mooncake


@dataclass(frozen=True, slots=True)
class MooncakeRequest:
    """One row of a Mooncake trace. ``hash_ids[i]`` names the 512-token block ``i`` of
    the input together with everything before it."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake(path: str | Path, limit: int | None = None) -> list[MooncakeRequest]:
    """The rows of a Mooncake JSONL trace in file order (the first ``limit`` rows if
    given)."""
    out: list[MooncakeRequest] = []
    if limit is not None and limit <= 0:
        return out
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                req = MooncakeRequest(int(row["timestamp"]), int(row["input_length"]),
                                      int(row["output_length"]), tuple(int(h) for h in row["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad Mooncake row: {e}") from e
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    return out


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def mooncake_block_tokens(hash_ids: Sequence[int] | np.ndarray,
                          block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                          vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> np.ndarray:
    """The fixed token content of each block id, shape ``(len(hash_ids), block_tokens)``.

    A pure function of (id, position in block, seed): equal ids always give equal
    tokens, different ids give independent pseudo-random tokens.
    """
    ids = np.asarray(hash_ids, dtype=np.int64)
    if ids.size and int(ids.min()) < 0:
        raise ValueError("hash ids must be non-negative")
    key = (ids.astype(np.uint64)[:, None] * np.uint64(block_tokens)
           + np.arange(block_tokens, dtype=np.uint64))
    key ^= _splitmix64(np.array([seed], dtype=np.uint64))
    return (_splitmix64(key) % np.uint64(vocab_size)).astype(np.int64)


def mooncake_prompt_tokens(req: MooncakeRequest, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                           vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> np.ndarray:
    """The prompt of one Mooncake request as ``input_length`` token ids: its blocks'
    contents in order, the last block cut to fit."""
    need = cdiv(req.input_length, block_tokens)
    if len(req.hash_ids) != need:
        raise ValueError(f"request with input_length {req.input_length} has {len(req.hash_ids)} "
                         f"hash ids, expected ceil({req.input_length}/{block_tokens}) = {need}")
    blocks = mooncake_block_tokens(req.hash_ids, block_tokens, vocab_size, seed)
    return blocks.reshape(-1)[: req.input_length]


def _as_requests(path_or_requests: str | Path | Iterable[MooncakeRequest],
                 limit: int | None) -> list[MooncakeRequest]:
    if isinstance(path_or_requests, (str, Path)):
        return load_mooncake(path_or_requests, limit)
    reqs = list(path_or_requests)
    return reqs if limit is None else reqs[: max(limit, 0)]


def iter_mooncake_specs(requests: Iterable[MooncakeRequest],
                        block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                        vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0,
                        id_prefix: str = "mooncake") -> Iterator[RequestSpec]:
    """Token-level requests for the given Mooncake rows, one at a time and in the
    order given; request ids are ``f"{id_prefix}-{index}"``."""
    for i, req in enumerate(requests):
        yield RequestSpec(f"{id_prefix}-{i:06d}", req.timestamp_ms / 1000.0, tokens_to_tuple(
            mooncake_prompt_tokens(req, block_tokens, vocab_size, seed), vocab_size),
            req.output_length)


def mooncake_to_workload(path_or_requests: str | Path | Iterable[MooncakeRequest],
                         block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                         vocab_size: int = DEFAULT_VOCAB_SIZE, limit: int | None = None, *,
                         seed: int = 0, name: str | None = None) -> Workload:
    """A Mooncake trace (a path or loaded rows) as a token-level workload.

    Each hash id stands for ``block_tokens`` tokens of fixed content, so requests
    share exactly the prefixes their hash ids share; a request's last block is cut to
    its ``input_length``. Arrival = timestamp / 1000, ``max_tokens`` = output length.
    Only the first ``limit`` rows are used when given; the whole conversation trace is
    ~145M tokens, so large expansions cost gigabytes.
    """
    reqs = _as_requests(path_or_requests, limit)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].timestamp_ms)
    specs = list(iter_mooncake_specs(reqs, block_tokens, vocab_size, seed))
    if name is None:
        name = Path(path_or_requests).stem if isinstance(path_or_requests, (str, Path)) else "mooncake"
    desc = (f"Mooncake trace {name}: {len(reqs)} requests, {sum(r.input_length for r in reqs)} "
            f"prompt tokens; each hash id expanded to {block_tokens} fixed pseudo-random tokens "
            f"(vocab {vocab_size}, seed {seed})")
    return Workload(name=name, requests=[specs[i] for i in order], description=desc)


# ---------------------------------------------------------------------------- Azure


def _parse_azure_time(text: str) -> datetime:
    # e.g. "2023-11-16 18:17:03.9799600": 7 fractional digits, which strptime rejects.
    main, _, frac = text.strip().partition(".")
    t = datetime.strptime(main, "%Y-%m-%d %H:%M:%S")
    return t.replace(microsecond=int((frac + "000000")[:6])) if frac else t


def load_azure(path: str | Path, limit: int | None = None, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
               seed: int = 0, name: str | None = None) -> Workload:
    """An Azure LLM inference trace (CSV with TIMESTAMP, ContextTokens,
    GeneratedTokens) as a workload of unique random prompts.

    Arrival = seconds since the earliest row (the first row in the published files);
    prompt length = ContextTokens, ``max_tokens`` = GeneratedTokens. No two prompts
    share content beyond chance agreement of single tokens.
    """
    times: list[datetime] = []
    ctx: list[int] = []
    gen: list[int] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        for row in reader:
            if limit is not None and len(times) >= limit:
                break
            times.append(_parse_azure_time(row["TIMESTAMP"]))
            ctx.append(int(row["ContextTokens"]))
            gen.append(int(row["GeneratedTokens"]))
    t0 = min(times) if times else None
    lens = np.asarray(ctx, dtype=np.int64)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, size=int(lens.sum()), dtype=np.int64)
    offs = np.concatenate(([0], np.cumsum(lens)))
    if name is None:
        name = Path(path).stem
    requests = [RequestSpec(f"{name}-{i:06d}", (times[i] - t0).total_seconds() if t0 is not None else 0.0,
                            tokens_to_tuple(tokens[offs[i]:offs[i + 1]], vocab_size), gen[i])
                for i in range(len(times))]
    requests.sort(key=lambda r: r.arrival)
    desc = (f"Azure LLM inference trace {name}: {len(requests)} requests, {int(lens.sum())} "
            f"prompt tokens, unique random prompts (vocab {vocab_size}, seed {seed})")
    return Workload(name=name, requests=requests, description=desc)


# ----------------------------------------------------------------- paper and oracle


def mooncake_paper_points(path: str | Path | None = None) -> dict[str, list[tuple[int, float]]]:
    """Token hit rate against LRU capacity (in tokens) per workload, as read off the
    Mooncake paper's Fig. 9, sorted by capacity."""
    if path is None:
        path = trace_file("mooncake_paper_points")
    points: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            points.setdefault(row["workload"], []).append((int(row["capacity_tokens"]),
                                                           float(row["token_hit_rate"])))
    for pts in points.values():
        pts.sort()
    return points


class HitCount:
    """Prefix hits over Mooncake rows counted as the paper does: a row hits its leading run
    of cached ids, ``min(run * block_tokens, input_length)`` tokens."""

    def __init__(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self.per_request: list[int] = []
        self.input_tokens = self.hit_tokens = self.total_blocks = self.hit_blocks = 0

    def add(self, req: MooncakeRequest, run: int) -> None:
        """Count row `req` hitting its first `run` blocks."""
        hit = min(run * self.block_tokens, req.input_length)
        self.per_request.append(hit)
        self.hit_tokens += hit
        self.hit_blocks += run
        self.input_tokens += req.input_length
        self.total_blocks += len(req.hash_ids)

    def totals(self) -> dict[str, Any]:
        """``requests``, ``input_tokens``, ``hit_tokens``, ``total_blocks``, ``hit_blocks``,
        ``token_hit_rate``, ``block_hit_rate`` and ``per_request_hit_tokens`` (in order)."""
        return {"requests": len(self.per_request), "input_tokens": self.input_tokens,
                "hit_tokens": self.hit_tokens, "total_blocks": self.total_blocks,
                "hit_blocks": self.hit_blocks,
                "token_hit_rate": hit_rate(self.hit_tokens, self.input_tokens),
                "block_hit_rate": hit_rate(self.hit_blocks, self.total_blocks),
                "per_request_hit_tokens": self.per_request}


def lru_hold(lru: OrderedDict[int, None], keep: Sequence[int], capacity: int | None) -> list[int]:
    """The LRU model of a paged pool: a request's blocks `keep` are held (out of `lru`)
    while room is made by evicting the least recently used others (up to `capacity`
    blocks; None: unbounded), then released deepest first, so the root ends most recently
    used and a chain is evicted from its tail. Returns the evicted ids, oldest first."""
    for h in keep:
        lru.pop(h, None)
    evicted = []
    while capacity is not None and lru and len(lru) + len(keep) > capacity:
        evicted.append(lru.popitem(last=False)[0])
    for h in reversed(keep):
        lru[h] = None
    return evicted


def mooncake_lru_replay(requests: Iterable[MooncakeRequest], capacity_blocks: int | None,
                        block_tokens: int = MOONCAKE_BLOCK_TOKENS, *, instances: int = 1,
                        tier_blocks: int | None = 0, write_back: bool = False) -> dict[str, Any]:
    """Replay Mooncake rows (timestamp order, one at a time, dealt round-robin over
    `instances`) through `lru_hold`: each instance an LRU of ``capacity_blocks`` hash ids
    (None: unbounded), all above one shared LRU tier of ``tier_blocks`` ids (0: none, None:
    unbounded). A row hits the longest run of its leading ids cached on its instance, then
    in the tier (a load refreshes the id there), and keeps at most its first
    ``capacity_blocks`` blocks. The tier is written when a row ends with the kept ids it
    lacks, or with `write_back` with the ids its instance evicts.

    Returns ``HitCount.totals`` (hits on the instance and the tier), ``evictions`` (from
    the instances), ``tier_hit_blocks``, ``device_hit_rate`` and
    ``per_instance_block_hit_rate``."""
    if capacity_blocks is not None and capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
    if instances < 1 or (tier_blocks is not None and tier_blocks < 0):
        raise ValueError(f"need instances >= 1 and tier_blocks >= 0 or None, got {instances}, "
                         f"{tier_blocks}")
    cap = capacity_blocks
    lrus: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(instances)]
    tier: OrderedDict[int, None] = OrderedDict()
    count = HitCount(block_tokens)
    evictions = tier_hits = 0
    per_hits, per_total = [0] * instances, [0] * instances

    def put(h: int) -> None:
        if h in tier:
            tier.move_to_end(h)
            return
        while tier_blocks is not None and len(tier) >= tier_blocks:
            tier.popitem(last=False)
        tier[h] = None

    for i, req in enumerate(sorted(requests, key=lambda r: r.timestamp_ms)):
        n = i % instances
        ids = req.hash_ids
        k = j = leading_run(ids, lrus[n])
        while tier_blocks != 0 and j < len(ids) and ids[j] in tier:
            tier.move_to_end(ids[j])
            j += 1
        count.add(req, j)
        tier_hits += j - k
        per_hits[n] += j
        per_total[n] += len(ids)
        keep = ids if cap is None else ids[:cap]
        evicted = lru_hold(lrus[n], keep, cap)
        evictions += len(evicted)
        if tier_blocks != 0:
            for h in evicted if write_back else (h for h in keep if h not in tier):
                put(h)
    return {"capacity_blocks": cap, "capacity_tokens": None if cap is None else cap * block_tokens,
            **count.totals(), "evictions": evictions, "tier_hit_blocks": tier_hits,
            "device_hit_rate": hit_rate(count.hit_blocks - tier_hits, count.total_blocks),
            "per_instance_block_hit_rate": [hit_rate(h, t) for h, t in zip(per_hits, per_total,
                                                                             strict=True)]}
