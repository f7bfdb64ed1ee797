"""Llama 4's text model (``llama4_text``: chunked local layers with RoPE, a global NoPE
layer every fourth with attention temperature tuning, MoE with a shared expert) through
kvstore's paged cache, against transformers' own forward and ``generate``.

The harness is test_hf_backend's (prefix hits, a partial hit, a fork, chunked prefill, a
pool small enough to preempt and evict); the chunk is read from ``attention_chunk_size``
and served by ChunkedLocalAttentionSpec groups. ``floor_scale`` is small so that the
temperature differs from 1 within the tiny prompts."""

from __future__ import annotations

from typing import Any

import pytest
import test_hf_backend as hb
import torch

from kvstore.engine.engine import EngineConfig, LLMEngine
from kvstore.models.hf import layer_chunks, layer_windows, load_hf_model
from kvstore.specs import ChunkedLocalAttentionSpec, FullAttentionSpec

LLAMA4: dict[str, Any] = dict(
    num_hidden_layers=4, attention_chunk_size=6, num_local_experts=4, num_experts_per_tok=1,
    intermediate_size_mlp=128, interleave_moe_layer_step=2, floor_scale=4, attn_scale=0.5)


def run(seed: int = 0, **keys: Any) -> None:
    hb.run_family("llama4_text", seed, {**LLAMA4, **keys})


def test_llama4_text_matches_transformers() -> None:
    """Chunk 6 over blocks of 4: chunk starts fall inside blocks."""
    run()


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "chunk"), [(1, 5), (2, 8), (3, 3)])
def test_llama4_text_matches_transformers_grid(seed: int, chunk: int) -> None:
    run(seed, attention_chunk_size=chunk)


def test_layout_from_the_config() -> None:
    """Chunked layers with RoPE, every fourth global; the cache groups follow."""
    cfg = hb.hf_config("llama4_text", LLAMA4)
    assert layer_chunks(cfg) == (6, 6, 6, None)
    assert layer_windows(cfg) == (None,) * 4
    model = load_hf_model(cfg, seed=0)
    assert [model.layer_chunk(i) for i in range(4)] == [6, 6, 6, None]
    engine = LLMEngine(model, EngineConfig(num_blocks=16, block_size=hb.BLOCK))
    specs = {g.spec for g in engine.config.groups}
    assert {type(s) for s in specs} == {ChunkedLocalAttentionSpec, FullAttentionSpec}
    assert {s.attention_chunk for s in specs} == {6, None}


@pytest.mark.parametrize("size", [0, -6, None])
def test_chunked_layers_without_a_positive_chunk_are_refused(size: int | None) -> None:
    cfg = hb.hf_config("llama4_text", LLAMA4)
    cfg.attention_chunk_size = size
    with pytest.raises(ValueError, match="attention_chunk_size"):
        load_hf_model(cfg)


@pytest.mark.slow
def test_triton_kernel_through_llama4() -> None:
    """The Triton kernel (interpreted on CPU) with the chunk rule, over a prefix hit."""
    model, ref = hb.build("llama4_text", config=LLAMA4)
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=hb.BLOCK,
                                           max_num_batched_tokens=8,
                                           attention_backend="triton"))
    shared = hb.tokens(13, seed=1)
    engine.generate([shared + [1]], hb.greedy(2))
    outs = engine.generate([shared + [2, 3], hb.tokens(5, seed=2)], hb.greedy(3))
    assert engine.stats.hit_tokens > 0
    with torch.no_grad():
        for out in outs:
            hb.check_against_hf(ref, out)
