"""Tests for the benchmark workload generators and trace loaders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvstore.benchmarks import traces
from kvstore.benchmarks.traces import (
    MooncakeRequest,
    load_azure,
    load_mooncake,
    mooncake_lru_replay,
    mooncake_paper_points,
    mooncake_to_workload,
)
from kvstore.benchmarks.workloads import (
    WORKLOADS,
    RequestSpec,
    Workload,
    arrival_times,
    few_shot,
    heavy_tailed_lengths,
    ideal_hit_tokens,
    make_workload,
    mixed_default,
    multi_turn_chat,
    shared_system_prompts,
    unique_prompts,
)

SMALL = {
    "shared_system_prompts": {"num_requests": 40},
    "multi_turn_chat": {"num_conversations": 6, "turns": 3},
    "few_shot": {"num_requests": 30},
    "unique_prompts": {"num_requests": 30},
    "mixed_default": {"num_requests": 60},
}


def _req(rid: str, t: float, prompt: tuple[int, ...], salt: str | None = None) -> RequestSpec:
    return RequestSpec(rid, t, prompt, 1, salt)


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------- generators


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_deterministic_per_seed(name: str) -> None:
    a = make_workload(name, seed=3, **SMALL[name])
    b = make_workload(name, seed=3, **SMALL[name])
    c = make_workload(name, seed=4, **SMALL[name])
    assert a == b
    assert [r.prompt_token_ids for r in a.requests] != [r.prompt_token_ids for r in c.requests]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_well_formed(name: str) -> None:
    w = make_workload(name, seed=1, **SMALL[name])
    assert isinstance(w, Workload) and w.requests and w.description
    arrivals = [r.arrival for r in w.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    assert len({r.request_id for r in w.requests}) == len(w.requests)
    for r in w.requests:
        assert isinstance(r.prompt_token_ids, tuple) and len(r.prompt_token_ids) > 0
        assert all(type(t) is int for t in r.prompt_token_ids[:50])
        assert 0 <= min(r.prompt_token_ids) and max(r.prompt_token_ids) < 32000
        assert r.max_tokens >= 1
        assert r.output_token_ids is None or len(r.output_token_ids) == r.max_tokens


def test_vocab_size_respected() -> None:
    w = unique_prompts(20, vocab_size=50, seed=0)
    assert max(max(r.prompt_token_ids) for r in w.requests) < 50


def test_make_workload_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope")


def test_shared_system_prompts_share_prefix() -> None:
    lens = (200, 700, 1300)
    w = shared_system_prompts(60, num_prompts=3, system_lens=lens, user_len=(5, 50), seed=0)
    groups: dict[tuple[int, ...], list[RequestSpec]] = {}
    for r in w.requests:
        head = next(r.prompt_token_ids[:n] for n in lens if len(r.prompt_token_ids) - n <= 50)
        groups.setdefault(head, []).append(r)
    assert len(groups) == 3
    assert sorted(len(h) for h in groups) == sorted(lens)
    for head, rs in groups.items():
        assert len(rs) >= 2
        for r in rs:
            assert r.prompt_token_ids[: len(head)] == head
            assert 5 <= len(r.prompt_token_ids) - len(head) <= 50


def test_chat_turns_extend_previous_turn() -> None:
    w = multi_turn_chat(5, 4, system_len=30, seed=2)
    convs: dict[str, list[RequestSpec]] = {}
    for r in w.requests:
        convs.setdefault(r.request_id.rsplit("-t", 1)[0], []).append(r)
    assert len(convs) == 5
    for turns in convs.values():
        turns.sort(key=lambda r: r.request_id)
        assert len(turns) == 4
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert prev.output_token_ids is not None
            head = prev.prompt_token_ids + prev.output_token_ids
            assert nxt.prompt_token_ids[: len(head)] == head
            assert len(nxt.prompt_token_ids) > len(head)
            assert nxt.arrival > prev.arrival
    firsts = [t[0].prompt_token_ids[:30] for t in convs.values()]
    assert len(set(firsts)) == 1  # one shared system prompt


def test_chat_turn_range() -> None:
    w = multi_turn_chat(20, (1, 5), seed=0)
    per_conv: dict[str, int] = {}
    for r in w.requests:
        key = r.request_id.rsplit("-t", 1)[0]
        per_conv[key] = per_conv.get(key, 0) + 1
    assert set(per_conv.values()) <= set(range(1, 6)) and len(set(per_conv.values())) > 1


@pytest.mark.parametrize("seed", range(6))
def test_few_shot_prefix_not_block_aligned(seed: int) -> None:
    w = few_shot(20, 5, example_len=(16, 32), seed=seed)
    p = [r.prompt_token_ids for r in w.requests]
    prefix_len = min(_lcp(a, b) for a, b in zip(p, p[1:], strict=False))
    assert prefix_len % 2 == 1 and prefix_len >= 5 * 16
    # Full-block ideal loses the partial block after the shared prefix.
    assert ideal_hit_tokens(w.requests, 16).total < ideal_hit_tokens(w.requests).total


def test_few_shot_tasks() -> None:
    w = few_shot(40, 4, num_tasks=3, seed=0)
    heads = {r.prompt_token_ids[:20] for r in w.requests}
    assert len(heads) == 3


def test_unique_prompts_do_not_share() -> None:
    w = unique_prompts(50, prompt_len=(10, 100), seed=0)
    assert ideal_hit_tokens(w.requests, 16).total == 0
    assert ideal_hit_tokens(w.requests).total <= 3  # chance agreement on a token or so


def test_heavy_tailed_lengths() -> None:
    x = heavy_tailed_lengths(0, 5000, median=100, sigma=1.2, low=1, high=4096)
    assert x.dtype == np.int64 and x.min() >= 1 and x.max() <= 4096
    assert 80 <= np.median(x) <= 120
    assert x.max() > 20 * np.median(x)
    assert np.quantile(x, 0.99) > 10 * np.median(x)
    assert np.array_equal(x, heavy_tailed_lengths(0, 5000, median=100, sigma=1.2, high=4096))
    outs = np.array([r.max_tokens for r in mixed_default(seed=0).requests])
    assert outs.max() > 8 * np.median(outs)


def test_arrival_times() -> None:
    pois = arrival_times(0, 2000, 10.0)
    assert pois[0] == 0 and np.all(np.diff(pois) >= 0)
    assert 150 < pois[-1] < 250
    assert np.all(arrival_times(0, 4, float("inf")) == 0)
    with pytest.raises(ValueError, match="rate"):
        arrival_times(0, 4, 0.0)


def test_mixed_default_size() -> None:
    w = mixed_default()
    assert len(w.requests) == 300
    assert w.num_prompt_tokens <= 300_000
    kinds = {r.request_id.split("-")[0] for r in w.requests}
    assert kinds == {"sys", "chat", "fewshot", "unique"}
    assert mixed_default(seed=0) == w
    assert len(mixed_default(num_requests=7).requests) == 7


# ------------------------------------------------------------------- ideal hits


def test_ideal_hit_tokens_hand_made() -> None:
    reqs = [
        _req("a", 0.0, (1, 2, 3, 4, 5, 6)),
        _req("b", 1.0, (1, 2, 3, 9)),  # LCP 3 with a
        _req("c", 2.0, (1, 2, 3, 4, 5, 6)),  # equal to a: capped at 5
        _req("d", 3.0, (7,)),  # nothing
        _req("e", 4.0, (1, 2, 3, 9, 9, 9, 9)),  # LCP 4 with b
        _req("f", 5.0, (1, 2)),  # fully covered: capped at 1
    ]
    got = ideal_hit_tokens(reqs)
    assert got.per_request == [0, 3, 5, 0, 4, 1]
    assert got.total == 13 and got.prompt_tokens == 26
    assert got.rate == pytest.approx(13 / 26)
    assert ideal_hit_tokens(reqs, block_size=2).per_request == [0, 2, 4, 0, 4, 0]
    assert ideal_hit_tokens(reqs, block_size=4).per_request == [0, 0, 4, 0, 4, 0]
    assert ideal_hit_tokens([]).total == 0


def test_ideal_hit_tokens_uses_arrival_order_and_salt() -> None:
    reqs = [
        _req("late", 5.0, (1, 2, 3, 4)),
        _req("early", 1.0, (1, 2, 3, 5)),
        _req("salted", 6.0, (1, 2, 3, 4), salt="x"),
    ]
    assert ideal_hit_tokens(reqs).per_request == [3, 0, 0]


def test_ideal_hit_tokens_include_outputs() -> None:
    a = RequestSpec("a", 0.0, (1, 2), 2, output_token_ids=(3, 4))
    b = RequestSpec("b", 1.0, (1, 2, 3, 4, 5), 1)
    assert ideal_hit_tokens([a, b]).per_request == [0, 2]
    assert ideal_hit_tokens([a, b], include_outputs=True).per_request == [0, 4]


def test_ideal_hit_tokens_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(120):
        n = int(rng.integers(1, 12))
        reqs.append(_req(str(i), float(rng.integers(0, 30)), tuple(rng.integers(0, 3, n).tolist())))
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    for bs in (None, 1, 3):
        want = [0] * len(reqs)
        for j, i in enumerate(order):
            p = reqs[i].prompt_token_ids
            best = max((_lcp(p, reqs[k].prompt_token_ids) for k in order[:j]), default=0)
            hit = min(best, len(p) - 1)
            want[i] = hit - hit % bs if bs else hit
        assert ideal_hit_tokens(reqs, bs).per_request == want


def test_ideal_hits_on_generated_structure() -> None:
    w = shared_system_prompts(20, num_prompts=1, system_lens=(100,), user_len=(10, 10), seed=0)
    hits = ideal_hit_tokens(w.requests)
    assert hits.per_request[0] == 0
    assert all(h >= 100 for h in hits.per_request[1:])
    assert all(100 <= h <= 109 for h in hits.per_request[1:])
    assert ideal_hit_tokens(w.requests, 16).per_request == [0] + [96] * 19


# ------------------------------------------------------------------------ traces


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MOONCAKE_ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 3000, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 3000, "input_length": 600, "output_length": 9, "hash_ids": [0, 3]},
    {"timestamp": 1500, "input_length": 1300, "output_length": 2, "hash_ids": [0, 1, 4]},
]


def test_load_mooncake(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "t.jsonl", MOONCAKE_ROWS)
    reqs = load_mooncake(p)
    assert reqs[0] == MooncakeRequest(0, 1100, 7, (0, 1, 2))
    assert len(reqs) == 4 and len(load_mooncake(p, limit=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_mooncake(bad)


def test_mooncake_to_workload(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "t.jsonl", MOONCAKE_ROWS)
    w = mooncake_to_workload(p, vocab_size=1000)
    assert [r.arrival for r in w.requests] == [0.0, 1.5, 3.0, 3.0]
    by_len = {len(r.prompt_token_ids): r for r in w.requests}
    assert set(by_len) == {1100, 1024, 600, 1300}  # lengths equal input_length
    r1100, r1024, r600, r1300 = (by_len[n].prompt_token_ids for n in (1100, 1024, 600, 1300))
    assert r1100[:1024] == r1024 == r1300[:1024]  # ids 0, 1 shared
    assert r600[:512] == r1100[:512]  # id 0 shared
    assert r600[512:] != r1100[512:600]  # id 3 != id 1
    assert r1100[1024:1100] != r1300[1024:1100]  # id 2 != id 4
    assert r1100[:512] != r1100[512:1024]  # blocks differ within a request
    assert by_len[1100].max_tokens == 7
    assert max(max(r.prompt_token_ids) for r in w.requests) < 1000
    # The same content when given loaded rows; the last block is partial.
    w2 = mooncake_to_workload(load_mooncake(p), vocab_size=1000)
    assert [r.prompt_token_ids for r in w2.requests] == [r.prompt_token_ids for r in w.requests]
    assert len(mooncake_to_workload(p, limit=1).requests) == 1
    # A partial block is the start of the same id's full block.
    full = mooncake_to_workload([MooncakeRequest(0, 1536, 1, (0, 1, 2))], vocab_size=1000)
    assert full.requests[0].prompt_token_ids[:1100] == r1100
    with pytest.raises(ValueError, match="hash ids"):
        mooncake_to_workload([MooncakeRequest(0, 1100, 1, (0, 1))])


def test_load_azure(tmp_path: Path) -> None:
    p = tmp_path / "az.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,40,10\n"
        "2023-11-16 18:17:04.0319600,30,8\n"
        "2023-11-16 18:18:04.0000000,25,300\n"
    )
    w = load_azure(p, seed=1)
    assert [len(r.prompt_token_ids) for r in w.requests] == [40, 30, 25]
    assert [r.max_tokens for r in w.requests] == [10, 8, 300]
    assert [r.arrival for r in w.requests] == pytest.approx([0.0, 0.052, 60.02004])
    assert ideal_hit_tokens(w.requests, 16).total == 0
    assert load_azure(p, seed=1) == w
    assert load_azure(p, seed=2) != w
    assert len(load_azure(p, limit=2).requests) == 2


def test_paper_points(tmp_path: Path) -> None:
    p = tmp_path / "pts.csv"
    p.write_text(
        "workload,capacity_tokens,capacity_blocks_512,source,token_hit_rate,block_hit_rate\n"
        "conversation,100000,195,eye,0.073,\n"
        "conversation,10000,19,eye,0.045,\n"
        "synthetic,10000,19,eye,0.0,\n"
    )
    assert mooncake_paper_points(p) == {
        "conversation": [(10000, 0.045), (100000, 0.073)],
        "synthetic": [(10000, 0.0)],
    }


def test_trace_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_TRACES", str(tmp_path))
    assert traces.trace_file("azure_code") == tmp_path / "azure_llm_inference_2023_code.csv"
    with pytest.raises(FileNotFoundError, match="not in .*download data/AzureLLMInference"):
        traces.locate_trace("azure_code")
    monkeypatch.setenv("KVSTORE_TRACES", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        traces.trace_file("azure_code")


def _mc(t: int, ids: tuple[int, ...], n: int | None = None) -> MooncakeRequest:
    return MooncakeRequest(t, n if n is not None else 512 * len(ids), 1, ids)


def test_lru_replay_hand_made() -> None:
    reqs = [
        _mc(0, (0, 1, 2)),  # miss; cache (LRU first): 2 1 0
        _mc(1, (0, 1, 3), 1100),  # hit 0,1; 3 evicts 2; cache: 3 1 0
        _mc(2, (0, 5)),  # hit 0; 5 evicts 3; cache: 1 5 0
        _mc(3, (0, 1, 2)),  # hit 0,1 (2 was evicted); 2 evicts 5; cache: 2 1 0
        _mc(4, (0, 1), 700),  # hit both, capped at input_length: 700
        _mc(5, (9, 0)),  # a leading miss: no hit although 0 is cached
    ]
    r = mooncake_lru_replay(reqs, capacity_blocks=3)
    assert r["per_request_hit_tokens"] == [0, 1024, 512, 1024, 700, 0]
    assert r["hit_tokens"] == 3260
    assert r["input_tokens"] == 1536 + 1100 + 1024 + 1536 + 700 + 1024
    assert r["token_hit_rate"] == pytest.approx(3260 / r["input_tokens"])
    assert r["hit_blocks"] == 7 and r["total_blocks"] == 15
    assert r["evictions"] == 4  # 2, 3, 5, then 2 for (9, 0); cache ends 1 0 9
    # Unbounded: every earlier id stays.
    assert mooncake_lru_replay(reqs, None)["per_request_hit_tokens"] == [
        0,
        1024,
        512,
        1536,
        700,
        0,
    ]
    assert mooncake_lru_replay(reqs, 0)["hit_tokens"] == 0


def test_lru_replay_order_and_long_requests() -> None:
    # Out-of-order rows are replayed by timestamp.
    rows = [_mc(5, (0, 1)), _mc(1, (0, 1))]
    assert mooncake_lru_replay(rows, 4)["per_request_hit_tokens"] == [0, 1024]
    # A request longer than the cache keeps its root-side blocks.
    rows = [_mc(0, (0, 1, 2, 3, 4)), _mc(1, (0, 1, 7))]
    assert mooncake_lru_replay(rows, 2)["per_request_hit_tokens"] == [0, 1024]
    # The root outlives the deeper blocks of an older chain.
    rows = [_mc(0, (0, 1)), _mc(1, (8,)), _mc(2, (0, 1))]
    assert mooncake_lru_replay(rows, 2)["per_request_hit_tokens"] == [0, 0, 512]


def _real_trace(name: str) -> Path:
    try:
        path = traces.trace_file(name)
    except FileNotFoundError:
        pytest.skip("trace directory not available")
    if not path.exists():
        pytest.skip(f"{path} not available")
    return path


def test_real_mooncake_slice_ideal_matches_oracle() -> None:
    reqs = load_mooncake(_real_trace("mooncake_conversation"), limit=150)
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in reqs)
    w = mooncake_to_workload(reqs)
    oracle = mooncake_lru_replay(reqs, None)
    ideal = ideal_hit_tokens(w.requests, 512)
    # Same counting except that the ideal never covers a prompt's last token.
    assert oracle["hit_tokens"] > 0
    assert 0 <= oracle["hit_tokens"] - ideal.total <= 512 * len(reqs)
    assert ideal.total / oracle["hit_tokens"] > 0.99
