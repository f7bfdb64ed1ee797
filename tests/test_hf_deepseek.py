"""DeepSeek-V3 (``deepseek_v3``: multi-head latent attention, MoE with shared experts and
group-limited routing) through kvstore's paged cache, against transformers' own forward
and ``generate``.

Each attention module's forward is replaced by one that writes the token's latent into an
MLASpec group's pages and attends over the cached latents in the absorbed form. The
harness is test_hf_backend's (prefix hits, a partial hit, a fork, chunked prefill, a pool
small enough to preempt and evict)."""

from __future__ import annotations

from typing import Any

import pytest
import test_hf_backend as hb
import torch

from kvstore.engine.engine import EngineConfig, LLMEngine
from kvstore.models.hf import load_hf_model
from kvstore.specs import MLASpec

DEEPSEEK: dict[str, Any] = dict(
    num_key_value_heads=4, head_dim=8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
    topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32, n_shared_experts=1)


def run(seed: int = 0, **keys: Any) -> None:
    hb.run_family("deepseek_v3", seed, {**DEEPSEEK, **keys})


def test_deepseek_v3_matches_transformers() -> None:
    run()


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "keys"), [
    (1, dict(q_lora_rank=None, rope_interleave=False)),
    (2, dict(kv_lora_rank=12, qk_rope_head_dim=4, head_dim=4)),
])
def test_deepseek_v3_matches_transformers_grid(seed: int, keys: dict[str, Any]) -> None:
    run(seed, **keys)


def config(**keys: Any) -> Any:
    return hb.hf_config("deepseek_v3", {**DEEPSEEK, **keys})


def test_the_cache_holds_one_latent_per_token() -> None:
    model = load_hf_model(config(), seed=0)
    engine = LLMEngine(model, EngineConfig(num_blocks=16, block_size=hb.BLOCK))
    (group,) = engine.config.groups
    assert group.spec == MLASpec(hb.BLOCK, kv_lora_rank=16, rope_dim=8, dtype="float32")
    assert group.spec.page_size_bytes == hb.BLOCK * (16 + 8) * 4


def test_odd_latent_is_refused_naming_the_keys() -> None:
    with pytest.raises(ValueError, match="kv_lora_rank 15 \\+ qk_rope_head_dim 8 is odd"):
        load_hf_model(config(kv_lora_rank=15))


def test_outside_the_engine_the_module_needs_the_batch_or_another_implementation() -> None:
    model = load_hf_model(config(), seed=0)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="runs only inside kvstore's engine"):
        model.hf(input_ids=ids)
    model.hf.set_attn_implementation("eager")
    assert model.hf(input_ids=ids).logits.shape == (1, 3, hb.VOCAB)


@pytest.mark.slow
def test_triton_decode_kernel_through_deepseek_v3() -> None:
    """Decode steps run the Triton MLA kernel (interpreted on CPU), prefill the reference."""
    model, ref = hb.build("deepseek_v3", config=DEEPSEEK)
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=hb.BLOCK,
                                           max_num_batched_tokens=8,
                                           attention_backend="triton"))
    shared = hb.tokens(13, seed=1)
    engine.generate([shared + [1]], hb.greedy(2))
    outs = engine.generate([shared + [2, 3], hb.tokens(5, seed=2)], hb.greedy(3))
    assert engine.stats.hit_tokens > 0
    for out in outs:
        hb.check_against_hf(ref, out)


@pytest.mark.slow
def test_another_family_with_deepseek_v3_attention_matches_transformers() -> None:
    """GLM-4.7-Flash's config chooses its RoPE by rope_interleave as DeepSeek-V3's does."""
    hb.run_family("glm4_moe_lite", 0, DEEPSEEK)


def test_latent_attention_of_another_form_is_refused_naming_the_key() -> None:
    """DeepSeek-V2's config has no rope_interleave (its RoPE is another form)."""
    with pytest.raises(ValueError, match="rope_interleave"):
        load_hf_model(hb.hf_config("deepseek_v2", DEEPSEEK))
