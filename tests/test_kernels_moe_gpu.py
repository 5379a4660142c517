"""The fused MoE kernels compiled for the GPU (bf16 activations) against the torch reference, for every expert format
(16-bit, static FP8, per-token FP8, INT8 SmoothQuant, INT4, NVFP4) on both paths (per-pair GEMV, grouped GEMM), at shapes
with several K tiles, N not a multiple of the column block, and an expert whose run spans several row blocks; the GEMV
also with other tiles and split K."""
import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels import tuning  # noqa: E402
from lowbit.kernels.moe.fused_moe import fused_moe_ref, fused_moe_triton  # noqa: E402
from test_kernels_moe import problem  # noqa: E402
from test_kernels_moe_fp8 import fp8_problem  # noqa: E402
from test_kernels_moe_fp8_per_token import problem as per_token_problem  # noqa: E402
from test_kernels_moe_int4 import int4_problem  # noqa: E402
from test_kernels_moe_int8 import int8_problem  # noqa: E402
from test_kernels_moe_nvfp4 import nvfp4_problem  # noqa: E402

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
# rel-L2 of the output: bf16 rounding of each GEMM's output and of the activation (~4e-3), which can move an FP8
# activation to a neighbouring code (a few % on that element); a wrong scale, nibble or row is O(1)
REL_TOL = 2e-2


def case(fmt: str, t: int):
    """(x bf16, w13, w2, ids, weights, {fp8 | int4 | nvfp4: scales}) on the GPU."""
    hidden, inter, experts, top_k = 256, 160, 8, 2
    if fmt == "bf16":
        x, w13, w2, ids, w = problem(t, hidden, inter, experts, top_k, torch.bfloat16, seed=t)
        kw = {}
    elif fmt == "int4":
        x, w13, w2, ids, w, scales, _ = int4_problem(t, hidden, inter, experts, top_k, group=32, seed=t)
        kw = {"int4": scales}
    elif fmt == "int8":
        x, w13, w2, ids, w, scales, _ = int8_problem(t, hidden, inter, experts, top_k, seed=t)
        kw = {"int8": scales}
    elif fmt == "nvfp4":
        x, w13, w2, ids, w, scales, _ = nvfp4_problem(t, hidden, inter, experts, top_k, seed=t)
        kw = {"nvfp4": scales}
    else:
        make = fp8_problem if fmt == "fp8" else per_token_problem
        x, w13, w2, ids, w, scales, _ = make(t, hidden, inter, experts, top_k, seed=t)
        kw = {"fp8": scales}
    cuda = lambda v: None if v is None else v.cuda()  # noqa: E731
    kw = {k: type(v)(*(cuda(f) for f in v)) for k, v in kw.items()}
    return x.bfloat16().cuda(), w13.cuda(), w2.cuda(), ids.cuda(), w.cuda(), kw


@gpu_only
@pytest.mark.parametrize("path", ["moe_gemv", "moe_grouped"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_per_token", "int8", "int4", "nvfp4"])
@pytest.mark.parametrize("t", [1, 3, 40])
def test_gpu_fused_moe_matches_reference(fmt, path, t):
    check(fmt, path, t)


@gpu_only
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("t", [1, 3, 9])
@pytest.mark.parametrize("config", [None, ((4, 512, 1), (4, 512, 1)), ((16, 1024, 2), (32, 2048, 4))])
def test_gpu_moe_decode_matches_reference(fmt, t, config):
    """lowbit.kernels.moe.decode (SiLU in gate/up, the combine in down) at the Tuning's tiles and others (K in one
    step or several)."""
    table = tuning.frozen(dict(zip(("gate_up", "down"), config))) if config else tuning.current().moe_decode_config
    with tuning.override(moe_decode_config=table):
        check(fmt, "moe_decode", t)


@gpu_only
@pytest.mark.parametrize("renormalize", [False, True])
def test_gpu_router_topk_matches_reference_in_a_cuda_graph(renormalize):
    """The one-launch router at Qwen3-30B-A3B's shape, eagerly and replayed from a CUDA graph over new inputs (the
    arrival counter must be zero again after every launch)."""
    from lowbit.kernels.moe.route import moe_router_ref, router_topk
    from test_kernels_moe_route import assert_same_route

    g = torch.Generator("cuda").manual_seed(3)
    w = (torch.randn(128, 2048, device="cuda", generator=g) / 45).bfloat16()
    x = torch.randn(1, 2048, device="cuda", generator=g).bfloat16()
    weights, ids, logits = router_topk(x, w, 8, renormalize)
    want = moe_router_ref(x, w, 8, renormalize)[2]
    assert (logits.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    assert_same_route(weights, ids, logits, 8, renormalize)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_topk(x, w, 8, renormalize)
    for seed in range(3):
        x.copy_(torch.randn(1, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        assert_same_route(out[0], out[1], out[2], 8, renormalize)
        assert torch.equal(out[2], router_topk(x, w, 8, renormalize)[2])


@gpu_only
@pytest.mark.parametrize("renormalize", [False, True])
def test_gpu_route_kernel_matches_torch(renormalize):
    from lowbit.kernels.moe.route import moe_route
    from test_kernels_moe_route import assert_same_route

    logits = torch.randn(33, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16()
    weights, ids = moe_route(logits, 8, renormalize)
    assert_same_route(weights, ids, logits, 8, renormalize)


@gpu_only
@pytest.mark.parametrize("config", [(8, 512, 4, 1), (16, 128, 8, 3), (4, 1024, 2, 2)])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8", "int4"])
def test_gpu_gemv_tiles_and_split_k(fmt, config):
    kind = {"bf16": "dense"}.get(fmt, fmt)
    with tuning.override(moe_gemv_config=tuning.frozen({**tuning.current().moe_gemv_config, kind: config})):
        check(fmt, "moe_gemv", 3)


def check(fmt: str, path: str, t: int):
    x, w13, w2, ids, weights, kw = case(fmt, t)
    out = fused_moe_triton(x, w13, w2, ids, weights, path=path, **kw)
    ref = fused_moe_ref(x.float(), w13.float() if fmt == "bf16" else w13, w2.float() if fmt == "bf16" else w2, ids,
                        weights, **kw)
    # the same reference with every intermediate rounded to bf16, as the kernels round: per-token FP8 re-quantizes
    # the bf16 activation, so on some draws the two conventions alone differ by a few % (3.1 % at t = 3)
    ref_bf16 = fused_moe_ref(x, w13, w2, ids, weights, **kw)
    spread = ((ref_bf16.float() - ref).norm() / ref.norm()).item()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert out.dtype == torch.bfloat16 and err <= max(REL_TOL, 2 * spread), (err, spread)
