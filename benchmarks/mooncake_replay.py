"""Kept for old imports: the LRU replay lives in ``kvstore.benchmarks.replay``."""

from kvstore.benchmarks.replay import pool_replay  # noqa: F401
