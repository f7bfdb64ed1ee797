"""Attention sinks (gpt-oss): one learned logit per query head in every row's softmax.

The reference is checked against a dense implementation of the gpt-oss formula (and
against transformers' own ``eager_attention_forward`` where it is installed); the kernel,
single-pass and split-KV, against the reference over the NaN-poisoned grid, under
TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from kvstore.kernels import attention, paged_attention, paged_attention_reference
from kvstore.kernels.testing import GRID, Case, make_case, tolerance

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)


def _ref(case: Case, **kw) -> torch.Tensor:
    return paged_attention_reference(*case.args(), **{**case.kwargs(), **kw})


def _run(case: Case, **kw) -> torch.Tensor:
    return paged_attention(*case.args(), **{**case.kwargs(), **kw})


def _dense_kv(case: Case, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``i``'s whole context gathered from the pages: K, V ``[Hkv, seq_len, D]``."""
    bs = case.key_cache.shape[1]
    seq_len = int(case.metadata.seq_lens[i])
    pos = torch.arange(seq_len)
    blocks = case.metadata.block_table[i, pos // bs].long()
    k = case.key_cache[blocks, pos % bs].float().transpose(0, 1)
    v = case.value_cache[blocks, pos % bs].float().transpose(0, 1)
    return k, v


def _additive_mask(seq_len: int, q_len: int, window: int | None) -> torch.Tensor:
    """``[q_len, seq_len]``: 0 where the query may see the key, -inf elsewhere."""
    kpos = torch.arange(seq_len)
    qpos = torch.arange(seq_len - q_len, seq_len)
    ok = kpos[None] <= qpos[:, None]
    if window is not None:
        ok &= kpos[None] > qpos[:, None] - window
    return torch.zeros(ok.shape).masked_fill(~ok, float("-inf"))


def _gpt_oss_dense(q, k, v, sinks, scale, mask):
    """gpt-oss eager attention, written out: q ``[H, nq, D]``, k/v ``[Hkv, nk, D]``."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    logits = q @ k.transpose(1, 2) * scale + mask
    sink = sinks.float().reshape(-1, 1, 1).expand(-1, q.shape[1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return (probs @ v).transpose(0, 1)  # [nq, H, D]


# --- the reference against the gpt-oss formula --------------------------------------------


@pytest.mark.parametrize("window", [None, 1, 13])
def test_reference_matches_dense_gpt_oss_formula(window):
    case = make_case([5, 1, 12], [29, 40, 12], 8, 2, 32, 16, None, with_sinks=True)
    ref = _ref(case, window=window)
    cu = case.metadata.cu_seqlens_q.tolist()
    for i, seq_len in enumerate(case.metadata.seq_lens.tolist()):
        q0, q1 = cu[i], cu[i + 1]
        k, v = _dense_kv(case, i)
        dense = _gpt_oss_dense(case.q[q0:q1].float().transpose(0, 1), k, v, case.sinks,
                               case.scale, _additive_mask(seq_len, q1 - q0, window))
        torch.testing.assert_close(ref[q0:q1], dense, atol=1e-5, rtol=1e-5)


def test_reference_matches_transformers_gpt_oss_eager():
    """transformers' own gpt-oss attention, fed the same dense K/V, mask and sinks."""
    pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    h, hkv, window = 8, 2, 9
    case = make_case([6, 1], [30, 21], h, hkv, 32, 16, None, with_sinks=True)
    ref = _ref(case, window=window)
    module = SimpleNamespace(sinks=case.sinks, num_key_value_groups=h // hkv, training=False)
    cu = case.metadata.cu_seqlens_q.tolist()
    for i, seq_len in enumerate(case.metadata.seq_lens.tolist()):
        q0, q1 = cu[i], cu[i + 1]
        k, v = _dense_kv(case, i)
        mask = _additive_mask(seq_len, q1 - q0, window)[None, None]
        out, _ = eager_attention_forward(module, case.q[q0:q1].transpose(0, 1)[None], k[None],
                                         v[None], mask, scaling=case.scale)
        torch.testing.assert_close(ref[q0:q1], out[0], atol=1e-5, rtol=1e-5)


def test_single_visible_key_weight_is_a_sigmoid():
    """Window 1: each query sees only itself, weight e^s / (e^s + e^sink) = sigmoid(s - sink)."""
    case = make_case([3], [7], 4, 4, 16, 16, None, with_sinks=True)
    out = _ref(case, window=1)
    k, v = _dense_kv(case, 0)
    for j in range(3):
        pos = 7 - 3 + j
        s = (case.q[j] * k[:, pos]).sum(-1) * case.scale
        want = torch.sigmoid(s - case.sinks)[:, None] * v[:, pos]
        torch.testing.assert_close(out[j], want, atol=1e-6, rtol=1e-5)


def test_softcap_applies_to_scores_not_to_the_sink():
    case = make_case([1], [5], 4, 4, 16, 16, None, with_sinks=True, q_scale=5.0)
    cap = 1.5
    out = _ref(case, softcap=cap)
    k, v = _dense_kv(case, 0)
    logits = cap * torch.tanh(torch.einsum("hd,hkd->hk", case.q[0], k) * case.scale / cap)
    p = torch.softmax(torch.cat([logits, case.sinks[:, None]], -1), -1)[:, :-1]
    torch.testing.assert_close(out[0], torch.einsum("hk,hkd->hd", p, v), atol=1e-6, rtol=1e-5)


# --- the kernel against the reference ------------------------------------------------------


@pytest.mark.parametrize(
    "name,lens,h,hkv,d,bs,window,softcap,splits,dtype,bm,bn", GRID, ids=[c[0] for c in GRID]
)
@pytest.mark.slow
def test_grid_with_sinks_matches_reference(name, lens, h, hkv, d, bs, window, softcap, splits,
                                           dtype, bm, bn):
    case = make_case(*lens, h, hkv, d, bs, window, softcap, dtype, seed=hash(name) % 1000,
                     q_scale=3.0 if softcap else 1.0, with_sinks=True)
    ref = _ref(case)
    assert not torch.isnan(ref).any(), "the reference read a poisoned position"
    # the sinks matter in this case: the result differs from attention without them
    assert (ref.float() - _ref(case, sinks=None).float()).abs().max() > 0.05
    out = _run(case, num_splits=splits, block_m=bm, block_n=bn)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    atol, rtol = tolerance(dtype, out.device)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.slow
@pytest.mark.parametrize("splits", [1, 2, 7, 16])
def test_split_kv_adds_the_sink_once(splits):
    """Many splits, several of them empty for the short sequence: the sink enters once."""
    case = make_case([1, 1, 3], [500, 40, 3], 8, 2, 16, 16, None, with_sinks=True,
                     sink_scale=1.0)
    ref = _ref(case)
    out = _run(case, num_splits=splits, block_m=16, block_n=16)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_minus_inf_sinks_are_bitwise_no_sinks(splits):
    """A sink of -inf adds nothing: the kernel's output is bit for bit that without sinks."""
    case = make_case([1, 6], [70, 33], 8, 2, 32, 16, 20)
    none = _run(case, num_splits=splits)
    neg = _run(case, num_splits=splits, sinks=torch.full((8,), float("-inf")))
    assert torch.equal(none, neg)
    torch.testing.assert_close(_ref(case, sinks=torch.full((8,), float("-inf"))), _ref(case))


@pytest.mark.parametrize("sink,dtype", [(60.0, torch.float32), (1e4, torch.float32),
                                        (300.0, torch.bfloat16), (3e4, torch.float16)])
@pytest.mark.parametrize("splits", [1, 3])
def test_dominant_sink_gives_near_zero_output(sink, dtype, splits):
    """A sink far above every logit takes all the probability: output ~0, never NaN/inf."""
    case = make_case([1, 6], [70, 33], 8, 2, 32, 16, 40, dtype=dtype)
    sinks = torch.full((8,), sink, dtype=dtype)
    for out in (_ref(case, sinks=sinks), _run(case, sinks=sinks, num_splits=splits)):
        assert torch.isfinite(out).all()
        assert out.float().abs().max() < 1e-12


def test_noncontiguous_sinks_and_entry_point_backends():
    case = make_case([1, 4], [20, 33], 8, 2, 64, 16, 16, 2.0, q_scale=3.0, with_sinks=True)
    strided = torch.stack([case.sinks, torch.full_like(case.sinks, float("nan"))], 1)[:, 0]
    assert not strided.is_contiguous()
    ref = _ref(case)
    kw = {**case.kwargs(), "sinks": strided}
    assert torch.equal(attention(*case.args(), **kw), ref)  # CPU "auto" is the reference
    assert torch.equal(attention(*case.args(), **kw, backend="reference"), ref)
    for splits in (1, 2):
        torch.testing.assert_close(
            attention(*case.args(), **kw, backend="triton", num_splits=splits), ref,
            atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference, attention])
def test_bad_sinks_raise_clear_errors(fn):
    case = make_case([1], [20], 8, 2, 64, 16, None)
    args = case.args()
    with pytest.raises(ValueError, match=r"sinks must have shape \[num_heads\] = \(8,\)"):
        fn(*args, sinks=torch.zeros(2))  # one per KV head is not enough
    with pytest.raises(ValueError, match="shape"):
        fn(*args, sinks=torch.zeros(1, 8))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        fn(*args, sinks=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        fn(*args, sinks=torch.zeros(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="tensor"):
        fn(*args, sinks=[0.0] * 8)
    with pytest.raises(ValueError, match="sinks are on meta"):
        fn(*args, sinks=torch.zeros(8, device="meta"))


# --- the engine passes a model's per-layer sinks through -----------------------------------


def test_runner_passes_layer_sinks():
    pytest.importorskip("transformers")
    from kvstore.engine.engine import kv_cache_specs
    from kvstore.engine.runner import BatchInputs, ModelRunner, PagedAttention
    from kvstore.kernels import AttentionMetadata
    from kvstore.models.presets import build_preset
    from kvstore.paged_kv_cache import PagedKVCache
    from kvstore.specs import make_kv_cache_config

    model = build_preset("llama")
    c = model.config
    block, n, scale = 4, 6, c.head_dim ** -0.5  # one fresh prompt of 6 tokens in blocks 3 and 5
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n, c.num_heads, c.head_dim, generator=g)
    k, v = torch.randn(2, n, c.num_kv_heads, c.head_dim, generator=g)
    sinks = torch.randn(c.num_heads, generator=g) * 3
    cache = PagedKVCache(make_kv_cache_config(kv_cache_specs(model, block), num_blocks=8))
    runner = ModelRunner(model, cache)
    meta = AttentionMetadata(torch.tensor([[3, 5]], dtype=torch.int32),
                             torch.tensor([0, n], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), n)
    slots = torch.tensor([12, 13, 14, 15, 20, 21])
    groups = runner.num_groups
    batch = BatchInputs(input_ids=torch.zeros(n, dtype=torch.long), positions=torch.arange(n),
                        attn_metadata=[meta] * groups, slot_mappings=[slots] * groups,
                        logits_indices=torch.tensor([n - 1]), sample_request_ids=["a"])
    attention = PagedAttention(runner, batch)
    for layer in range(2):
        plain = attention.attend(layer, q, k, v, scale=scale)
        sunk = attention.attend(layer, q, k, v, scale=scale, sinks=sinks)
        kc, vc = cache.layer_caches(layer)
        assert torch.equal(plain, paged_attention_reference(q, kc, vc, meta, scale))
        assert torch.equal(sunk, paged_attention_reference(q, kc, vc, meta, scale, sinks=sinks))
        assert not torch.allclose(plain, sunk)
        assert math.isfinite(float(sunk.abs().max()))
