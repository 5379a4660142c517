"""Compile lowbit's kernels for the H200 (sm_90a) without a GPU: registers, spilled bytes, shared memory and
asynchronous copies per program, and from the SASS the MMA instructions, MEMBARs, the length of the loop that holds
the MMAs (or the longest loop) and where its global loads sit. Attention at Llama-8B heads (32 query / 8 KV heads,
D 128, block 16, FP8 cache); the W4 GEMMs (INT4 group 128 or NVFP4, bf16 x); the M = 1 GEMVs. The figures quoted
in attention_tiles.py, prefill_tiles.py and docs/kernels_notes.md come from this script under triton 3.6, the GPU
machine's version (`python3 -m venv --system-site-packages V && V/bin/pip install --no-deps triton==3.6.0`); other
versions differ.

`python3 dev/bench/offline_compile.py decode blk64w2s3 [NAME ...]`  (DECODE_VARIANTS, attention_tiles' EXPERIMENTS)
`python3 dev/bench/offline_compile.py prefill "(64, 64, 8, 3, True, True, True)" [TUPLE ...]`  (PrefillTiles)
`python3 dev/bench/offline_compile.py w4_small_m int4,64,4,3,16 [FMT,BLOCK_N,WARPS,STAGES,BLOCK_M ...]`
`python3 dev/bench/offline_compile.py w4a16 int4,16,64,4,3 [FMT,BLOCK_M,BLOCK_N,WARPS,STAGES ...]`
`python3 dev/bench/offline_compile.py w4_gemv int4,8,2048,2 [FMT,BLOCK_N,BLOCK_K,WARPS ...]`
`python3 dev/bench/offline_compile.py dense_gemv bf16,8,1024,4 [bf16|fp8,BLOCK_N,BLOCK_K,WARPS ...]`
`python3 dev/bench/offline_compile.py w4_mma bf16,16,2048,4 [bf16|fp16|nvfp4[x2],BLOCK_N,BLOCK_K,WARPS ...]`
`python3 dev/bench/offline_compile.py int8_gemv m1,8,2048,4 [mROWS,BLOCK_N,BLOCK_K,WARPS ...]`
"""
import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab import load_script  # noqa: E402
from lowbit.kernels.linear import dense_gemv, int8_gemv, w4_gemv, w4_mma, w4_small_m, w4a16  # noqa: E402
from lowbit.kernels.attention import paged_attention as pa, paged_prefill as pp  # noqa: E402
from lowbit.kernels import tuning  # noqa: E402

HQ, HK, D, BS = 32, 8, 128, 16


