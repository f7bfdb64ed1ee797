"""DeepSeek-V3.2 (``deepseek_v32``: multi-head latent attention with the lightning
indexer's top-k sparse attention) through kvstore's paged cache, against transformers' own
forward and ``generate``.

Each layer's indexer keys are cache layer ``num_layers + i`` of a second full-attention
group whose pages are shaped as the latents'; the indexer scores the cached keys over
kvstore's pages and each query attends only the latents of the tokens it selects. The
harness is test_hf_backend's (prefix hits, a partial hit, a fork, chunked prefill, a pool
small enough to preempt and evict)."""

from __future__ import annotations

from typing import Any

import pytest
import test_hf_backend as hb
import torch
from test_hf_deepseek import DEEPSEEK

from kvstore.engine.engine import EngineConfig, LLMEngine, kv_cache_specs
from kvstore.engine.runner import ModelRunner
from kvstore.kernels.metadata import AttentionMetadata
from kvstore.kernels.mla import indexer_topk, mla_attention_reference, split_latent
from kvstore.models.hf import load_hf_model
from kvstore.paged_kv_cache import PagedKVCache
from kvstore.specs import FullAttentionSpec, MLASpec, make_kv_cache_config

# A top-k well below the harness's 20-odd token sequences, so the selection bites; enough
# indexer heads that no two tokens score alike (a query's scores are exact ties only when
# every head's ReLU is zero).
DSV32: dict[str, Any] = dict(DEEPSEEK, index_topk=5, index_head_dim=16, index_n_heads=8,
                             q_lora_rank=24)


def config(**keys: Any) -> Any:
    return hb.hf_config("deepseek_v32", {**DSV32, **keys})


def run(seed: int = 0, **keys: Any) -> None:
    hb.run_family("deepseek_v32", seed, {**DSV32, **keys})


def test_deepseek_v32_matches_transformers() -> None:
    run()


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "keys"), [
    (1, dict(index_topk=3)),
    (2, dict(kv_lora_rank=12, qk_rope_head_dim=4, index_head_dim=12, index_topk=8)),
])
def test_deepseek_v32_matches_transformers_grid(seed: int, keys: dict[str, Any]) -> None:
    run(seed, **keys)


