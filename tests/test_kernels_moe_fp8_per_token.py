"""Per-token FP8 experts (fp8_dynamic: per-channel weight scales, each input row quantized with its own scale): the
torch reference against the format's own reference linear per expert, and the grouped GEMM and the per-pair GEMV
under the interpreter against the reference."""
import pytest
import torch

pytest.importorskip("triton")

from lowbit.formats.fp8_per_token import FP8_PER_CHANNEL_PER_TOKEN as FMT  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.moe.fused_moe import Fp8Scales, fused_moe_ref, fused_moe_triton  # noqa: E402
from lowbit.kernels.ops.activation import silu_and_mul_ref  # noqa: E402
from test_kernels_moe_fp8 import INTERPRETER_NORM_TOL  # noqa: E402

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test")


def problem(t, hidden, inter, experts, top_k, seed=0):
    """x fp32 with rows of very different magnitudes (per-token scales matter); experts quantized by the format."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g) * torch.logspace(-1, 1, t)[:, None]
    parts = [(FMT.quantize(torch.randn(inter, hidden, generator=g) / hidden ** 0.5),
              FMT.quantize(2 * torch.randn(inter, hidden, generator=g) / hidden ** 0.5),
              FMT.quantize(torch.randn(hidden, inter, generator=g) / inter ** 0.5)) for _ in range(experts)]
    w13 = torch.stack([torch.cat([gt["weight"], up["weight"]]) for gt, up, _ in parts])
    w2 = torch.stack([d["weight"] for _, _, d in parts])
    scales = Fp8Scales(torch.stack([torch.cat([gt["weight_scale"], up["weight_scale"]]) for gt, up, _ in parts]),
                       None, torch.stack([d["weight_scale"] for _, _, d in parts]), None)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(t)])
    return x, w13, w2, ids, torch.rand(t, top_k, generator=g), scales, parts


def test_reference_equals_format_linears():
    x, w13, w2, ids, weights, scales, parts = problem(7, 32, 24, 5, 2, seed=1)
    want = torch.zeros_like(x)
    for tok in range(x.shape[0]):
        for j, e in enumerate(ids[tok].tolist()):
            gate, up, down = parts[e]
            xt = x[tok:tok + 1]
            h = silu_and_mul_ref(torch.cat([FMT.reference_linear(xt, gate), FMT.reference_linear(xt, up)], -1))
            want[tok] += weights[tok, j] * FMT.reference_linear(h, down)[0]
    assert torch.allclose(fused_moe_ref(x, w13, w2, ids, weights, fp8=scales), want, atol=1e-5, rtol=1e-5)


@interpreter_only
@pytest.mark.parametrize("path", ["moe_gemv", "moe_grouped"])
def test_triton_matches_reference(path):
    """Compared by norm (the interpreter's fp8 cast, see test_kernels_moe_fp8); one scale for all rows, the
    largest row's, is off by far more: the small rows then round to a few fp8 codes or to 0."""
    x, w13, w2, ids, weights, scales, _ = problem(9, 64, 48, 6, 2, seed=3)
    out = fused_moe_triton(x, w13, w2, ids, weights, fp8=scales, path=path)
    ref = fused_moe_ref(x, w13, w2, ids, weights, fp8=scales)
    assert ((out - ref).norm() / ref.norm()).item() < INTERPRETER_NORM_TOL
    small = slice(0, 3)  # the smallest rows, relative to their own size
    assert ((out[small] - ref[small]).norm() / ref[small].norm()).item() < INTERPRETER_NORM_TOL
