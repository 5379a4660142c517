"""Batch-1 MoE decode pieces at Qwen3-30B-A3B's shapes (hidden 2048, moe_intermediate 768, 128 experts, top-8), each
checked against its torch reference before it is timed (a failure prints FAIL and the script exits 1):

  moe     the layer's experts on lowbit.kernels.moe.decode (gate/up + SiLU, down + combine: 2 launches) over tile
          variants, beside the per-pair GEMV path (gate/up, SiLU, down, combine: 4 launches), bf16 and fp8
  router  the router's GEMV + top-k in one launch (router_topk) over tiles, beside dense_linear then moe_route
  fp8gemv lowbit.kernels.linear.dense_gemv.fp8_gemv over tiles at the attention's qkv (2048 -> 5120) and o
          (4096 -> 2048) shapes

    python3 dev/bench/moe_decode_sweep.py [moe] [router] [fp8gemv] [--tokens 1 4]

Times: median us per call of CUDA-graph replays (lowbit.bench.kernels.time_us), every call on its own routing or
weight copy so the weights stream from HBM.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lowbit.kernels import tuning  # noqa: E402
from lowbit.kernels.moe.fused_moe import fused_moe_ref, fused_moe_triton  # noqa: E402
from moe_gemv_sweep import FULL, experts, layer_bytes, rel_err, routings  # noqa: E402

REL_TOL = 2e-2
GATE_UP = ((8, 2048, 4), (4, 2048, 4), (16, 2048, 4), (8, 1024, 2), (4, 1024, 2), (16, 1024, 2), (8, 4096, 8))
DOWN = ((16, 1024, 2), (8, 1024, 2), (32, 1024, 2), (4, 1024, 2), (16, 512, 1), (8, 512, 1), (16, 2048, 4))
ROUTER = ((4, 1024, 4), (2, 1024, 4), (1, 1024, 4), (2, 2048, 8), (1, 512, 2), (2, 512, 2))
FP8_GEMV = ((8, 1024, 2), (4, 1024, 2), (16, 1024, 2), (4, 2048, 4), (8, 2048, 4), (8, 512, 1), (16, 512, 1),
            (32, 1024, 2))


def time_us(calls, reps=30):
    from lowbit.bench.kernels import time_us as graph_time
    return graph_time(calls, reps)


def moe(tokens, failed):
    gen = torch.Generator("cuda").manual_seed(0)
    for fmt in ("fp8", "bf16"):
        w13, w2, scales = experts(fmt, FULL, "cuda", gen)
        for t in tokens:
            cases = routings(t, FULL, torch.bfloat16, "cuda", gen)
            refs = [fused_moe_ref(x.float(), w13.float() if fmt == "bf16" else w13,
                                  w2.float() if fmt == "bf16" else w2, ids, wts, **scales).float()
                    for x, ids, wts in cases]
            gb = sum(layer_bytes(fmt, ids, FULL) for _, ids, _ in cases) / len(cases) / 1e9

            def run(path, table=None):
                calls = [lambda c=c: fused_moe_triton(c[0], w13, w2, c[1], c[2], path=path, **scales) for c in cases]
                with tuning.override(**({"moe_decode_config": tuning.frozen(table)} if table else {})):
                    err = max(rel_err(call().float(), ref, False) for call, ref in zip(calls, refs))
                    if err > REL_TOL:
                        failed.append((fmt, t, path, table))
                        return err, None
                    return err, time_us(calls)

            err, base = run("moe_gemv")
            print(f"moe {fmt:4s} t={t} per-pair GEMV path: {base:7.1f} us {gb / (base * 1e-6):7.1f} GB/s "
                  f"err {err:.1e}", flush=True)
            best_down = DOWN[0]
            results = []
            for gu in GATE_UP:
                err, us = run("moe_decode", {"gate_up": gu, "down": best_down})
                print(f"moe {fmt:4s} t={t} gate_up {gu} down {best_down}: "
                      + (f"{us:7.1f} us {gb / (us * 1e-6):7.1f} GB/s err {err:.1e}" if us else f"FAIL {err:.1e}"),
                      flush=True)
                if us:
                    results.append((us, gu))
            best_gu = min(results)[1] if results else GATE_UP[0]
            results = []
            for down in DOWN:
                err, us = run("moe_decode", {"gate_up": best_gu, "down": down})
                print(f"moe {fmt:4s} t={t} gate_up {best_gu} down {down}: "
                      + (f"{us:7.1f} us {gb / (us * 1e-6):7.1f} GB/s err {err:.1e}" if us else f"FAIL {err:.1e}"),
                      flush=True)
                if us:
                    results.append((us, down))
            if results:
                us, down = min(results)
                print(f"# best moe {fmt} t={t}: gate_up {best_gu} down {down} {us:.1f} us ({base / us:.2f}x the "
                      f"per-pair GEMV path's {base:.1f})", flush=True)


def router(failed):
    from lowbit.kernels.linear.dense_gemv import dense_linear
    from lowbit.kernels.moe.route import moe_route, moe_router_ref, router_topk

    gen = torch.Generator("cuda").manual_seed(1)
    copies = [((torch.randn(128, 2048, device="cuda", generator=gen) / 45).bfloat16(),
               torch.randn(1, 2048, device="cuda", generator=gen).bfloat16()) for _ in range(48)]
    base = time_us([lambda c=c: moe_route(dense_linear(c[1], c[0]), 8, True) for c in copies])
    print(f"router dense_linear + moe_route: {base:6.2f} us", flush=True)
    results = []
    for cfg in ROUTER:
        ok = True
        for w, x in copies[:4]:
            weights, ids, logits = router_topk(x, w, 8, True, config=cfg)
            want_w, want_ids, want = moe_router_ref(x, w, 8, True)
            ok &= rel_err(logits.float(), want.float(), False) <= 1e-2 and torch.equal(
                torch.softmax(logits.float(), -1).gather(1, ids),
                torch.softmax(logits.float(), -1).topk(8, -1).values)
        if not ok:
            failed.append(("router", cfg))
            print(f"router {cfg}: FAIL", flush=True)
            continue
        us = time_us([lambda c=c: router_topk(c[1], c[0], 8, True, config=cfg) for c in copies])
        results.append((us, cfg))
        print(f"router router_topk {cfg}: {us:6.2f} us", flush=True)
    if results:
        us, cfg = min(results)
        print(f"# best router {cfg}: {us:.2f} us ({base / us:.2f}x)", flush=True)


def fp8gemv(failed):
    from lowbit.kernels.linear.dense_gemv import fp8_gemv

    gen = torch.Generator("cuda").manual_seed(2)
    for n, k in ((5120, 2048), (2048, 4096)):
        copies = []
        for _ in range(24):  # 24 x 8-10 MB: past the 50 MB L2
            w = (torch.randn(n, k, device="cuda", generator=gen) * 0.1).to(torch.float8_e4m3fn)
            q = torch.randn(1, k, device="cuda", generator=gen).clamp(-448, 448).to(torch.float8_e4m3fn)
            copies.append((q, w, torch.tensor(0.02, device="cuda"), torch.rand(n, device="cuda", generator=gen)))
        results = []
        for cfg in FP8_GEMV:
            q, w, sa, sb = copies[0]
            ref = (q.float() @ w.float().t()) * sa * sb
            err = rel_err(fp8_gemv(q, w, sa, sb, config=cfg).float(), ref, False)
            if err > REL_TOL:
                failed.append(("fp8_gemv", n, k, cfg))
                print(f"fp8_gemv {n}x{k} {cfg}: FAIL {err:.1e}", flush=True)
                continue
            us = time_us([lambda c=c: fp8_gemv(c[0], c[1], c[2], c[3], config=cfg) for c in copies])
            results.append((us, cfg))
            print(f"fp8_gemv {n}x{k} {cfg}: {us:6.2f} us {n * k / (us * 1e3):7.1f} GB/s err {err:.1e}", flush=True)
        if results:
            us, cfg = min(results)
            print(f"# best fp8_gemv {n}x{k}: {cfg} {us:.2f} us ({n * k / (us * 1e3):.1f} GB/s)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("parts", nargs="*", default=["moe", "router", "fp8gemv"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    failed: list = []
    for part in args.parts:
        if part == "moe":
            moe(args.tokens, failed)
        elif part == "router":
            router(failed)
        elif part == "fp8gemv":
            fp8gemv(failed)
    if failed:
        print(f"FAILED: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
