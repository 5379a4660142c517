"""lowbit.kernels.routes on the CPU: every (kind, M, N, K, scale kind, arch) of a grid goes to the kernel the
if-chains of w8a8.py, w4a16.py and dense_gemv.py chose before the table, written out below by hand."""
import pytest

from lowbit.kernels import routes, tuning

MS = (1, 2, 3, 8, 9, 16, 17, 24, 25, 32, 33, 128, 129, 256, 257, 4096)
SHAPES = {  # (N, K): Llama-3.1-8B's linears, and shapes that are no multiple of 16 (odd2: K no multiple of 4)
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "odd": (1000, 1000), "odd2": (30, 198),
}
LLAMA = ("qkv", "o", "gate_up", "down")
ODD = ("odd", "odd2")
HOPPER, ADA, AMPERE, NO_GPU = (9, 0), (8, 9), (8, 0), None


def _expected(segments: str, m: int) -> str:
    """'1:a 32:b *:c' -> a for M <= 1, b for M <= 32, c above."""
    for seg in segments.split():
        top, kernel = seg.split(":")
        if top == "*" or m <= int(top):
            return kernel
    raise AssertionError(segments)


# (kind, scale, arch, shapes) -> M segments
EXPECTED = [
    # FP8 on Hopper
    ("fp8", "per_tensor", HOPPER, ("qkv", "o"), "1:fp8_gemv *:scaled_mm"),
    ("fp8", "per_tensor", HOPPER, ("gate_up",), "*:scaled_mm"),
    ("fp8", "per_tensor", HOPPER, ("down",), "24:fp8_small_m *:scaled_mm"),
    ("fp8", "per_tensor", HOPPER, ODD, "1:fp8_gemv 24:fp8_small_m *:scaled_gemm"),
    ("fp8", "per_row", HOPPER, ("qkv", "o"), "1:fp8_gemv 32:fp8_small_m *:scaled_mm_rowwise"),
    ("fp8", "per_row", HOPPER, ("gate_up", "down"), "32:fp8_small_m *:scaled_mm_rowwise"),
    ("fp8", "per_row", HOPPER, ODD, "1:fp8_gemv 32:fp8_small_m *:scaled_gemm"),
    ("fp8", "per_token", HOPPER, LLAMA, "32:fp8_small_m *:scaled_mm_rowwise"),
    ("fp8", "per_token", HOPPER, ODD, "32:fp8_small_m *:scaled_gemm"),
    # FP8 on Ada (cuBLAS fp8, no wgmma)
    ("fp8", "per_tensor", ADA, LLAMA, "*:scaled_mm"),
    ("fp8", "per_row", ADA, LLAMA, "32:scaled_mm_then_scale *:scaled_mm_rowwise"),
    ("fp8", "per_token", ADA, LLAMA, "*:scaled_mm_rowwise"),
    *[("fp8", scale, ADA, ODD, "*:scaled_gemm") for scale in ("per_tensor", "per_row", "per_token")],
    # FP8 without fp8 tensor cores, or without a GPU
    *[("fp8", scale, arch, LLAMA + ODD, "*:scaled_gemm") for scale in ("per_tensor", "per_row", "per_token")
      for arch in (AMPERE, NO_GPU)],
    # INT8 (SmoothQuant: per-channel weights, static or dynamic x scales)
    *[("int8", scale, HOPPER, LLAMA + ("odd",), "2:int8_gemv 32:int8_small_m *:scaled_gemm")
      for scale in ("per_row", "per_token")],
    *[("int8", scale, HOPPER, ("odd2",), "32:int8_small_m *:scaled_gemm") for scale in ("per_row", "per_token")],
    *[("int8", scale, arch, LLAMA + ("odd",), "2:int8_gemv *:scaled_gemm")
      for scale in ("per_row", "per_token") for arch in (ADA, AMPERE)],
    *[("int8", scale, arch, ("odd2",), "*:scaled_gemm") for scale in ("per_row", "per_token") for arch in (ADA, AMPERE)],
    *[("int8", scale, NO_GPU, LLAMA + ODD, "*:scaled_gemm") for scale in ("per_row", "per_token")],
]
W4_EXPECTED = [  # (kind, group, shapes) -> M segments, on every arch (the W4 routes are asked where kernels run)
    ("int4", 128, ("gate_up", "down"), "1:w4_gemv 8:w4_mma 16:w4_small_m 256:w4_tensor_core *:w4_dequant"),
    ("int4", 128, ("qkv", "o") + ODD, "1:w4_gemv 8:w4_mma 256:w4_tensor_core *:w4_dequant"),
    ("int4", 32, ("gate_up", "down"), "2:w4_gemv 16:w4_small_m 256:w4_tensor_core *:w4_dequant"),
    ("int4", 32, ("qkv", "o") + ODD, "2:w4_gemv 256:w4_tensor_core *:w4_dequant"),
    ("nvfp4", 16, LLAMA + ODD, "1:w4_gemv 8:w4_mma 128:w4_tensor_core *:w4_dequant"),
]
DENSE_EXPECTED = [  # (arch, x16) -> M segments
    *[(arch, True, "1:dense_gemv *:cublas") for arch in (HOPPER, ADA, AMPERE)],
    (NO_GPU, True, "*:cublas"),
    *[(arch, False, "*:cublas") for arch in (HOPPER, ADA, AMPERE, NO_GPU)],
]


