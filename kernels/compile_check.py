"""Ahead-of-time compile every kernel configuration for an NVIDIA target, without a GPU.

``python -m kvstore.kernels.compile_check [--arch 90 80]`` lowers each kernel through Triton's
full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ``ptxas``), so code
that only the interpreter accepts is caught on a CPU-only machine. Arguments are
specialised the way the JIT specialises a real call (16-byte aligned pointers, strides
divisible by 16 marked so, unit strides folded to constants), and when the bundled
``cuobjdump`` is present the register count and stack (spill) bytes of each cubin are
printed. A configuration that needs more shared memory than the target gives one block
fails. Must run with ``TRITON_INTERPRET`` unset. Exit code 0 when every configuration
compiles, 1 otherwise, 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
# Shared memory one block may take (opt-in maximum), bytes: a launch past it fails with
# OutOfResources on the device, though the compile succeeds.
SHARED_LIMIT = {90: 232448, 80: 166912}


def _attn_configs() -> list[tuple[str, dict, dict, set, tuple[int, int]]]:
    """(name, constexprs, arg types, args divisible by 16, (num_warps, num_stages))."""
    from .triton_attention import launch_config

    out = []
    for dt, d, group, window, cap, split, max_q, sinks in [
        ("bf16", 128, 8, False, False, False, 1, False),  # decode, GQA 8:1
        ("bf16", 128, 8, True, False, True, 1, False),  # windowed split-KV decode
        ("bf16", 128, 8, True, True, False, 8, False),  # short chunk, window + softcap
        ("bf16", 128, 8, False, False, False, 4096, False),  # long prefill
        ("fp16", 80, 5, False, True, True, 100, False),  # padded head dim, GQA 5:1
        ("fp32", 64, 4, True, False, False, 1, False),  # fp32: ieee dots
        ("bf16", 256, 8, False, False, False, 4096, False),
        ("bf16", 256, 8, False, False, False, 1, False),
        # gpt-oss shapes (head_dim 64, GQA 8:1, window 128) with attention sinks
        ("bf16", 64, 8, True, False, False, 1, True),  # windowed decode
        ("bf16", 64, 8, False, False, False, 4096, True),  # long prefill
        ("fp32", 64, 4, True, True, False, 8, True),  # fp32 sinks, window + softcap
    ]:
        bm, bn, warps, stages = launch_config(group, d, max_q, None, None)
        const = dict(HEAD_DIM=d, BLOCK_D=max(16, 1 << (d - 1).bit_length()), GROUP=group,
                     BLOCK_M=bm, BLOCK_N=bn, PAGE=16, USE_WINDOW=window, USE_SOFTCAP=cap,
                     USE_SINKS=sinks, SPLIT=split, UPCAST=dt == "fp32", COUNT_TILES=False)
        # unit strides: the JIT turns an int argument equal to 1 into a constant
        for name in ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_btp"):
            const[name] = 1
        if split:
            const["stride_lh"] = 1
        types = {"q_ptr": _PTR[dt], "k_ptr": _PTR[dt], "v_ptr": _PTR[dt],
                 "o_ptr": "*fp32" if split else _PTR[dt], "lse_ptr": "*fp32",
                 "tiles_ptr": "*i32", "sinks_ptr": _PTR[dt] if sinks else "*i32",
                 "block_table_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "scale": "fp32", "softcap": "fp32"}
        div16 = {n for n in types if n.endswith("_ptr")} | {
            "stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
            "stride_vs", "stride_vh", "stride_os", "stride_ot", "stride_oh", "stride_ls",
            "stride_lt"}
        if d % 16:
            div16 -= {"stride_qt", "stride_qh", "stride_kh", "stride_vh", "stride_oh",
                      "stride_ot", "stride_ks", "stride_vs", "stride_kb", "stride_vb"}
        out.append((f"attn {dt} d={d} group={group} win={window} cap={cap} split={split} "
                    f"sinks={sinks} bm={bm} bn={bn} warps={warps}", const, types, div16, (warps, stages)))
    return out


def _signature(fn, constexprs: dict, types: dict) -> dict:
    return {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}


def _attrs(fn, constexprs: dict, div16: set) -> dict:
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
            if n in div16 and n not in constexprs}


def _resource_usage(cubin: bytes, cuobjdump: Path) -> str:
    if not cuobjdump.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True,
                             text=True, check=False).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return f" regs={m.group(1)} stack={m.group(2)}B" if m else ""


def main(argv: list[str] | None = None) -> int:
    """Compile all configurations; print one line per configuration."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", type=int, nargs="+", default=[90])
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover
        print(f"compile_check: Triton unavailable ({e})", file=sys.stderr)
        return 2
    from . import cache_ops, mla, triton_attention

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    jobs = []
    for name, const, types, div16, launch in _attn_configs():
        jobs.append((name, triton_attention._paged_attn_kernel, const, types, div16, launch))
    for sinks in (False, True):
        jobs.append((f"merge bf16 d=128 heads=64 sinks={sinks}",
                     triton_attention._merge_splits_kernel,
                     dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, USE_SINKS=sinks),
                     {"o_part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16",
                      "sinks_ptr": "*bf16" if sinks else "*i32"}, set(), (4, 3)))
    jobs.append(("write_kv bf16", cache_ops._write_kv_kernel,
                 dict(HEAD_DIM=128, PAGE=16, BLOCK_H=8, BLOCK_D=128),
                 {"key_ptr": "*bf16", "value_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16",
                  "slot_ptr": "*i64"}, set(), (4, 3)))
    for elem in (1, 2, 4, 8):
        jobs.append((f"copy_blocks elem={elem}", cache_ops._copy_blocks_kernel,
                     dict(ELEM_BYTES=elem, CHUNK=4096),
                     {"ptrs_ptr": "*i64", "block_strides_ptr": "*i64", "src_ptr": "*i64",
                      "dst_ptr": "*i64", "block_numel": "i32"}, set(), (4, 3)))
    for block_h, block_n, warps, split in ((64, 64, 8, False), (64, 64, 8, True), (16, 64, 8, False)):
        d1, d2 = mla._pieces(288)
        const = dict(HALF=288, D1=d1, D2=d2, BLOCK_H=block_h, BLOCK_N=block_n, PAGE=16, SPLIT=split,
                     UPCAST=False, stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, stride_btp=1)
        const |= {"stride_lh": 1} if split else {}
        types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*fp32" if split else "*bf16",
                 "lse_ptr": "*fp32", "block_table_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "scale": "fp32"}
        jobs.append((f"mla decode bf16 latent 512+64 block_h={block_h} block_n={block_n} warps={warps} "
                     f"split={split}", mla._mla_decode_kernel, const, types,
                     {n for n in types if n.endswith("_ptr")}, (warps, 3)))
    failed = 0
    for arch in args.arch:
        target = GPUTarget("cuda", arch, 32)
        for name, fn, const, types, div16, (warps, stages) in jobs:
            try:
                src = ASTSource(fn, _signature(fn, const, types), const,
                                _attrs(fn, const, div16))
                k = triton.compile(src, target=target, options={"num_warps": warps,
                                                                 "num_stages": stages})
                usage = _resource_usage(k.asm["cubin"], cuobjdump)
                if k.metadata.shared > SHARED_LIMIT.get(arch, k.metadata.shared):
                    raise RuntimeError(f"needs {k.metadata.shared} B of shared memory, sm_{arch} has "
                                       f"{SHARED_LIMIT[arch]} B a block")
                print(f"ok   sm_{arch} {name}: shared={k.metadata.shared}B{usage}")
            except Exception:  # noqa: BLE001 - report every failure, keep going
                failed += 1
                print(f"FAIL sm_{arch} {name}")
                traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
