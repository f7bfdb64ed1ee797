"""Engines and checks shared by the engine tests: engine configs from one flat set of
keyword arguments, prompts, and the comparison of outputs with transformers' eager model."""

from __future__ import annotations

import copy
from dataclasses import fields
from typing import Any

import torch

from kvstore.engine.engine import EngineConfig, RequestOutput, SamplingParams, TierConfig
from kvstore.kv_cache_manager import CacheConfig

_CACHE = {f.name for f in fields(CacheConfig)}
_TIERS = {f.name for f in fields(TierConfig)}

ATOL = 1e-4
TIE_GAP = 1e-3


def engine_config(**kw: Any) -> EngineConfig:
    """An EngineConfig whose CacheConfig and TierConfig (made when a tier field is given
    and not None) fields are taken from the same keyword arguments as its own."""
    cache = {k: kw.pop(k) for k in list(kw) if k in _CACHE}
    tiers = {k: v for k in list(kw) if k in _TIERS and (v := kw.pop(k)) is not None}
    return EngineConfig(cache=CacheConfig(**cache), tiers=TierConfig(**tiers) if tiers else None,
                        **kw)


def tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    """``n`` seeded random token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    """Greedy sampling that keeps each step's logits."""
    return SamplingParams(max_tokens=max_tokens, n=n, return_logits=True)


def sample_tokens(outs: list[RequestOutput]) -> list[list[list[int]]]:
    """Every sample's tokens, per request."""
    return [[s.token_ids for s in o.outputs] for o in outs]


def eager_reference(model: Any) -> torch.nn.Module:
    """A copy of an HFCausalLM's transformers model with transformers' eager attention."""
    ref = copy.deepcopy(model.hf)
    ref.set_attn_implementation("eager")
    return ref.eval()


@torch.no_grad()
def check_against_hf(ref: torch.nn.Module, out: RequestOutput, atol: float = ATOL,
                     tie_gap: float = TIE_GAP) -> None:
    """Every sample's logits are transformers' rows along the sample's sequence (``ref`` run
    once over prompt + tokens), and its greedy tokens transformers' argmax wherever the top-2
    gap exceeds ``tie_gap`` (absent near-ties, the sequence *is* the greedy one)."""
    p = len(out.prompt_token_ids)
    rows: dict[tuple[int, ...], torch.Tensor] = {}  # identical samples: one run
    for sample in out.outputs:
        assert sample.logits is not None
        gen = sample.token_ids
        assert len(gen) == sample.logits.shape[0] == len(sample.logprobs)
        if tuple(gen) not in rows:
            seq = torch.tensor(out.prompt_token_ids + gen)
            rows[tuple(gen)] = ref(seq[None]).logits[0, p - 1: p - 1 + len(gen)].float()
        want = rows[tuple(gen)]
        torch.testing.assert_close(sample.logits, want, atol=atol, rtol=1e-4)
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > tie_gap
        assert torch.equal(torch.tensor(gen)[clear], want.argmax(-1)[clear]), \
            (gen, want.argmax(-1).tolist())
