"""Exceptions a caller may want to tell apart from other errors (imports nothing)."""

from __future__ import annotations

__all__ = ["RequestTooLargeError"]


class RequestTooLargeError(ValueError):
    """A request that can never run on this pool: on its own it may need more pages than
    the pool has. Retrying cannot help; a larger pool (or a shorter request) can."""

    def __init__(self, message: str, *, request_id: str = "", blocks_needed: int = 0,
                 blocks_available: int = 0) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.blocks_needed = blocks_needed
        self.blocks_available = blocks_available
