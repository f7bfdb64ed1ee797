"""Small arithmetic shared by every layer above the kernels; imports nothing heavy."""

from __future__ import annotations

from collections.abc import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks of `b` tokens needed for `a` tokens."""
    return -(-a // b)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    m = min(len(a), len(b))
    if a[:m] == b[:m]:
        return m
    lo, hi = 0, m  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo

def hit_rate(hit_tokens: int, queried_tokens: int) -> float:
    """Hit tokens over queried tokens (0 when nothing was queried)."""
    return hit_tokens / queried_tokens if queried_tokens else 0.0
