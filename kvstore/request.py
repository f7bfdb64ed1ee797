"""The cache layer's view of one sequence: its tokens, progress, salt and block hashes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.hashing import BlockHash, HashFn, check_block_hash, hash_block, root_hash

# Token ids are stored and hashed as int64: they must lie in [0, MAX_TOKEN_ID).
MAX_TOKEN_ID = 1 << 63


def check_salt(cache_salt: Any) -> str | None:
    """Validate a cache salt: None or a str that encodes as UTF-8 (no lone surrogates)."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__} "
                        f"{cache_salt!r:.60}")
    try:
        cache_salt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"cache_salt must be valid UTF-8 text: {exc.reason} at index "
                         f"{exc.start}") from None
    return cache_salt


def as_count(value: Any) -> int | None:
    """A count as a Python int: an int or numpy integer, never a bool; None otherwise. The
    one rule for every count the cache layer takes."""
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def check_count(value: Any, what: str, minimum: int = 0) -> int:
    """Validate a count (see `as_count`) of at least `minimum`; returns it as an int."""
    n = as_count(value)
    if n is None:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r:.60}")
    if n < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {n}")
    return n


def _check_hashes(hashes: list[BlockHash], block_tokens: list[tuple[int, ...]],
                  start: int) -> None:
    """Check the hashes from `start` on (a custom hash function's); if one is bad, drop
    them and their blocks' tokens (the next call computes them again) and raise."""
    try:
        for h in hashes[start:]:
            check_block_hash(h, "the hash function's result")
    except ValueError:
        del hashes[start:], block_tokens[start:]
        raise


