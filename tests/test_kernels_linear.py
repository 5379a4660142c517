"""prepare_linear / linear / linear_ref: one call site for every format, on CPU (reference) and through the kernel
path under the interpreter."""

import pytest
import torch


from lowbit.formats import reference_linear  # noqa: E402
from lowbit.kernels import linear, linear_ref, prepare_linear  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.linear.qlinear import run_kernels  # noqa: E402
from lowbit.testing.synthetic import quantize_linear  # noqa: E402

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="needs triton and TRITON_INTERPRET=1 at its import")

ALGOS = ["FP8", "FP8_PER_CHANNEL_PER_TOKEN", "NVFP4", "W4A16_NVFP4", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL",
         "INT8_PER_CHANNEL_PER_TOKEN"]
# fp8 rows are loose: the interpreter mis-rounds ~2% of fp32 -> fp8 casts (ENV.md); NVFP4 is served weight-only
INTERPRETER_TOL = {"FP8": 0.15, "FP8_PER_CHANNEL_PER_TOKEN": 0.15, "W8A8_SQ_PER_CHANNEL": 2e-3,
                   "INT8_PER_CHANNEL_PER_TOKEN": 2e-3,
                   "NVFP4": 2e-3, "W4A16_NVFP4": 2e-3, "W4A16_AWQ": 2e-3, "bf16": 2e-3}


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _layer(algo, n=64, k=256, group=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    if algo == "bf16":
        return {"weight": w.half()}
    smooth = (0.5 + torch.rand(k, generator=g)).half() if algo in ("W4A16_AWQ", "W8A8_SQ_PER_CHANNEL") else None
    return quantize_linear(algo, w, x_amax=4.0, group=group, smooth=smooth)


@pytest.mark.parametrize("algo", ALGOS)
def test_linear_on_cpu_is_reference_linear(algo):
    t = _layer(algo)
    x = torch.randn(2, 3, 256).half()
    bias = torch.randn(64).half()
    p = prepare_linear(algo, t, "cpu")
    assert p.kind == "source" and (p.in_features, p.out_features) == (256, 64)
    y = linear(x, p, bias)
    assert y.shape == (2, 3, 64) and y.dtype == x.dtype
    assert torch.equal(y, reference_linear(algo, x, t, bias))
    assert torch.equal(linear_ref(x, p, bias), y)


@pytest.mark.parametrize("algo", [None, "bf16"])
def test_plain_layers(algo):
    t = _layer("bf16")
    x = torch.randn(4, 256).half()
    y = linear(x, prepare_linear(algo, t, "cpu"))
    assert rel_err(y, x.float() @ t["weight"].float().t()) < 1e-3


def test_dense_silu_mul_on_cpu_is_silu_and_mul_of_the_linear():
    """silu_mul (a merged gate/up layer; one kernel at one row on the GPU): off the GPU, silu_and_mul's reference
    of the layer's output, at one row and several."""
    from lowbit.kernels import dense_linear, silu_and_mul_ref

    t = _layer("bf16", n=64)
    bias = torch.randn(64).half()
    for x in (torch.randn(1, 256).half(), torch.randn(3, 256).half()):
        y = dense_linear(x, t["weight"], bias, silu_mul=True)
        assert y.shape == (x.shape[0], 32)
        assert torch.equal(y, silu_and_mul_ref(torch.nn.functional.linear(x, t["weight"], bias)))


def test_unknown_algo_is_refused():
    with pytest.raises(ValueError, match="unsupported quant_algo"):
        prepare_linear("W3A5", {"weight": torch.zeros(2, 2)}, "cpu")


@pytest.mark.parametrize("algo", ALGOS + ["bf16"])
def test_packed_layer_reference_equals_source_reference(algo):
    t = _layer(algo, k={"W4A16_AWQ": 192, "NVFP4": 208, "W4A16_NVFP4": 208}.get(algo, 200))
    k = t["weight"].shape[1] * (2 if "NVFP4" in algo else 1)
    x = torch.randn(3, k).half()
    packed = prepare_linear(algo, t, "cpu", pack=True)
    source = prepare_linear(algo, t, "cpu")
    assert packed.source is None
    assert torch.equal(linear_ref(x, packed), linear_ref(x, source))


@needs_interpreter
@pytest.mark.parametrize("algo", ALGOS + ["bf16"])
def test_kernel_path_under_interpreter(algo):
    t = _layer(algo, n=48, k=192)
    x = torch.randn(5, 192).half()
    bias = torch.randn(48).half()
    p = prepare_linear(algo, t, "cpu", pack=True)
    ref_algo = "W4A16_NVFP4" if algo == "NVFP4" else algo  # Hopper serves NVFP4 weight-only
    ref = reference_linear(ref_algo, x, t, bias) if algo != "bf16" else linear_ref(x, p, bias)
    assert rel_err(run_kernels(x, p, bias), ref) < INTERPRETER_TOL[algo]


@needs_interpreter
def test_awq_group_the_kernel_cannot_take_falls_back_to_dense():
    t = _layer("W4A16_AWQ", k=96, group=48)
    p = prepare_linear("W4A16_AWQ", t, "cpu", pack=True)
    assert p.kind == "dense"
    x = torch.randn(2, 96).half()
    assert rel_err(run_kernels(x, p), reference_linear("W4A16_AWQ", x, t)) < 5e-3


def test_fp8_layer_takes_a_prequantized_input():
    t = _layer("FP8")
    x = torch.randn(3, 256).half()
    q = (x.float() / t["input_scale"]).clamp(-448, 448).to(torch.float8_e4m3fn)
    p = prepare_linear("FP8", t, "cpu")
    y = linear(q, p)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, reference_linear("FP8", x, t)) < 1e-2
    with pytest.raises(ValueError, match="static-scale FP8"):
        linear(q, prepare_linear("FP8_PER_CHANNEL_PER_TOKEN", _layer("FP8_PER_CHANNEL_PER_TOKEN"), "cpu"))


@needs_interpreter
def test_fp8_prequantized_kernel_path():
    t = _layer("FP8", n=48, k=192)
    x = torch.randn(5, 192).half()
    q = (x.float() / t["input_scale"]).clamp(-448, 448).to(torch.float8_e4m3fn)
    p = prepare_linear("FP8", t, "cpu", pack=True)
    y = run_kernels(q, p, out_dtype=torch.float16)
    assert y.dtype == torch.float16 and rel_err(y, linear_ref(q, p)) < 1e-2
