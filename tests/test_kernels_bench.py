"""The GPU benchmark's host-side pieces, and its clean refusal without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from kvstore.benchmarks import kernel_bench as kb
from kvstore.kernels import paged_attention_reference


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_refuses_without_cuda(capsys):
    assert kb.main(["--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_one_sweep_at_a_time(capsys):
    with pytest.raises(SystemExit) as e:
        kb.main(["--split-sweep", "--mla-sweep"])
    assert e.value.code == 2
    assert "--mla-sweep: not with --split-sweep" in capsys.readouterr().err


@pytest.mark.parametrize("context,q_len,window", [(10, 1, None), (10, 4, 3), (50, 50, 7),
                                                  (9, 9, None), (30, 5, 100)])
def test_visible_pairs_and_needed_bytes(context, q_len, window):
    brute = sum(1 for q in range(context - q_len, context) for k in range(context)
                if k <= q and (window is None or k > q - window))
    assert kb.visible_pairs(context, q_len, window) == brute
    keys = {k for q in range(context - q_len, context) for k in range(context)
            if k <= q and (window is None or k > q - window)}
    per_key = kb.KV_HEADS * kb.HEAD_DIM * 2 * kb.DTYPE.itemsize
    assert kb.needed_kv_bytes(3, context, q_len, window) == 3 * len(keys) * per_key


@pytest.mark.parametrize("window", [None, 40])
def test_build_paged_layout(window):
    p = kb.build_paged(2, 100, 3, window, torch.Generator().manual_seed(0), device="cpu")
    pages = math.ceil(100 / kb.BLOCK_SIZE)
    table = p.metadata.block_table
    assert table.shape == (2, pages)
    first_page = p.first_kept // kb.BLOCK_SIZE
    assert (table[:, :first_page] == 0).all() and (table[:, first_page:] > 0).all()
    assert table[:, first_page:].unique().numel() == table[:, first_page:].numel()
    # the pool holds exactly the kept pages plus the null block
    assert p.kc.shape[0] == 1 + table[:, first_page:].numel()
    # ...and the reference can run on it (every visible key is in a kept page)
    out = paged_attention_reference(p.q, p.kc, p.vc, p.metadata, 0.1, window=window)
    assert out.shape == p.q.shape and not torch.isnan(out).any()
