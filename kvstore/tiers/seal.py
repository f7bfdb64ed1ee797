"""Sealed store values: each value encrypted and authenticated (AES-256-GCM) under a key
per tenant, derived with HKDF-SHA256 from the operator's secret and the tenant's salt root,
with the store key as associated data; and a secret for keyed store keys. A reader of the
store learns neither tokens nor K/V, cannot tell whether a tenant sent a guessed prompt
(keys need the secret), and cannot forge or move a value (the tag covers the value and its
key). Needs ``cryptography`` (``pip install "kvstore[tiers]"``); imports no torch."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from kvstore.tiers.codec import Buffer

__all__ = ["SEAL_OVERHEAD", "Sealer", "load_store_key"]

_MAGIC = b"KVS1"
_NONCE = 12
_TAG = 16
#: Bytes a sealed value adds to the value it seals (magic, nonce, tag).
SEAL_OVERHEAD = len(_MAGIC) + _NONCE + _TAG
#: The shortest operator secret accepted.
MIN_SECRET_NBYTES = 16


def load_store_key(source: bytes | os.PathLike[str]) -> bytes:
    """The operator secret: ``source`` itself (bytes), or the contents of a key file (a
    path; surrounding whitespace stripped). ValueError for another type, an unreadable file
    or a secret shorter than MIN_SECRET_NBYTES."""
    if isinstance(source, (bytes, bytearray)):
        secret = bytes(source)
    elif isinstance(source, os.PathLike):
        try:
            secret = Path(source).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"store key file {os.fspath(source)!r}: {exc.strerror or exc}") from None
    else:
        raise ValueError(f"store_key must be bytes (the secret) or a path to a key file, got "
                         f"{type(source).__name__}")
    if len(secret) < MIN_SECRET_NBYTES:
        raise ValueError(f"store key must be at least {MIN_SECRET_NBYTES} bytes, got {len(secret)}")
    return secret


class Sealer:
    """Seals and opens store values for every tenant of one operator secret."""

    def __init__(self, secret: bytes | os.PathLike[str]) -> None:
        try:
            from cryptography.hazmat.primitives import hashes
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            from cryptography.hazmat.primitives.kdf.hkdf import HKDF
        except ImportError:
            raise ImportError("sealed store values need cryptography: "
                              "pip install \"kvstore[tiers]\"") from None
        self._secret = load_store_key(secret)
        self._aead_cls = AESGCM
        self._hkdf = lambda info: HKDF(algorithm=hashes.SHA256(), length=32,
                                       salt=b"kvstore-seal-v1", info=info).derive(self._secret)
        #: The secret that keys the store keys (``block_key(..., key_secret=...)``).
        self.key_secret: bytes = self._hkdf(b"store keys")
        self._tenants: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _aead(self, salt_root: int) -> Any:
        aead = self._tenants.get(salt_root)
        if aead is None:
            info = b"tenant " + salt_root.to_bytes(16, "little")
            aead = self._aead_cls(self._hkdf(info))
            with self._lock:
                self._tenants[salt_root] = aead
        return aead

    def seal(self, salt_root: int, key: bytes, value: Buffer) -> bytes:
        """``value`` encrypted and authenticated for the tenant of ``salt_root``, bound to
        the store key ``key``."""
        nonce = os.urandom(_NONCE)
        return _MAGIC + nonce + self._aead(salt_root).encrypt(nonce, bytes(value), key)

    def open(self, salt_root: int, key: bytes, sealed: Buffer | None) -> bytes | None:
        """The value ``seal`` sealed for this tenant and key, or None when ``sealed`` is
        missing, malformed, forged, another tenant's or another key's."""
        if sealed is None:
            return None
        view = memoryview(sealed).cast("B")
        if view.nbytes < SEAL_OVERHEAD or view[:len(_MAGIC)] != _MAGIC:
            return None
        nonce = bytes(view[len(_MAGIC):len(_MAGIC) + _NONCE])
        try:
            return self._aead(salt_root).decrypt(nonce, view[len(_MAGIC) + _NONCE:], key)
        except Exception:  # InvalidTag: forged, corrupted, another tenant's or key's
            return None

    def __repr__(self) -> str:
        return "Sealer(<secret>)"