def compile_kernel(fn, types: dict, constants: dict, warps: int, stages: int, maxnreg=None) -> dict:
    """fn (a kernel's Python function) compiled for sm_90a; types: its non-constexpr arguments' Triton types."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    constants = dict(constants, PDL=True)  # as the engine launches them on Hopper (lowbit.kernels._triton)
    signature = {n: types.get(n, "constexpr") for n in names}
    constexprs = {(i,): constants[n] for i, n in enumerate(names) if n in constants}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n.endswith("_ptr") or n in ("bt_stride", "half_stride", "N", "K", "KP", "KW", "w_stride")}
    options = dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    k = triton.compile(ASTSource(fn=triton.jit(fn), signature=signature, constexprs=constexprs, attrs=aligned),
                       target=GPUTarget("cuda", 90, 32), options=options)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(ptx).write_text(k.asm["ptx"])
        done = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"ptxas (triton {triton.__version__}) failed: {done.stderr.strip().splitlines()[-1]} "
                             f"(the figures quoted come from triton 3.6: see this script's docstring)")
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout
    report = done.stderr
    spill = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spill_bytes": int(spill.group(1)) if spill else 0, "shared_bytes": k.metadata.shared,
            "async_copies": k.asm["ttgir"].count("async_copy_global_to_local"), **sass_counts(sass)}


def sass_counts(sass: str) -> dict:
    """MMA instructions (HGMMA / HMMA) and MEMBARs in the whole kernel; in the loop that holds the most MMAs (the
    longest without MMAs; from a backward branch's target to the branch) its instructions and where its global loads
    sit, as fractions of the way through it."""
    ops = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass)]
    branches = [(int(t, 16), int(a, 16)) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\w* "
                                                                r"(?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", sass)]
    is_mma = [op.startswith(("HGMMA", "HMMA")) for _, op in ops]
    loops = [(sum(m for (a, _), m in zip(ops, is_mma) if t <= a <= b), sum(t <= a <= b for a, _ in ops), t, b)
             for t, b in branches if t < b]
    counts = {"mma": sum(is_mma), "membar": sum(op.startswith("MEMBAR") for _, op in ops),
              "loop_instructions": None, "loop_load_positions": None}
    if loops:
        _, n, t, b = max(loops)
        counts["loop_instructions"] = n
        counts["loop_load_positions"] = [round((a - t) / (b - t), 2) for a, op in ops
                                         if t <= a <= b and op.startswith("LDG")]
    return counts


def decode(v: pa.DecodeVariant) -> dict:
    types = dict(q_ptr="*bf16", kv_ptr="*fp8e4nv", bt_ptr="*i32", ctx_ptr="*i32", ks_ptr="*fp32", vs_ptr="*fp32",
                 os_ptr="*bf16", out_ptr="*bf16", part_ptr="*bf16", lse_ptr="*bf16", qk_scale="fp32",
                 bt_stride="i32", half_stride="i32", num_splits="i32", window="i32", softcap="fp32")
    constants = dict(HQ=HQ, HKD=HK * D, G=HQ // HK, GP=16, D=D, BS=BS, BLOCK_N=v.block_n, FP8=True, DIRECT=True,
                     QUANT_OUT=False, BLOCKS=v.blocks, WINDOW=False, SOFTCAP=False)
    return compile_kernel(pa._decode_kernel.fn, types, constants, v.warps, v.stages, v.maxnreg)


def prefill(t: pp.PrefillTiles) -> dict:
    types = dict(q_ptr="*bf16", kv_ptr="*fp8e4nv", bt_ptr="*i32", qsl_ptr="*i32", ctx_ptr="*i32", ks_ptr="*fp32",
                 vs_ptr="*fp32", os_ptr="*bf16", out_ptr="*bf16", qk_scale="fp32", bt_stride="i32",
                 half_stride="i32", window="i32", softcap="fp32")
    constants = dict(HQ=HQ, HKD=HK * D, G=HQ // HK, GP=HQ // HK, D=D, BS=BS, BLOCK_T=t.block_t, BLOCK_N=t.block_n,
                     FP8=True, QUANT_OUT=False, BLOCKS=t.blocks, DOT_ACC=t.dot_acc, HEAVY_FIRST=t.heavy_first,
                     WINDOW=False, SOFTCAP=False)
    return compile_kernel(pp._prefill_kernel.fn, types, constants, t.warps, t.stages)


W4_FIELDS = {"w4_small_m": "FMT,BLOCK_N,WARPS,STAGES,BLOCK_M", "w4a16": "FMT,BLOCK_M,BLOCK_N,WARPS,STAGES"}
W4_TYPES = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*fp32", smooth_ptr="*bf16", bias_ptr="*bf16", out_ptr="*fp32",
                M="i32", N="i32", K="i32", KP="i32", w_stride="i32", n_tiles="i32", tiles_per_split="i32",
                global_scale="fp32")


def w4(kernel: str, fmt: str, a: int, b: int, warps: int, stages: int) -> dict:
    """w4_small_m: a, b = BLOCK_N, BLOCK_M; w4a16: BLOCK_M, BLOCK_N. INT4 group 128 or NVFP4, no bias / smooth."""
    nvfp4 = fmt == "nvfp4"
    types = dict(W4_TYPES, **({"s_ptr": "*fp8e4nv"} if nvfp4 else {}),
                 **({"x_ptr": "*fp16"} if nvfp4 and kernel == "w4_small_m" else {}))  # x_planes: fp16 for NVFP4
    constants = dict(IS_FP4=nvfp4, X_BF16=True, GROUP=16 if nvfp4 else 128, HAS_SMOOTH=False, HAS_BIAS=False)
    if kernel == "w4_small_m":
        fn, constants = w4_small_m._w4_small_m_kernel.fn, dict(constants, BLOCK_N=a, BLOCK_M=b)
    else:
        fn, constants = w4a16._w4_gemm_kernel.fn, dict(constants, BLOCK_M=a, BLOCK_N=b,
                                                        PREFETCH=tuning.current().w4_prefetch_scales, EMULATE=False)
    return compile_kernel(fn, types, constants, warps, stages)


GEMV_TYPES = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*fp32", smooth_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16",
                  N="i32", K="i32", KP="i32", w_stride="i32", global_scale="fp32", magic="i32")


def w4_gemv_job(fmt: str, block_n: int, block_k: int, warps: int) -> dict:
    """The M = 1 W4 GEMV, INT4 group 128 or NVFP4, K a multiple of BLOCK_K, no bias / smooth."""
    types = dict(GEMV_TYPES, **({"s_ptr": "*fp8e4nv"} if fmt == "nvfp4" else {}))
    constants = dict(IS_FP4=fmt == "nvfp4", GROUP=16 if fmt == "nvfp4" else 128, HAS_SMOOTH=False, HAS_BIAS=False,
                     BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=True, MASK_X=False, M2=False, USE_ASM=True)
    return compile_kernel(w4_gemv._w4_gemv_kernel.fn, types, constants, warps, 1)


def dense_gemv_job(dtype: str, block_n: int, block_k: int, warps: int) -> dict:
    """The M = 1 bf16 GEMV, or its FP8 form (fp8_gemv, a per-tensor weight scale), K a multiple of BLOCK_K."""
    t = "*fp8e4nv" if dtype == "fp8" else "*bf16"
    types = dict(x_ptr=t, w_ptr=t, sa_ptr="*fp32", sb_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", N="i32", K="i32")
    constants = dict(HAS_BIAS=False, SCALED=dtype == "fp8", ROW_SCALES=False, SILU_MUL=False,
                     VEC=16 if dtype == "fp8" else 8, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=True)
    return compile_kernel(dense_gemv._dense_gemv_kernel.fn, types, constants, warps, 1)


def w4_mma_job(kind: str, block_n: int, block_k: int, warps: int) -> dict:
    """W4 on mma.sync: INT4 group 128 with bf16 or fp16 x (kind "bf16" / "fp16"), or NVFP4 with bf16 x ("nvfp4");
    M <= 8 rows, or M <= 16 with "x2" appended (two x tiles); K a multiple of BLOCK_K, no bias / smooth."""
    fp4 = kind.startswith("nvfp4")
    t = "*bf16" if fp4 else "*" + kind[:4]
    types = dict(GEMV_TYPES, x_ptr=t, smooth_ptr=t, bias_ptr=t, out_ptr=t, M="i32",
                 **({"s_ptr": "*fp8e4nv"} if fp4 else {}))
    constants = dict(IS_FP4=fp4, BF16=kind.startswith("bf16"), GROUP=16 if fp4 else 128, HAS_SMOOTH=False,
                     HAS_BIAS=False, BLOCK_N=block_n, BLOCK_K=block_k, WARPS=warps, EVEN_K=True, MASK_X=False,
                     X_TILES=2 if kind.endswith("x2") else 1, EMULATE=False)
    return compile_kernel(w4_mma._w4_mma_kernel.fn, types, constants, warps, 1)


def int8_gemv_job(rows: str, block_n: int, block_k: int, warps: int) -> dict:
    """INT8 by dp4a for M_PAD x rows ("m1" .. "m8"), a per-tensor x scale and per-row weight scales (SmoothQuant's),
    K a multiple of BLOCK_K, no bias."""
    types = dict(x_ptr="*i32", w_ptr="*i32", sa_ptr="*fp32", sb_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16",
                 M="i32", N="i32", KW="i32")
    constants = dict(SA_PER_ROW=False, SB_PER_ROW=True, HAS_BIAS=False, M_PAD=int(rows[1:]), BLOCK_N=block_n,
                     BLOCK_KW=block_k // 4, EVEN_K=True, EMULATE=False)
    return compile_kernel(int8_gemv._int8_gemv_kernel.fn, types, constants, warps, 1)


GEMV_JOBS = {"w4_gemv": (("int4", "nvfp4"), w4_gemv_job), "dense_gemv": (("bf16", "fp8"), dense_gemv_job),
             "w4_mma": (("bf16", "fp16", "nvfp4", "bf16x2", "fp16x2", "nvfp4x2"), w4_mma_job),
             "int8_gemv": (("m1", "m2", "m4", "m8"), int8_gemv_job)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernel", choices=["decode", "prefill", "w4_small_m", "w4a16", "w4_gemv", "dense_gemv", "w4_mma",
                                             "int8_gemv"])
    p.add_argument("configs", nargs="+")
    a = p.parse_args(argv)
    if a.kernel == "decode":
        known = {**tuning.current().decode_variants, **load_script("attention_tiles.py").EXPERIMENTS}
        unknown = [c for c in a.configs if c not in known]
        if unknown:
            p.error(f"unknown decode variants {unknown}; known: {sorted(known)}")
        jobs = [(c, lambda c=c: decode(known[c])) for c in a.configs]
    elif a.kernel in ("w4_small_m", "w4a16"):
        parsed = [c.split(",") for c in a.configs]
        if any(len(f) != 5 or f[0] not in ("int4", "nvfp4") or not all(v.isdigit() for v in f[1:]) for f in parsed):
            p.error(f"a {a.kernel} config is {W4_FIELDS[a.kernel]} (FMT int4 or nvfp4, then four integers)")
        if a.kernel == "w4_small_m":  # FMT,BLOCK_N,WARPS,STAGES,BLOCK_M
            jobs = [(c, lambda f=f: w4("w4_small_m", f[0], int(f[1]), int(f[4]), int(f[2]), int(f[3])))
                    for c, f in zip(a.configs, parsed)]
        else:  # FMT,BLOCK_M,BLOCK_N,WARPS,STAGES
            jobs = [(c, lambda f=f: w4("w4a16", f[0], int(f[1]), int(f[2]), int(f[3]), int(f[4])))
                    for c, f in zip(a.configs, parsed)]
    elif a.kernel in GEMV_JOBS:
        kinds, run = GEMV_JOBS[a.kernel]
        parsed = [c.split(",") for c in a.configs]
        if any(len(f) != 4 or f[0] not in kinds or not all(v.isdigit() for v in f[1:]) for f in parsed):
            p.error(f"a {a.kernel} config is {'|'.join(kinds)},BLOCK_N,BLOCK_K,WARPS (then three integers)")
        jobs = [(c, lambda f=f: run(f[0], *(int(v) for v in f[1:]))) for c, f in zip(a.configs, parsed)]
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
