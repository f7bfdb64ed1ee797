"""Loaders for the public traces in ``shared/traces`` (see its README): Mooncake FAST'25 block hashes,
Azure LLM inference 2023 lengths, the Mooncake paper's points; `mooncake_lru_replay`, the paper's LRU."""

from __future__ import annotations

import csv
import json
import os
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
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
_MOONCAKE = "https://github.com/kvcache-ai/Mooncake"
_AZURE = "https://github.com/Azure/AzurePublicDataset"
TRACE_SOURCES: dict[str, tuple[str, str]] = {
    "mooncake_conversation": (_MOONCAKE, "FAST25-release/traces/conversation_trace.jsonl"),
    "mooncake_synthetic": (_MOONCAKE, "FAST25-release/traces/synthetic_trace.jsonl"),
    "azure_code": (_AZURE, "data/AzureLLMInferenceTrace_code.csv"),
    "azure_conv": (_AZURE, "data/AzureLLMInferenceTrace_conv.csv"),
}


def leading_run(ids: Sequence[int], present: Container[int]) -> int:
    """How many of ``ids``, from the first, are in ``present`` (a prefix hit in blocks)."""
    return next((k for k, h in enumerate(ids) if h not in present), len(ids))


def trace_file(name: str) -> Path:
    """Where trace `name` (a key of ``TRACE_FILES``) belongs: in ``$KVSTORE_TRACES``, else in
    ``shared/traces`` beside the repository; FileNotFoundError without that folder."""
    if name not in TRACE_FILES:
        raise ValueError(f"unknown trace {name!r}; known: {sorted(TRACE_FILES)}")
    env = os.environ.get(ENV_VAR)
    folder = Path(env).expanduser() if env else Path(__file__).resolve().parents[2] / "shared" / "traces"
    if not folder.is_dir():
        raise FileNotFoundError(f"${ENV_VAR}={env!r} is not a directory" if env else
                                f"no trace directory: {ENV_VAR} is not set and {folder} does not "
                                f"exist; set {ENV_VAR} to the folder holding the trace files")
    return folder / TRACE_FILES[name]


def locate_trace(name: str, option: str | None = "--trace PATH") -> Path:
    """The existing file of trace `name`; FileNotFoundError saying where to download it and how to
    point kvstore at it: `option`, where the command has one, or the environment variable."""
    try:
        path = trace_file(name)
    except FileNotFoundError as e:  # no trace folder at all
        where = str(e).split(";")[0]
    else:
        if path.is_file():
            return path
        where = f"not in {path.parent}"
    repo, source = TRACE_SOURCES[name]
    how = f"pass {option}, or set" if option else "set"
    raise FileNotFoundError(f"needs the trace file {TRACE_FILES[name]} ({where}), which a pip install does "
                            f"not ship: download {source} from {repo}, then {how} {ENV_VAR} to the "
                            f"folder holding it as {TRACE_FILES[name]}")


