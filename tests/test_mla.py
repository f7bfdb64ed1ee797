"""Multi-head latent attention: MLASpec's page layout, the absorbed-form reference against
decompressing the cached latents, and the Triton decode kernel against the reference
(under TRITON_INTERPRET=1 on CPU).

Cases poison with NaN every page position no query may read (the null block, unused
blocks, slots past seq_len), so a match also proves those are never read."""

from __future__ import annotations

import pytest
import torch
from invariants import internals
from test_kernels import needs_triton

from kvstore import MLASpec, make_kv_cache_config
from kvstore.kernels.mla import (
    mla_attention_reference,
    mla_decode,
    mla_decompressed_reference,
    page_latents,
    split_latent,
)
from kvstore.kernels.testing import MLA_DECODE, MLA_GRID, make_mla_case, tolerance
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.single_type_kv_cache_manager import FullAttentionManager
from kvstore.specs import FullAttentionSpec

# ---- the spec ------------------------------------------------------------------------------


def test_a_page_holds_one_latent_per_token() -> None:
    spec = MLASpec(16, kv_lora_rank=512, rope_dim=64, dtype="bfloat16")
    assert (spec.num_kv_heads, spec.head_dim, spec.latent_dim) == (1, 288, 576)
    assert spec.page_size_bytes == 16 * 576 * 2
    # DeepSeek-V3's 128 heads of K and V (192 + 128 wide) per token, against one latent.
    grouped = FullAttentionSpec(16, 128, 160, dtype="bfloat16")
    assert grouped.page_size_bytes // spec.page_size_bytes == 71
    assert spec.sliding_window is None and spec.attention_chunk is None


@pytest.mark.parametrize("keys", [
    dict(kv_lora_rank=0, rope_dim=64), dict(kv_lora_rank=512, rope_dim=-1),
    dict(kv_lora_rank=7, rope_dim=4), dict(kv_lora_rank=12, rope_dim=4, head_dim=9),
    dict(kv_lora_rank=12, rope_dim=4, num_kv_heads=2), dict(kv_lora_rank=1.5, rope_dim=4),
])
def test_bad_specs_are_refused(keys: dict) -> None:
    with pytest.raises(ValueError, match="MLASpec"):
        MLASpec(16, **keys)


def test_served_by_the_full_attention_manager_beside_full_layers() -> None:
    """A latent of 16 fills pages of one head of 8: it groups with such full layers."""
    mla = MLASpec(4, kv_lora_rank=12, rope_dim=4)
    full = FullAttentionSpec(4, 1, 8)
    config = make_kv_cache_config([mla, full, mla, full], num_blocks=8)
    assert [g.spec for g in config.groups] == [mla, full]
    groups = internals(KVCacheManager(config)).groups
    assert [type(m) for m in groups] == [FullAttentionManager, FullAttentionManager]


# ---- references and the kernel ---------------------------------------------------------------


def test_absorbed_form_equals_decompressing_the_cached_latents() -> None:
    """Prefill over a cached prefix and decode: W_UV(attention over latents with W_UK^T q)
    equals attention over the decompressed per-head K and V."""
    heads, rank, rope, nope, v_dim = 4, 12, 4, 8, 6
    q_lat, q_rope, kc, vc, md = make_mla_case([1, 5, 9], [20, 13, 9], heads, rank, rope, 4)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(heads * (nope + v_dim), rank, generator=g)
    wh = w.view(heads, nope + v_dim, rank)
    q_nope = torch.randn(q_lat.shape[0], heads, nope, generator=g)
    absorbed = mla_attention_reference(torch.einsum("thn,hnr->thr", q_nope, wh[:, :nope]), q_rope,
                                       kc, vc, md, 0.3)
    out = torch.einsum("thr,hvr->thv", absorbed, wh[:, nope:])
    want = mla_decompressed_reference(q_nope, q_rope, kc, vc, md, 0.3, w)
    assert not torch.isnan(want).any()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_page_latents_round_trip() -> None:
    latent = torch.randn(5, 16)
    k, v = split_latent(latent)
    kc, vc = torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8)
    kc[1, :4], vc[1, :4] = k[:4], v[:4]
    kc[2, 0], vc[2, 0] = k[4], v[4]
    got = page_latents(kc, vc, torch.tensor([1, 1, 1, 1, 2]), torch.tensor([0, 1, 2, 3, 0]))
    assert torch.equal(got, latent)
    with pytest.raises(ValueError, match="even"):
        split_latent(torch.zeros(2, 7))


@needs_triton
@pytest.mark.parametrize("heads,rank,rope,bs,dtype,bn", MLA_GRID)
def test_decode_kernel_matches_reference(heads, rank, rope, bs, dtype, bn) -> None:
    q_lat, q_rope, kc, vc, md = make_mla_case(*MLA_DECODE, heads, rank, rope, bs, dtype,
                                              seed=heads + rank)
    ref = mla_attention_reference(q_lat, q_rope, kc, vc, md, (rank + rope) ** -0.5)
    assert not torch.isnan(ref).any()
    out = mla_decode(q_lat, q_rope, kc, vc, md, (rank + rope) ** -0.5, block_n=bn)
    assert out.shape == q_lat.shape and out.dtype == dtype
    atol, rtol = tolerance(dtype, out.device)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@needs_triton
def test_decode_kernel_refuses_what_it_does_not_run() -> None:
    q_lat, q_rope, kc, vc, md = make_mla_case([2, 1], [9, 5], 4, 12, 4, 4)
    with pytest.raises(ValueError, match="one query per sequence"):
        mla_decode(q_lat, q_rope, kc, vc, md, 0.25)
    q_lat, q_rope, kc, vc, md = make_mla_case([1], [9], 4, 12, 4, 4)
    with pytest.raises(ValueError, match="latents of 16"):
        mla_decode(q_lat[..., :8], q_rope, kc, vc, md, 0.25)
    with pytest.raises(TypeError, match="one dtype"):
        mla_decode(q_lat.half(), q_rope, kc, vc, md, 0.25)
    for name, value in (("block_h", 24), ("block_n", 8), ("num_warps", 3), ("num_splits", 0)):
        with pytest.raises(ValueError, match=f"{name} must be"):
            mla_decode(q_lat, q_rope, kc, vc, md, 0.25, **{name: value})


@needs_triton
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_with_a_launch_plan_matches_reference(splits: int) -> None:
    """Heads split over programs of block_h heads (the last one part full), another warp
    count, and split-KV (a sequence of one token leaves two of three splits empty): the
    same output. Half-latents of 30 are read as 16 + 14 columns."""
    q_lat, q_rope, kc, vc, md = make_mla_case(*MLA_DECODE, 20, 52, 8, 16, seed=3)
    ref = mla_attention_reference(q_lat, q_rope, kc, vc, md, 0.2)
    out = mla_decode(q_lat, q_rope, kc, vc, md, 0.2, block_n=16, block_h=16, num_warps=4, num_splits=splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_latents_split_otherwise_have_other_tier_keys() -> None:
    """Two MLA layouts with one latent width but another split between the compressed K/V
    and the rope part give pages of one size; the tiers must never load one as the other."""
    from kvstore.tiers import BlockLayout

    layouts = [BlockLayout.for_group("m", make_kv_cache_config(
        [MLASpec(16, kv_lora_rank=rank, rope_dim=rope)], num_blocks=4), 0)
        for rank, rope in ((512, 64), (448, 128))]
    assert layouts[0].payload_nbytes == layouts[1].payload_nbytes
    assert layouts[0].digest != layouts[1].digest
