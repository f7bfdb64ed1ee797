"""Shared Triton plumbing: import guard, interpreter detection, small jit helpers."""

from __future__ import annotations

import functools

import torch

try:  # Triton is a Linux-only dependency; the reference path works without it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None
    HAS_TRITON = False


def require_triton() -> None:
    """Raise a clear error when Triton is not importable."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use backend='reference' on this machine")


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was decorated while ``TRITON_INTERPRET=1`` (runs on CPU via numpy)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    """Reject CPU tensors for a compiled kernel and mixed devices, with a clear message."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    (device,) = devices
    if device.type != "cuda" and not is_interpreted(kernel):
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {device}); to run them on CPU set "
            "TRITON_INTERPRET=1 before importing triton/kernels, or use backend='reference'"
        )


@functools.cache
def sm_count(device_index: int) -> int:
    """Number of streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


if HAS_TRITON:

    @triton.jit
    def tanh_f32(x):
        """tanh from exp, stable for any magnitude (the interpreter has no libdevice)."""
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x >= 0, t, -t)
