"""Ahead-of-time compile every kernel configuration for an NVIDIA target, without a GPU.

``python -m kernels.compile_check [--arch 90 80]`` lowers each kernel through Triton's
full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ``ptxas``), so code
that only the interpreter accepts is caught on a CPU-only machine. Must run with
``TRITON_INTERPRET`` unset (the kernels have to be compiled JIT functions). Exit code 0
when every configuration compiles, 1 otherwise, 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _signature(fn, constexprs: dict, types: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "i32")
    return sig


def _attn_configs() -> list[tuple[str, dict, dict]]:
    out = []
    for dt, d, window, cap, split, upcast, bm, bn in [
        ("bf16", 128, False, False, False, False, 16, 64),  # decode, GQA 8
        ("bf16", 128, True, False, True, False, 16, 64),  # windowed split-KV decode
        ("bf16", 128, True, True, False, False, 64, 64),  # prefill, window + softcap
        ("bf16", 128, False, False, False, False, 128, 64),  # long prefill, 8 warps
        ("fp16", 80, False, True, True, False, 64, 32),  # padded head dim
        ("fp32", 64, True, False, False, True, 16, 32),  # fp32: ieee dots
        ("bf16", 256, False, False, False, False, 64, 32),
    ]:
        const = dict(HEAD_DIM=d, BLOCK_D=max(16, 1 << (d - 1).bit_length()), GROUP=8,
                     BLOCK_M=bm, BLOCK_N=bn, PAGE=16, USE_WINDOW=window, USE_SOFTCAP=cap,
                     SPLIT=split, UPCAST=upcast, COUNT_TILES=False)
        types = {"q_ptr": _PTR[dt], "k_ptr": _PTR[dt], "v_ptr": _PTR[dt],
                 "o_ptr": "*fp32" if split else _PTR[dt], "lse_ptr": "*fp32",
                 "tiles_ptr": "*i32", "block_table_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "scale": "fp32", "softcap": "fp32"}
        out.append((f"attn {dt} d={d} win={window} cap={cap} split={split} bm={bm} bn={bn}",
                    const, types))
    return out


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
    from . import cache_ops, triton_attention

    jobs = []
    for name, const, types in _attn_configs():
        warps = 8 if const["BLOCK_M"] * const["BLOCK_D"] >= 128 * 128 else 4
        jobs.append((name, triton_attention._paged_attn_kernel, const, types, warps))
    jobs.append(("merge bf16 d=128", triton_attention._merge_splits_kernel,
                 dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_H=32),
                 {"o_part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"}, 4))
    jobs.append(("write_kv bf16", cache_ops._write_kv_kernel,
                 dict(HEAD_DIM=128, PAGE=16, BLOCK_H=8, BLOCK_D=128),
                 {"key_ptr": "*bf16", "value_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16",
                  "slot_ptr": "*i64"}, 4))
    for elem in (1, 2, 4, 8):
        jobs.append((f"copy_blocks elem={elem}", cache_ops._copy_blocks_kernel,
                     dict(ELEM_BYTES=elem, CHUNK=4096),
                     {"ptrs_ptr": "*i64", "block_strides_ptr": "*i64", "src_ptr": "*i64",
                      "dst_ptr": "*i64", "block_numel": "i32"}, 4))
    failed = 0
    for arch in args.arch:
        target = GPUTarget("cuda", arch, 32)
        for name, fn, const, types, warps in jobs:
            try:
                src = ASTSource(fn, _signature(fn, const, types), const)
                k = triton.compile(src, target=target, options={"num_warps": warps})
                print(f"ok   sm_{arch} {name}: shared={k.metadata.shared} B")
            except Exception:  # noqa: BLE001 - report every failure, keep going
                failed += 1
                print(f"FAIL sm_{arch} {name}")
                traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
