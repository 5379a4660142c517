"""GPU correctness of every lowbit kernel against its torch reference, on fresh random inputs.

Each check prints ||out - ref|| / ||ref|| (fp32 norms) beside its tolerance. Called by `lowbit bench kernels --check`.
"""
import traceback

import torch

from lowbit import formats
from lowbit.kernels import linear, prepare_linear, rms_norm, rms_norm_ref, rotary, rotary_ref
from lowbit.kernels import silu_and_mul, silu_and_mul_ref
from lowbit.kernels.linear.act_quant import act_quant, act_quant_ref
from lowbit.kernels.linear.scaled_gemm import scaled_gemm, scaled_gemm_ref

# bf16 outputs round at 2**-9 relative: a correct kernel lands near 2e-3 against an fp32 reference
TOL_BF16 = 1e-2
LINEAR_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (576, 1536), (200, 72)]  # (in, out)
LINEAR_MS = [1, 7, 16, 64, 256, 1000]
FORMATS = [formats.get(name) for name in formats.names()]  # every registered format


def rel_err(out, ref) -> float:
    if not torch.isfinite(out.float()).all():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def _record(rows, name, shape, err, tol):
    rows.append({"check": name, "shape": shape, "rel_err": err, "tol": tol, "ok": err <= tol})


def check_elementwise(rows, dev):
    x = torch.randn(37, 4096, device=dev, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = 1 + 0.1 * torch.randn(4096, device=dev, dtype=torch.bfloat16)
    for r in (None, res):
        out, new_res = rms_norm(x, w, 1e-5, r)
        ref, ref_res = rms_norm_ref(x, w, 1e-5, r)
        _record(rows, "rms_norm" + ("+residual" if r is not None else ""), "37x4096",
                max(rel_err(out, ref), rel_err(new_res, ref_res)), TOL_BF16)
    t, d = 50, 128
    q = torch.randn(t, 32 * d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, 8, d, device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (t,), device=dev)
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device=dev).float() / d)
    freqs = torch.outer(torch.arange(4096, device=dev).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    (qo, ko), (qr, kr) = rotary(q, k, pos, cache), rotary_ref(q, k, pos, cache)
    _record(rows, "rotary", "50x(32+8)x128", max(rel_err(qo, qr), rel_err(ko, kr)), TOL_BF16)
    g = torch.randn(33, 2 * 14336, device=dev, dtype=torch.bfloat16)
    _record(rows, "silu_and_mul", "33x2x14336", rel_err(silu_and_mul(g), silu_and_mul_ref(g)), TOL_BF16)
    scale = torch.tensor(4.0 / 448, device=dev)
    for name, out, ref in [("rms_norm+residual -> fp8", rms_norm(x, w, 1e-5, res, scale)[0],
                            rms_norm_ref(x, w, 1e-5, res, scale)[0]),
                           ("silu_and_mul -> fp8", silu_and_mul(g, scale), silu_and_mul_ref(g, scale))]:
        mismatch = (out.float() != ref.float()).float().mean().item()
        _record(rows, name + " (mismatch frac)", "-", mismatch if out.dtype == torch.float8_e4m3fn else 1.0, 1e-4)


def check_act_quant(rows, dev):
    x = (3 * torch.randn(300, 4096, device=dev)).to(torch.bfloat16)
    smooth = (0.5 + torch.rand(4096, device=dev)).to(torch.bfloat16)
    for dtype, name, scale in [(torch.float8_e4m3fn, "fp8", 6 / 448), (torch.int8, "int8", 6 / 127)]:
        for static in (True, False):
            s = torch.tensor(scale, device=dev) if static else None
            q, sq = act_quant(x, dtype, s, smooth)
            q_ref, s_ref = act_quant_ref(x, dtype, s, smooth)
            mismatch = (q.float() != q_ref.float()).float().mean().item()
            scale_err = rel_err(sq, s_ref)
            # per-token: torch divides amax by the Python scalar qmax as a multiply by its reciprocal, so its
            # scale can differ from the kernel's IEEE division in the last bit, and a few q flip at a rounding tie
            _record(rows, f"act_quant {name} {'static' if static else 'per-token'} (mismatch frac)", "300x4096",
                    max(mismatch, scale_err), 1e-4 if static else 1e-3)


def check_scaled_gemm(rows, dev):
    for m in (1, 16, 300, 2048):
        a = torch.randint(-127, 128, (m, 4096), device=dev, dtype=torch.int8)
        b = torch.randint(-127, 128, (6144, 4096), device=dev, dtype=torch.int8)
        sa, sb = torch.rand(m, 1, device=dev) * 1e-3, torch.rand(6144, device=dev) * 1e-3
        out = scaled_gemm(a, b, sa, sb, None, torch.bfloat16)
        _record(rows, "int8 gemm (Triton)", f"{m}x4096->6144", rel_err(out, scaled_gemm_ref(a, b, sa, sb)), TOL_BF16)
        af, bf = a.float().mul(0.02).to(torch.float8_e4m3fn), b.float().mul(0.02).to(torch.float8_e4m3fn)
        out = scaled_gemm(af, bf, sa, sb, None, torch.bfloat16)
        _record(rows, "fp8 gemm (Triton)", f"{m}x4096->6144", rel_err(out, scaled_gemm_ref(af, bf, sa, sb)), TOL_BF16)


def _layer(fmt, k, n, dev):
    w = torch.randn(n, k, device=dev) * 0.02
    carries_smooth = "pre_quant_scale" in fmt.tensors.required + fmt.tensors.optional
    smooth = (0.5 + torch.rand(k, device=dev)).to(torch.bfloat16) if carries_smooth else None
    group = 128 if k % 128 == 0 else (64 if k % 64 == 0 else 8)  # 8: a group the kernel refuses -> dense fallback
    return fmt.quantize(w, x_amax=4.0, group=group, smooth=smooth)


def check_linear(rows, dev):
    for k, n in LINEAR_SHAPES:
        for fmt in FORMATS:
            if fmt.kernel == "nvfp4" and k % 16:
                continue
            try:
                check_linear_layer(rows, fmt, k, n, dev)
            except Exception as e:  # noqa: BLE001 - recorded as a failed check and printed, not swallowed
                traceback.print_exc()
                rows.append({"check": f"linear {fmt.name} raised {type(e).__name__}: {e}"[:300],
                             "shape": f"{k}->{n}", "rel_err": float("inf"), "tol": 0.0, "ok": False})


def check_linear_layer(rows, fmt, k, n, dev):
    t = _layer(fmt, k, n, dev)
    p = prepare_linear(fmt.name, t, dev)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    # Hopper serves NVFP4 weight-only: its reference is the weight-only format's
    ref_fmt = formats.W4A16_NVFP4 if fmt.kernel == "nvfp4" else fmt
    for m in LINEAR_MS:
        x = (torch.randn(m, k, device=dev)).to(torch.bfloat16)
        y = linear(x, p, bias)
        ref = (x.float() @ t["weight"].float().t() + bias.float()) if fmt is formats.BF16 else \
            ref_fmt.reference_linear(x, t, bias)
        _record(rows, f"linear {fmt.name} ({p.kind})", f"{m}x{k}->{n}", rel_err(y, ref), TOL_BF16)
        if not fmt.weight_only and fmt.kernel == "nvfp4" and m == 16:
            w4a4 = fmt.reference_linear(x, t, bias)
            rows.append({"check": "info: NVFP4 weight-only vs W4A4 reference", "shape": f"{m}x{k}->{n}",
                         "rel_err": rel_err(y, w4a4), "tol": None, "ok": True})


def run_checks(dev="cuda") -> list[dict]:
    torch.manual_seed(0)
    rows = []
    for check in (check_elementwise, check_act_quant, check_scaled_gemm, check_linear):
        try:
            check(rows, dev)
        except Exception as e:  # noqa: BLE001 - recorded as a failed check and printed, not swallowed
            traceback.print_exc()
            rows.append({"check": f"{check.__name__} raised {type(e).__name__}: {e}"[:300], "shape": "-",
                         "rel_err": float("inf"), "tol": 0.0, "ok": False})
    return rows


def format_checks(rows) -> str:
    lines = ["| check | shape | rel err | tol | ok |", "|---|---|---|---|---|"]
    for r in rows:
        tol = "-" if r["tol"] is None else f"{r['tol']:.0e}"
        lines.append(f"| {r['check']} | {r['shape']} | {r['rel_err']:.2e} | {tol} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)
