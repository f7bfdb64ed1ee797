"""The cache layer's view of one sequence: its tokens, progress, salt and block hashes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.hashing import BlockHash, HashFn, root_hash


def as_token_list(token_ids: Sequence[int] | np.ndarray, what: str = "token ids") -> list[int]:
    """Validate token ids (non-negative integers) and return them as a list."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{what} must be non-negative, got {int(arr.min())}")
    return arr.astype(np.int64, copy=False).tolist()


class Request:
    """A sequence as the cache sees it; the scheduler advances `num_computed_tokens`."""

    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "cache_salt",
        "block_hashes",
        "hash_fn",
        "max_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        cache_salt: str | None = None,
        max_tokens: int = 0,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        tokens = as_token_list(prompt_token_ids, "prompt_token_ids")
        if not tokens:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.request_id = request_id
        self.token_ids: list[int] = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.block_hashes: list[BlockHash] = []
        # The function `block_hashes` were computed with (None until the first is).
        self.hash_fn: HashFn | None = None
        self.max_tokens = max_tokens

    @property
    def num_tokens(self) -> int:
        """All tokens so far: prompt plus generated."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token_ids(self, token_ids: Sequence[int] | int) -> None:
        """Append generated tokens."""
        if isinstance(token_ids, int):
            if token_ids < 0:
                raise ValueError(f"token id must be non-negative, got {token_ids}")
            self.token_ids.append(token_ids)
        else:
            self.token_ids.extend(as_token_list(token_ids))

    def update_block_hashes(self, block_size: int, hash_fn: HashFn) -> list[BlockHash]:
        """Hash the blocks that became full since the last call; earlier hashes are kept.
        ValueError if earlier hashes were computed with another function."""
        if hash_fn is not self.hash_fn:
            if self.block_hashes:
                raise ValueError(f"request {self.request_id!r} was hashed with another hash "
                                 "function than this cache's")
            self.hash_fn = hash_fn
        hashes = self.block_hashes
        n_full = len(self.token_ids) // block_size
        if len(hashes) < n_full:
            parent = hashes[-1] if hashes else root_hash(self.cache_salt)
            tokens = self.token_ids
            for i in range(len(hashes), n_full):
                parent = hash_fn(parent, tokens[i * block_size : (i + 1) * block_size])
                hashes.append(parent)
        return hashes

    def fork(self, child_id: str) -> Request:
        """A new request with the same tokens, progress, salt and hashes."""
        child = Request(child_id, self.token_ids[: self.num_prompt_tokens], self.cache_salt,
                        self.max_tokens)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.copy_block_hashes(self)
        return child

    def copy_block_hashes(self, other: Request) -> None:
        """Take another request's block hashes (same tokens) and the function that made them."""
        self.block_hashes = list(other.block_hashes)
        self.hash_fn = other.hash_fn

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, salt={self.cache_salt!r})"
        )
