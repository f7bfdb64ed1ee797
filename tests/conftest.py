"""Test setup: Triton kernels run under the interpreter when no GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported anywhere.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
