"""Kept for old imports: the layouts replay lives in ``kvstore.benchmarks.replay``."""

from kvstore.benchmarks.replay import hybrid_replay, layer_specs  # noqa: F401