def _token(value: Any, what: str) -> int:
    """One token id: an int or numpy integer (not a bool) in [0, 2**63)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} is a bool ({value!r}), not a token id")
    if not isinstance(value, (int, np.integer)):
        if isinstance(value, (list, tuple, range)) or getattr(value, "ndim", 0) != 0:
            raise ValueError(f"token ids must be a flat sequence; {what} is a {type(value).__name__}")
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r:.60}")
    value = int(value)
    if not 0 <= value < MAX_TOKEN_ID:
        raise ValueError(f"{what} must be in [0, 2**63), got {value}")
    return value


def _array_tokens(arr: np.ndarray, what: str) -> list[int]:
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence, got shape {arr.shape}")
    if arr.dtype.kind == "O":
        return _list_tokens(arr.tolist(), what)
    if arr.size == 0:
        return []
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= MAX_TOKEN_ID:
        raise ValueError(f"{what} must be in [0, 2**63), got {lo if lo < 0 else hi}")
    return arr.astype(np.int64, copy=False).tolist()


def _list_tokens(items: list[Any], what: str) -> list[int]:
    if all(type(t) is int for t in items):  # the common case, checked at C speed
        if items and (min(items) < 0 or max(items) >= MAX_TOKEN_ID):
            bad = next(t for t in items if not 0 <= t < MAX_TOKEN_ID)
            raise ValueError(f"{what} must be in [0, 2**63), got {bad}")
        return items
    return [_token(t, f"{what}[{i}]") for i, t in enumerate(items)]


def as_token_list(token_ids: Any, what: str = "token ids") -> list[int]:
    """Validate token ids and return them as a new list of Python ints.

    Accepts a flat list, tuple or range, a 1-D numpy array (any integer dtype, uint64
    included) or anything with `tolist()` (a torch tensor, an `array.array`); every id must be
    an integer in [0, 2**63), never a bool. TypeError or ValueError otherwise."""
    if isinstance(token_ids, np.ndarray):
        return _array_tokens(token_ids, what)
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be a sequence of ints, got {type(token_ids).__name__}")
    if isinstance(token_ids, (list, tuple, range)):
        items = list(token_ids)
    elif hasattr(token_ids, "tolist"):  # a tensor (torch is never imported here) or array.array
        items = token_ids.tolist()
        if not isinstance(items, list):
            raise ValueError(f"{what} must be a flat sequence, got a scalar "
                             f"{type(token_ids).__name__}")
    else:
        raise TypeError(f"{what} must be a sequence of ints, got {type(token_ids).__name__}")
    return _list_tokens(items, what)


class Request:
    """A sequence as the cache sees it; the scheduler advances `num_computed_tokens`.

    Tokens are added only through `append_token_ids`, which validates them like the
    constructor; `cache_salt` is validated whenever it is set."""

    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "_cache_salt",
        "block_hashes",
        "block_tokens",
        "hash_fn",
        "hash_block_size",
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
        max_tokens = check_count(max_tokens, "max_tokens")
        self._cache_salt = check_salt(cache_salt)
        self.request_id = request_id
        self.token_ids: list[int] = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.block_hashes: list[BlockHash] = []
        # The token ids of each hashed block, as the tuples the pool stores and compares.
        self.block_tokens: list[tuple[int, ...]] = []
        # The function and block size `block_hashes` were computed with (None and 0 until
        # the first is).
        self.hash_fn: HashFn | None = None
        self.hash_block_size = 0
        self.max_tokens = max_tokens

    @property
    def cache_salt(self) -> str | None:
        """The tenant's salt: requests with different salts never share cached content."""
        return self._cache_salt

    @cache_salt.setter
    def cache_salt(self, value: str | None) -> None:
        value = check_salt(value)
        if value != self._cache_salt and self.block_hashes:
            raise ValueError(f"request {self.request_id!r} is already hashed under its salt")
        self._cache_salt = value

    @property
    def num_tokens(self) -> int:
        """All tokens so far: prompt plus generated."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token_ids(self, token_ids: Sequence[int] | int) -> None:
        """Append generated tokens: one id (an int, or a 0-d array or tensor) or a flat
        sequence of them, validated like the prompt; nothing is appended if any is bad."""
        if type(token_ids) is int:  # the decode step
            if not 0 <= token_ids < MAX_TOKEN_ID:
                raise ValueError(f"token id must be in [0, 2**63), got {token_ids}")
            self.token_ids.append(token_ids)
            return
        if getattr(token_ids, "ndim", None) == 0:  # a numpy scalar, 0-d array or tensor
            token_ids = token_ids.item()  # type: ignore[union-attr]
        if isinstance(token_ids, (int, np.integer)):
            self.token_ids.append(_token(token_ids, "token id"))
        else:
            self.token_ids.extend(as_token_list(token_ids))

    def update_block_hashes(self, block_size: int, hash_fn: HashFn) -> list[BlockHash]:
        """Hash the blocks that became full since the last call; earlier hashes are kept.
        ValueError if earlier hashes were computed with another function or block size, or
        if a hash function other than `hash_block` returns something other than an int in
        [0, 2**128)."""
        if hash_fn is not self.hash_fn or block_size != self.hash_block_size:
            if self.block_hashes:
                what = "hash function" if hash_fn is not self.hash_fn else (
                    f"block size ({self.hash_block_size}, not {block_size})")
                raise ValueError(f"request {self.request_id!r} was hashed with another {what} "
                                 "than this cache's")
            self.hash_fn = hash_fn
            self.hash_block_size = block_size
        hashes = self.block_hashes
        n_full = len(self.token_ids) // block_size
        if len(hashes) < n_full:
            start = len(hashes)
            parent = hashes[-1] if hashes else root_hash(self._cache_salt)
            tokens = self.token_ids
            block_tokens = self.block_tokens
            for i in range(start, n_full):
                block = tuple(tokens[i * block_size : (i + 1) * block_size])
                parent = hash_fn(parent, block)
                hashes.append(parent)
                block_tokens.append(block)
            if hash_fn is not hash_block:
                _check_hashes(hashes, block_tokens, start)
        return hashes

    def fork(self, child_id: str) -> Request:
        """A new request with the same tokens, progress, salt and hashes."""
        child = Request(child_id, self.token_ids[: self.num_prompt_tokens], self._cache_salt,
                        self.max_tokens)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.copy_block_hashes(self)
        return child

    def copy_block_hashes(self, other: Request) -> None:
        """Take another request's block hashes (same tokens) and the function that made them."""
        self.block_hashes = list(other.block_hashes)
        self.block_tokens = list(other.block_tokens)
        self.hash_fn = other.hash_fn
        self.hash_block_size = other.hash_block_size

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, salt={self._cache_salt!r})"
        )
