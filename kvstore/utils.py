"""Small arithmetic shared by every layer above the kernels; imports nothing heavy."""

from __future__ import annotations

import math
import numbers
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


def check_seconds(value: object, what: str) -> float:
    """A positive finite number of seconds, as a float: TypeError naming `what` unless a real
    number (a bool is not one), ValueError unless finite and > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__} "
                        f"{value!r:.60}")
    if not 0 < float(value) < math.inf:
        raise ValueError(f"{what} must be a positive finite number of seconds, got {value!r}")
    return float(value)