@dataclass(frozen=True, slots=True)
class MooncakeRequest:
    """One row of a Mooncake trace; ``hash_ids[i]`` names input block ``i`` and its prefix."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake(path: str | Path, limit: int | None = None) -> list[MooncakeRequest]:
    """The rows (the first `limit`) of a Mooncake JSONL trace in file order."""
    out: list[MooncakeRequest] = []
    with open(path, encoding="utf-8") as f:
        rows = ((lineno, line) for lineno, line in enumerate(f, 1) if line.strip())
        for lineno, line in islice(rows, limit):
            try:
                row = json.loads(line)
                out.append(MooncakeRequest(int(row["timestamp"]), int(row["input_length"]),
                                           int(row["output_length"]), tuple(map(int, row["hash_ids"]))))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad Mooncake row: {e}") from e
    return out


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def mooncake_to_workload(path_or_requests: str | Path | Iterable[MooncakeRequest],
                         block_tokens: int = MOONCAKE_BLOCK_TOKENS, vocab_size: int = DEFAULT_VOCAB_SIZE,
                         limit: int | None = None, *, seed: int = 0, name: str | None = None) -> Workload:
    """A Mooncake trace (a path or loaded rows; the first `limit`) as a workload: each hash id is
    ``block_tokens`` fixed pseudo-random tokens, so requests share the prefixes their ids share."""
    if isinstance(path_or_requests, (str, Path)):
        reqs = load_mooncake(path_or_requests, limit)
        name = name or Path(path_or_requests).stem
    else:
        reqs = list(path_or_requests)[:limit]
    name = name or "mooncake"
    salt = _splitmix64(np.array([seed], dtype=np.uint64))
    specs = []
    for i, req in enumerate(reqs):
        if len(req.hash_ids) != (need := cdiv(req.input_length, block_tokens)):
            raise ValueError(f"request with input_length {req.input_length} has {len(req.hash_ids)} "
                             f"hash ids, expected ceil({req.input_length}/{block_tokens}) = {need}")
        ids = np.asarray(req.hash_ids, dtype=np.int64)
        if ids.size and int(ids.min()) < 0:
            raise ValueError("hash ids must be non-negative")
        key = (ids.astype(np.uint64)[:, None] * np.uint64(block_tokens)
               + np.arange(block_tokens, dtype=np.uint64)) ^ salt
        tokens = (_splitmix64(key) % np.uint64(vocab_size)).astype(np.int64)
        specs.append(RequestSpec(f"mooncake-{i:06d}", req.timestamp_ms / 1000.0, tokens_to_tuple(
            tokens.reshape(-1)[:req.input_length], vocab_size), req.output_length))
    specs.sort(key=lambda s: s.arrival)
    desc = (f"Mooncake trace {name}: {len(reqs)} requests, {sum(r.input_length for r in reqs)} prompt "
            f"tokens; each hash id expanded to {block_tokens} fixed pseudo-random tokens (vocab "
            f"{vocab_size}, seed {seed})")
    return Workload(name=name, requests=specs, description=desc)


def load_azure(path: str | Path, limit: int | None = None, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
               seed: int = 0, name: str | None = None) -> Workload:
    """An Azure LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens) as a workload of unique
    random prompts; arrival = seconds since the earliest row."""
    rows: list[tuple[datetime, int, int]] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        for row in islice(reader, limit):
            # e.g. "2023-11-16 18:17:03.9799600": 7 fractional digits, which strptime rejects.
            stamp, _, frac = row["TIMESTAMP"].strip().partition(".")
            t = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").replace(microsecond=int((frac + "000000")[:6]))
            rows.append((t, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    t0 = min((r[0] for r in rows), default=None)
    offs = np.cumsum([0] + [r[1] for r in rows])
    tokens = np.random.default_rng(seed).integers(0, vocab_size, size=int(offs[-1]), dtype=np.int64)
    name = name or Path(path).stem
    requests = [RequestSpec(f"{name}-{i:06d}", (t - t0).total_seconds() if t0 else 0.0,
                            tokens_to_tuple(tokens[offs[i]:offs[i + 1]], vocab_size), gen)
                for i, (t, _, gen) in enumerate(rows)]
    requests.sort(key=lambda r: r.arrival)
    desc = (f"Azure LLM inference trace {name}: {len(requests)} requests, {int(offs[-1])} "
            f"prompt tokens, unique random prompts (vocab {vocab_size}, seed {seed})")
    return Workload(name=name, requests=requests, description=desc)


def mooncake_paper_points(path: str | Path | None = None) -> dict[str, list[tuple[int, float]]]:
    """Token hit rate against LRU capacity (tokens) per workload, read off the Mooncake paper's Fig. 9."""
    points: dict[str, list[tuple[int, float]]] = {}
    with open(path or trace_file("mooncake_paper_points"), newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            points.setdefault(row["workload"], []).append((int(row["capacity_tokens"]),
                                                           float(row["token_hit_rate"])))
    return {k: sorted(v) for k, v in points.items()}


class HitCount:
    """Prefix hits over Mooncake rows counted as the paper does: a row hits its leading run of
    cached ids, ``min(run * block_tokens, input_length)`` tokens."""

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
        """The counts, both hit rates and ``per_request_hit_tokens``."""
        return {"requests": len(self.per_request), "input_tokens": self.input_tokens,
                "hit_tokens": self.hit_tokens, "total_blocks": self.total_blocks,
                "hit_blocks": self.hit_blocks,
                "token_hit_rate": hit_rate(self.hit_tokens, self.input_tokens),
                "block_hit_rate": hit_rate(self.hit_blocks, self.total_blocks),
                "per_request_hit_tokens": self.per_request}


def mooncake_lru_replay(requests: Iterable[MooncakeRequest], capacity_blocks: int | None,
                        block_tokens: int = MOONCAKE_BLOCK_TOKENS, *, instances: int = 1,
                        tier_blocks: int | None = 0, write_back: bool = False) -> dict[str, Any]:
    """Replay rows in timestamp order, dealt round-robin over `instances` LRUs of ``capacity_blocks``
    ids (None: unbounded) above one shared LRU tier of ``tier_blocks`` (0: none, None: unbounded), as
    docs/tiers.md states: ``HitCount.totals``, ``evictions``, ``tier_hit_blocks``, ``device_hit_rate``,
    ``per_instance_block_hit_rate``."""
    if capacity_blocks is not None and capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
    if instances < 1 or (tier_blocks is not None and tier_blocks < 0):
        raise ValueError(f"need instances >= 1 and tier_blocks >= 0 or None, got {instances}, {tier_blocks}")
    cap = capacity_blocks
    lrus: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(instances)]
    tier: OrderedDict[int, None] = OrderedDict()
    count = HitCount(block_tokens)
    evictions = tier_hits = 0
    per_hits, per_total = [0] * instances, [0] * instances
    for i, req in enumerate(sorted(requests, key=lambda r: r.timestamp_ms)):
        lru, ids = lrus[i % instances], req.hash_ids
        k = j = leading_run(ids, lru)
        while tier_blocks != 0 and j < len(ids) and ids[j] in tier:
            tier.move_to_end(ids[j])
            j += 1
        count.add(req, j)
        tier_hits += j - k
        per_hits[i % instances] += j
        per_total[i % instances] += len(ids)
        # The kept blocks are held while the least recently used others make room, then
        # released deepest first: the root ends most recently used.
        keep = ids[:cap]
        for h in keep:
            lru.pop(h, None)
        evicted = []
        while cap is not None and lru and len(lru) + len(keep) > cap:
            evicted.append(lru.popitem(last=False)[0])
        lru.update((h, None) for h in reversed(keep))
        evictions += len(evicted)
        if tier_blocks != 0:  # the store takes what the instance evicts, or lacks on free
            for h in evicted if write_back else (h for h in keep if h not in tier):
                if h not in tier:
                    while tier_blocks is not None and len(tier) >= tier_blocks:
                        tier.popitem(last=False)
                tier[h] = None
                tier.move_to_end(h)
    return {"capacity_blocks": cap, "capacity_tokens": None if cap is None else cap * block_tokens,
            **count.totals(), "evictions": evictions, "tier_hit_blocks": tier_hits,
            "device_hit_rate": hit_rate(count.hit_blocks - tier_hits, count.total_blocks),
            "per_instance_block_hit_rate": list(map(hit_rate, per_hits, per_total))}
