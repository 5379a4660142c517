"""FP8 decode GEMV (lowbit.kernels.fp8_gemv, M = 1) on CPU under the Triton interpreter, against scaled_gemm_ref:
per-tensor and per-row weight scales ([N] and [N, 1]), bias, K ragged (not a multiple of BLOCK_K, nor of 16) and
shorter than one step, N odd / not a multiple of BLOCK_N, one and two steps loaded ahead, several chunks per thread.
The interpreter runs the pure-Triton e4m3 -> fp32 conversion (the GPU runs inline PTX cvt; bench/fp8_gemv_bench.py
checks that path against the same reference). fp16 outputs: the interpreter truncates fp32 -> bf16 casts."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels import fp8_gemv as fg  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.scaled_gemm import scaled_gemm_ref  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton's import)")
TOL = 1e-3  # fp16 output vs the reference (fp32 sums in another order, both rounded to fp16)
TOL_FP32 = 1e-5  # fp32 output vs an fp64 reference: products are exact, only fp32 sums round (measured ~1e-7)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def fp8(t):
    return t.clamp(-448, 448).to(torch.float8_e4m3fn)


def inputs(k, n, per_row, bias, seed):
    g = torch.Generator().manual_seed(seed)
    q = fp8(torch.randn(1, k, generator=g) * 30)
    w = fp8(torch.randn(n, k, generator=g) * 100)
    sa = torch.tensor(0.01)
    sb = {None: torch.tensor(2e-4), "n": torch.rand(n, generator=g) * 1e-3 + 1e-5,
          "n1": torch.rand(n, 1, generator=g) * 1e-3 + 1e-5}[per_row]  # [N, 1] as fuse.py merges
    b = torch.randn(n, generator=g).half() if bias else None
    return q, w, sa, sb, b


@pytest.mark.parametrize("k,n,config,per_row,bias", [
    (2048, 20, None, None, False),  # the default config: two even steps
    (4096 + 320, 33, None, "n1", True),  # 5 steps, the last one masked (ragged K), odd N
    (1000, 7, fg.GemvConfig(4, 1024, 2), "n", True),  # K < BLOCK_K and K % 16 != 0
    (2048, 16, fg.GemvConfig(8, 1024, 2, 2), "n1", False),  # two steps ahead, exactly two steps
    (1024, 9, fg.GemvConfig(8, 1024, 2, 2), None, True),  # two steps ahead, a single step
    (3072 + 16, 24, fg.GemvConfig(4, 1024, 2, 2), "n", False),  # two steps ahead, 4 steps, ragged
    (1536, 24, fg.GemvConfig(16, 512, 1), "n1", True),
    (4096, 10, fg.GemvConfig(4, 2048, 2), None, False),  # 2 chunks per thread
])
def test_gemv_matches_reference(k, n, config, per_row, bias):
    q, w, sa, sb, b = inputs(k, n, per_row, bias, seed=k + n)
    out = fg.fp8_gemv(q, w, sa, sb, b, torch.float16, config)
    ref = scaled_gemm_ref(q, w, sa, sb, b, torch.float16)
    assert out.shape == (1, n) and out.dtype == torch.float16
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("config", [None, fg.GemvConfig(8, 1024, 2, 2)])
def test_gemv_fp32_accuracy(config):
    """Exact e4m3 products: the fp32 output is within fp32 summation error of the fp64 result."""
    q, w, sa, sb, b = inputs(4096 + 64, 18, "n1", True, seed=3)
    out = fg.fp8_gemv(q, w, sa, sb, b, torch.float32, config)
    ref = (q.double() @ w.double().t()) * 0.01 * sb.double().reshape(1, -1) + b.double()
    assert rel_err(out, ref) < TOL_FP32


def test_gemv_bf16_and_scale_shapes():
    """bf16 output (the interpreter truncates fp32 -> bf16: ~4e-3 vs the rounded reference), scale_a [1, 1]."""
    q, w, sa, sb, _ = inputs(2048, 12, "n", False, seed=5)
    out = fg.fp8_gemv(q, w, sa.reshape(1, 1), sb)
    ref = scaled_gemm_ref(q, w, sa, sb, None, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2


def test_choose_config_from_shapes():
    assert fg.choose_config(4096, 4096) == fg.DEFAULT_CONFIG
    assert fg.choose_config(256, 4096).block_n == 4  # few rows: more programs
    assert fg.DEFAULT_CONFIG in fg.CANDIDATES


def test_gemv_rejects():
    q, w, sa, sb, _ = inputs(1000, 8, None, False, seed=1)
    with pytest.raises(AssertionError):
        fg.fp8_gemv(torch.cat([q, q]), w, sa, sb)  # M = 2
    with pytest.raises(AssertionError):
        fg.fp8_gemv(q[:, :998], w[:, :998].contiguous(), sa, sb)  # K % 4 != 0
