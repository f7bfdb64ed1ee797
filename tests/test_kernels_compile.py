"""The kernels compile for a real NVIDIA target (sm_90) even on a CPU-only machine.

The interpreter accepts code that the GPU compiler rejects; this lowers every kernel
configuration to a cubin with Triton's bundled ptxas, in a subprocess without
TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="Triton's NVIDIA backend (ptxas) not bundled")
def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "kvstore.kernels.compile_check", "--arch", "90"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("ok   sm_90")]
    assert len(lines) >= 10
    assert any(" mla decode " in ln for ln in lines)
    # where cuobjdump reports resource usage: no register spills in any configuration but
    # MLA decode at DeepSeek-V3's latent, whose fastest plan on an H200 spills (docs/kernels.md)
    spills = [ln for ln in lines if "stack=" in ln and "stack=0B" not in ln and " mla decode " not in ln]
    assert not spills, spills
