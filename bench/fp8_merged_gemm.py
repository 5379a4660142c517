"""FP8 merged q/k/v and gate/up GEMM options on the GPU (per-tensor activations x per-row weight scales): three
separate per-tensor GEMMs, cuBLAS row-wise, the Triton scaled GEMM, per-tensor into fp32 then the row scales; error
vs the fp32 reference and median us. Chose w8a8.PER_TENSOR_THEN_SCALE_MAX_M."""
import importlib.util
import json
import os
import sys

import torch
sys.path.insert(0, os.getcwd())
spec = importlib.util.spec_from_file_location("kb", "bench/kernels.py")
kb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kb)
from lowbit.kernels import scaled_gemm as sg

dev = "cuda"
SHAPES = {"qkv": (4096, [4096, 1024, 1024]), "gate_up": (4096, [14336, 14336])}
rows = []
for name, (k, parts) in SHAPES.items():
    n = sum(parts)
    for m in (1, 16, 64, 256, 4096):
        x = (torch.randn(m, k, device=dev) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        sa = torch.tensor(0.01, device=dev)
        copies = kb.copies_for(n * k)
        Ws = [(torch.randn(n, k, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(copies)]
        sv = torch.rand(n, device=dev) * 1e-3 + 1e-4
        one = torch.tensor(1.0, device=dev)
        # correctness of each merged option vs the fp32 reference (first copy)
        ref = sg.scaled_gemm_ref(x, Ws[0], sa, sv, None, torch.bfloat16).float()
        def rowwise(W):
            return torch._scaled_mm(x, W.t(), scale_a=sa.expand(m, 1).contiguous(), scale_b=sv.reshape(1, -1), out_dtype=torch.bfloat16)
        def triton_g(W):
            return sg.scaled_gemm(x, W, sa, sv, None, torch.bfloat16)
        def fp32_then_mul(W):
            return (torch._scaled_mm(x, W.t(), scale_a=sa, scale_b=one, out_dtype=torch.float32) * sv).to(torch.bfloat16)
        def pertensor(W):
            return torch._scaled_mm(x, W.t(), scale_a=sa, scale_b=one, out_dtype=torch.bfloat16)
        Wsplit = [list(W.split(parts)) for W in Ws]
        def separate(ws):
            return [torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=one, out_dtype=torch.bfloat16) for w in ws]
        err = {}
        for nm, f in (("rowwise", rowwise), ("triton", triton_g), ("fp32_mul", fp32_then_mul)):
            err[nm] = ((f(Ws[0]).float() - ref).norm() / ref.norm()).item()
        times = {}
        rep = max(1, -(-16 // copies)) if m <= 256 else 1
        times["separate"] = kb.time_us([(lambda ws=ws: separate(ws)) for ws in Wsplit] * rep, 50)
        for nm, f in (("rowwise", rowwise), ("triton", triton_g), ("fp32_mul", fp32_then_mul), ("pertensor_lb", pertensor)):
            times[nm] = kb.time_us([(lambda W=W, f=f: f(W)) for W in Ws] * rep, 50)
        bf = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(kb.copies_for(2 * n * k))]
        xb = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        times["bf16"] = kb.time_us([(lambda W=W: torch.nn.functional.linear(xb, W)) for W in bf] * (max(1, -(-16 // len(bf))) if m <= 256 else 1), 50)
        del bf
        row = {"shape": name, "M": m, **{f"us_{a}": round(b, 2) for a, b in times.items()}, **{f"err_{a}": round(b, 6) for a, b in err.items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
        # also the Triton scaled_gemm with other small-M tiles
        if m <= 64:
            for cfg in ((16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 256, 4, 3), (64, 128, 128, 4, 4)):
                bm = max(cfg[0], 16)
                try:
                    t = kb.time_us([(lambda W=W: sg.scaled_gemm(x, W, sa, sv, None, torch.bfloat16, config=cfg)) for W in Ws] * rep, 50)
                    print(json.dumps({"shape": name, "M": m, "triton_cfg": cfg, "us": round(t, 2)}), flush=True)
                except Exception as e:
                    print("cfg fail", cfg, repr(e)[:200])
        del Ws, Wsplit
        torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_merged.json"), "w"))
