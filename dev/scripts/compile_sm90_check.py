"""Compiles the MoE decode, router and fused-combine decode kernels for sm_90 on a machine without a GPU (Triton's
bundled ptxas): catches type and lowering errors before device time is spent. `python3 dev/scripts/compile_sm90_check.py`"""
import sys, triton, inspect
from triton.compiler import ASTSource, compile as tcompile
from triton.backends.compiler import GPUTarget
import lowbit.kernels.moe.decode as dec
import lowbit.kernels.moe.route as rt
import lowbit.kernels.attention.paged_attention as pa

def build(kern, types, consts):
    fn = triton.jit(kern.fn)
    params = list(inspect.signature(kern.fn).parameters)
    sig = {}
    for p in params:
        if p in consts: sig[p] = "constexpr"
        else: sig[p] = types[p]
    src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in consts.items()})
    return tcompile(src, target=GPUTarget("cuda", 90, 32))

def gu(fp8, wt):
    types = dict(x_ptr="*bf16", w_ptr=f"*{wt}", ids_ptr="*i64", ws_ptr="*fp32", as_ptr="*fp32", out_ptr="*bf16",
                 N="i32", K="i32", stride_x="i32")
    consts = dict(TOP_K=8, FP8=fp8, VEC=16 if fp8 else 8, BLOCK_N=8, BLOCK_K=2048 if fp8 else 1024, EVEN_K=True,
                  ONE_STEP=fp8, PDL=True)
    return build(dec._gate_up_silu_kernel, types, consts)

def dc(fp8, wt):
    types = dict(a_ptr="*bf16", w_ptr=f"*{wt}", ids_ptr="*i64", wt_ptr="*fp32", ws_ptr="*fp32", as_ptr="*fp32",
                 part_ptr="*fp32", cnt_ptr="*i32", out_ptr="*bf16", N="i32", K="i32", stride_a="i32")
    consts = dict(TOP_K=8, TOP_KP=8, FP8=fp8, VEC=16 if fp8 else 8, BLOCK_N=16, BLOCK_K=1024 if fp8 else 512,
                  EVEN_K=False, ONE_STEP=fp8, PDL=True)
    return build(dec._down_combine_kernel, types, consts)

def router():
    types = dict(x_ptr="*bf16", w_ptr="*bf16", logits_ptr="*bf16", cnt_ptr="*i32", wout_ptr="*fp32", ids_ptr="*i64",
                 E="i32", K="i32")
    consts = dict(TOP_K=8, RENORM=True, VEC=8, BLOCK_N=4, BLOCK_K=1024, BLOCK_E=128, BLOCK_TK=8, EVEN_K=True,
                  ONE_STEP=False,
                  PDL=True)
    return build(rt._router_topk_kernel, types, consts)

for name, f in [("gate_up fp8", lambda: gu(True, "fp8e4nv")), ("gate_up bf16", lambda: gu(False, "bf16")),
                ("down fp8", lambda: dc(True, "fp8e4nv")), ("down bf16", lambda: dc(False, "bf16")),
                ("router", router)]:
    try:
        k = f()
        print(name, "OK", len(k.asm["ptx"]), "ptx chars")
    except Exception as e:
        print(name, "FAIL", type(e).__name__, str(e)[:1500])

def attn(fp8):
    types = dict(q_ptr="*bf16", kv_ptr="*fp8e4nv" if fp8 else "*bf16", bt_ptr="*i32", ctx_ptr="*i32", ks_ptr="*fp32",
                 vs_ptr="*fp32", os_ptr="*fp32", out_ptr="*fp8e4nv", part_ptr="*fp32", lse_ptr="*fp32", cnt_ptr="*i32",
                 qk_scale="fp32", bt_stride="i32", half_stride="i64", num_splits="i32", window="i32", softcap="fp32")
    consts = dict(HQ=32, HKD=4 * 128, G=8, GP=16, D=128, BS=16, BLOCK_N=64, FP8=fp8, DIRECT=False, QUANT_OUT=True,
                  BLOCKS=fp8, WINDOW=False, SOFTCAP=False, COMBINE=True, SP=16, PDL=True)
    return build(pa._decode_kernel, types, consts)

for name, f in [("attn fp8", lambda: attn(True)), ("attn bf16", lambda: attn(False))]:
    try:
        k = f(); print(name, "OK")
    except Exception as e:
        print(name, "FAIL", type(e).__name__, str(e)[:1500])