def _earlier_token_wins_ties(t: torch.Tensor, k: int, dim: int = -1, **_: Any) -> Any:
    """torch.topk (largest, sorted) with ties to the lower index."""
    values, indices = t.sort(dim=dim, descending=True, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_with_ties_transformers_matches_once_its_indexer_breaks_them_as_kvstore(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """With one indexer head many scores are exactly 0 and a query's top-k is decided among
    ties. transformers' indexer takes torch.topk over its key row, whose order among ties
    is unspecified and changes with the row's length (the cache's length); kvstore gives a
    tie to the earlier token, the same however a sequence's steps are cut. With transformers'
    indexer made to break ties that way, the two agree exactly (so ties are the only
    difference)."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as family

    forward = family.DeepseekV32Indexer.forward

    def indexer_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "topk", _earlier_token_wins_ties)
            return forward(self, *args, **kwargs)

    monkeypatch.setattr(family.DeepseekV32Indexer, "forward", indexer_forward)
    run(seed, index_n_heads=1, index_topk=4)


def test_the_indexer_keys_are_a_second_full_attention_group() -> None:
    model = load_hf_model(config(), seed=0)
    engine = LLMEngine(model, EngineConfig(num_blocks=16, block_size=hb.BLOCK))
    latents, keys = engine.config.groups
    layers = hb.BASE["num_hidden_layers"]
    assert latents.spec == MLASpec(hb.BLOCK, kv_lora_rank=16, rope_dim=8, dtype="float32")
    assert latents.layer_ids == tuple(range(layers))
    assert keys.spec == FullAttentionSpec(hb.BLOCK, 1, 12, "float32")
    assert keys.layer_ids == tuple(range(layers, 2 * layers))
    assert [model.layer_indexer(i) for i in range(layers)] == list(range(layers, 2 * layers))


def test_a_cache_without_the_indexer_keys_or_with_other_pages_is_refused() -> None:
    model = load_hf_model(config(), seed=0)
    layers = hb.BASE["num_hidden_layers"]
    specs = kv_cache_specs(model, hb.BLOCK)
    with pytest.raises(ValueError, match=f"the cache holds layers .* the model has {2 * layers}"):
        ModelRunner(model, PagedKVCache(make_kv_cache_config(specs[:layers], num_blocks=8)))
    other = specs[:layers] + [MLASpec(hb.BLOCK, kv_lora_rank=16, rope_dim=8,
                                      dtype="float32")] * layers
    with pytest.raises(ValueError, match=f"layer {layers}: cache .* the model's indexer keys"):
        ModelRunner(model, PagedKVCache(make_kv_cache_config(other, num_blocks=8)))


def test_an_indexer_key_that_does_not_fit_the_page_is_refused_naming_the_keys() -> None:
    with pytest.raises(ValueError, match="index_head_dim 32 must lie between"):
        load_hf_model(config(index_head_dim=32))


def _one_sequence(n: int, width: int, block: int = 4, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Pages holding ``n`` random rows of ``width`` elements for one sequence, and the
    metadata of one query per position."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-n // block)
    k = torch.zeros(blocks + 1, block, 1, width // 2)
    v = torch.zeros_like(k)
    rows = torch.randn(n, width, generator=g)
    table = torch.arange(1, blocks + 1, dtype=torch.int32)[None]
    slots = torch.arange(n) + block
    kh, vh = split_latent(rows)
    k.view(-1, 1, width // 2)[slots] = kh
    v.view(-1, 1, width // 2)[slots] = vh
    meta = AttentionMetadata(block_table=table, cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32), max_seqlen_q=n)
    return k, v, meta


def test_indexer_keeps_every_visible_token_up_to_topk_then_the_best() -> None:
    """A query that sees at most ``topk`` tokens keeps them all (as transformers' top-k over
    its causal mask does: the masked picks it adds are masked again in attention), and
    later ones keep the ``topk`` best visible tokens, ``-1`` past what a query sees."""
    n, dim, topk = 9, 8, 4
    k, v, meta = _one_sequence(n, dim)
    g = torch.Generator().manual_seed(1)
    q, w = torch.randn(n, 3, dim, generator=g), torch.randn(n, 3, generator=g)
    picked = indexer_topk(q, w, k, v, meta, 0.5, topk, dim)
    assert picked.shape == (n, topk)
    keys = torch.cat([k[1:, :, 0], v[1:, :, 0]], dim=-1).reshape(-1, dim)[:n]
    score = (w[:, None, :] @ torch.relu(q @ keys.T * 0.5)).squeeze(1)
    for p in range(n):
        row = picked[p].tolist()
        if p + 1 <= topk:
            assert sorted(row[: p + 1]) == list(range(p + 1)) and row[p + 1:] == [-1] * (topk - p - 1)
        else:
            assert set(row) == set(score[p, : p + 1].topk(topk).indices.tolist())


def test_sparse_attention_is_attention_over_the_selected_tokens_only() -> None:
    n, r, rope = 7, 8, 4
    k, v, meta = _one_sequence(n, r + rope)
    g = torch.Generator().manual_seed(2)
    q_latent, q_rope = torch.randn(n, 2, r, generator=g), torch.randn(n, 2, rope, generator=g)
    every = torch.arange(n)[None].expand(n, n).clone()
    dense = mla_attention_reference(q_latent, q_rope, k, v, meta, 0.3)
    # Listing every position (future ones included: causality still holds) is dense attention.
    torch.testing.assert_close(mla_attention_reference(q_latent, q_rope, k, v, meta, 0.3, every),
                               dense)
    # Listing one token is that token's latent, whatever the scores.
    one = torch.full((n, 2), -1)
    one[:, 0] = 0
    out = mla_attention_reference(q_latent, q_rope, k, v, meta, 0.3, one)
    first = torch.cat([k[1, 0, 0], v[1, 0, 0]])[:r]
    torch.testing.assert_close(out, first.expand(n, 2, r))
    with pytest.raises(ValueError, match="selected must be"):
        mla_attention_reference(q_latent, q_rope, k, v, meta, 0.3, one[:3])


def test_equal_scores_go_to_the_earlier_token_however_the_steps_are_cut() -> None:
    """One indexer head: a key's score is exactly 0 wherever ``q·k < 0``, so many visible
    tokens tie. The earlier token wins a tie, and a query selects the same tokens whether
    its sequence is prefilled at once or decoded a token at a time. (torch.topk, which
    transformers' indexer uses over its padded key row, orders ties by an unspecified rule
    that changes with the row's length: there a tie's winner can depend on how much the
    cache holds.)"""
    n, dim, topk = 12, 8, 3
    k, v, meta = _one_sequence(n, dim)
    g = torch.Generator().manual_seed(3)
    q, w = torch.randn(n, 1, dim, generator=g), torch.ones(n, 1)
    at_once = indexer_topk(q, w, k, v, meta, 1.0, topk, dim)
    keys = torch.cat([k[1:, :, 0], v[1:, :, 0]], dim=-1).reshape(-1, dim)[:n]
    score = torch.relu(q[:, 0] @ keys.T)
    for p in range(n):
        one = AttentionMetadata(block_table=meta.block_table,
                                cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                                seq_lens=torch.tensor([p + 1], dtype=torch.int32), max_seqlen_q=1)
        assert torch.equal(indexer_topk(q[p:p + 1], w[p:p + 1], k, v, one, 1.0, topk, dim)[0],
                           at_once[p])
        visible = score[p, : p + 1].tolist()
        want = sorted(range(p + 1), key=lambda j: (-visible[j], j))[:topk]
        assert at_once[p, : len(want)].tolist() == want
    assert (score == 0).sum() > n  # the case is exercised: many exact ties
    # All scores equal: every query past topk keeps the first topk tokens.
    zero = indexer_topk(torch.zeros_like(q), w, k, v, meta, 1.0, topk, dim)
    assert zero[topk:].tolist() == [[0, 1, 2]] * (n - topk)