def _cases():
    for kind, scale, arch, shapes, segments in EXPECTED:
        for name in shapes:
            for m in MS:
                if scale == "per_token" and m == 1:
                    continue  # one x row has one x scale: scale_kind reads it as per_tensor / per_row
                yield (kind, m, *SHAPES[name], arch, {"scale": scale}), _expected(segments, m)
    for kind, group, shapes, segments in W4_EXPECTED:
        for name in shapes:
            for arch in (HOPPER, ADA, AMPERE):
                for m in MS:
                    yield (kind, m, *SHAPES[name], arch, {"group": group}), _expected(segments, m)
    for arch, x16, segments in DENSE_EXPECTED:
        for name in SHAPES:
            for m in MS:
                yield ("dense", m, *SHAPES[name], arch, {"x16": x16}), _expected(segments, m)


def test_grid_matches_the_old_dispatch():
    cases = list(_cases())
    assert len(cases) > 2000
    table = tuning.for_capability((9, 0))
    wrong = [(args, want, got) for args, want in cases
             if (got := routes.route("linear", *args[:5], **args[5], table=table)) != want]
    assert not wrong, wrong[:10]


def test_fp32_x_skips_w4_mma():
    """w4_mma takes 16-bit x only: fp32 rows 2 go to the GEMV, 3-8 to the tensor-core kernel."""
    got = [routes.route("linear", "int4", m, 4096, 4096, HOPPER, group=128, x16=False) for m in (1, 2, 3, 8)]
    assert got == ["w4_gemv", "w4_gemv", "w4_tensor_core", "w4_tensor_core"]


def test_only_restricts_to_the_tensor_core_rows():
    """tensor_core_linear / tensor_core_gemm: the same table without the GEMVs (and the dequant path)."""
    assert routes.route("linear", "fp8", 1, 6144, 4096, HOPPER, scale="per_row",
                        only=routes.W8A8_TENSOR_CORE) == "fp8_small_m"
    assert routes.route("linear", "int8", 1, 4096, 4096, HOPPER, only=routes.W8A8_TENSOR_CORE) == "int8_small_m"
    assert routes.route("linear", "int4", 4096, 4096, 4096, None, only=routes.W4_TENSOR_CORE) == "w4_tensor_core"
    assert routes.route("linear", "int4", 8, 28672, 4096, None, only=routes.W4_TENSOR_CORE) == "w4_small_m"


@pytest.mark.parametrize("changes, args, kernel", [
    ({"int8_gemv_max_m": 8}, ("int8", 8, 4096, 4096, HOPPER), "int8_gemv"),
    ({"int8_gemv_max_m": 1}, ("int8", 2, 4096, 4096, HOPPER), "int8_small_m"),
    ({"w4_mma_rows": {}}, ("int4", 2, 4096, 4096, HOPPER), "w4_gemv"),
    ({"w4_dequant_min_m": {"int4": 17, "nvfp4": 17}}, ("int4", 17, 4096, 4096, HOPPER), "w4_dequant"),
    ({"fp8_small_m_per_tensor_min_k": 4096}, ("fp8", 2, 4096, 4096, HOPPER), "fp8_small_m"),
])
def test_override_changes_the_route(changes, args, kernel):
    """Benchmarks move a threshold with tuning.override; the route follows, and is back after the block."""
    before = routes.route("linear", *args)
    with tuning.override(**changes):
        assert routes.route("linear", *args) == kernel
    assert routes.route("linear", *args) == before != kernel


def test_tuning_tables():
    """Hopper's table for sm_90, the default (the same values) elsewhere and without a GPU; a table is frozen."""
    sm90, default = tuning.for_capability((9, 0)), tuning.for_capability(None)
    assert tuning.for_capability((8, 0)) is default and sm90 is not default
    assert vars(sm90) == vars(default)
    with pytest.raises(Exception):
        sm90.int8_gemv_max_m = 3
    with pytest.raises(TypeError):
        sm90.w4_mma_rows["int4"] = (1, 1)


def test_public_face():
    """The names the engine imports, `linear` the function even after its subpackage is imported."""
    import lowbit.kernels as k
    from lowbit.kernels.linear import w4a16  # noqa: F401
    from lowbit.kernels import linear
    assert callable(linear) and k.linear is linear and linear.__module__ == "lowbit.kernels.linear.qlinear"
    for name in k.__all__:
        assert getattr(k, name) is not None, name
