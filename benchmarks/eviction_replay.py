"""Kept for old imports: the policies replay lives in ``kvstore.benchmarks.replay``."""

from kvstore.benchmarks.replay import (  # noqa: F401
    brute_force_best_hit_blocks,
    gap_closed,
    lirs_replay,
    min_replay,
    reuse_oracle_replay,
)
