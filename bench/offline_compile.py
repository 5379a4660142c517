"""Compile the attention kernels for the H200 (sm_90a) without a GPU: registers, spilled bytes, shared memory and
asynchronous copies per program, at Llama-8B heads (32 query / 8 KV heads, D 128, block 16). The figures quoted in
attention_tiles.py and prefill_tiles.py come from this script under triton 3.6, the GPU machine's version
(`python3 -m venv --system-site-packages V && V/bin/pip install --no-deps triton==3.6.0`); other versions differ.

`python3 bench/offline_compile.py decode blk64w2s3 [NAME ...]`  (DECODE_VARIANTS or attention_tiles' EXPERIMENTS, FP8 cache)
`python3 bench/offline_compile.py prefill "(64, 64, 8, 3, True, True, True)" [TUPLE ...]`  (PrefillTiles, FP8 cache)
"""
import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lowbit.bench_cli import load_script  # noqa: E402
from lowbit.kernels import paged_attention as pa, paged_prefill as pp  # noqa: E402

HQ, HK, D, BS = 32, 8, 128, 16


def compile_kernel(fn, types: dict, constants: dict, warps: int, stages: int, maxnreg=None) -> dict:
    """fn (a kernel's Python function) compiled for sm_90a; types: its non-constexpr arguments' Triton types."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    signature = {n: types.get(n, "constexpr") for n in names}
    constexprs = {(i,): constants[n] for i, n in enumerate(names) if n in constants}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n.endswith("_ptr") or n in ("bt_stride", "half_stride")}
    options = dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    k = triton.compile(ASTSource(fn=triton.jit(fn), signature=signature, constexprs=constexprs, attrs=aligned),
                       target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    done = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    if done.returncode:
        raise SystemExit(f"ptxas (triton {triton.__version__}) failed: {done.stderr.strip().splitlines()[-1]} "
                         f"(the figures quoted come from triton 3.6: see this script's docstring)")
    report = done.stderr
    spill = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spill_bytes": int(spill.group(1)) if spill else 0, "shared_bytes": k.metadata.shared,
            "async_copies": k.asm["ttgir"].count("async_copy_global_to_local")}


def decode(v: pa.DecodeVariant) -> dict:
    types = dict(q_ptr="*bf16", kv_ptr="*fp8e4nv", bt_ptr="*i32", ctx_ptr="*i32", ks_ptr="*fp32", vs_ptr="*fp32",
                 os_ptr="*bf16", out_ptr="*bf16", part_ptr="*bf16", lse_ptr="*bf16", qk_scale="fp32",
                 bt_stride="i32", half_stride="i32", num_splits="i32")
    constants = dict(HQ=HQ, HKD=HK * D, G=HQ // HK, GP=16, D=D, BS=BS, BLOCK_N=v.block_n, FP8=True, DIRECT=True,
                     QUANT_OUT=False, BLOCKS=v.blocks)
    return compile_kernel(pa._decode_kernel.fn, types, constants, v.warps, v.stages, v.maxnreg)


def prefill(t: pp.PrefillTiles) -> dict:
    types = dict(q_ptr="*bf16", kv_ptr="*fp8e4nv", bt_ptr="*i32", qsl_ptr="*i32", ctx_ptr="*i32", ks_ptr="*fp32",
                 vs_ptr="*fp32", os_ptr="*bf16", out_ptr="*bf16", qk_scale="fp32", bt_stride="i32",
                 half_stride="i32")
    constants = dict(HQ=HQ, HKD=HK * D, G=HQ // HK, GP=HQ // HK, D=D, BS=BS, BLOCK_T=t.block_t, BLOCK_N=t.block_n,
                     FP8=True, QUANT_OUT=False, BLOCKS=t.blocks, DOT_ACC=t.dot_acc, HEAVY_FIRST=t.heavy_first)
    return compile_kernel(pp._prefill_kernel.fn, types, constants, t.warps, t.stages)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernel", choices=["decode", "prefill"])
    p.add_argument("configs", nargs="+")
    a = p.parse_args(argv)
    if a.kernel == "decode":
        known = {**pa.DECODE_VARIANTS, **load_script("attention_tiles.py").EXPERIMENTS}
        unknown = [c for c in a.configs if c not in known]
        if unknown:
            p.error(f"unknown decode variants {unknown}; known: {sorted(known)}")
        jobs = [(c, lambda c=c: decode(known[c])) for c in a.configs]
    else:
        try:
            tiles = [pp.PrefillTiles(*ast.literal_eval(c)) for c in a.configs]
        except (ValueError, SyntaxError, TypeError):
            p.error("a prefill config is a PrefillTiles tuple, e.g. \"(64, 64, 8, 3, True, True, True)\"")
        jobs = [(c, lambda t=t: prefill(t)) for c, t in zip(a.configs, tiles)]
    for name, job in jobs:
        print(f"{a.kernel} {name}: {job()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
