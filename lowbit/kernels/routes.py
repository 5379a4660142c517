"""Which kernel runs a linear layer: one ordered table, read top to bottom; the first row that applies wins.

A row is (weight kinds, predicate on the case and the Tuning in force, kernel). Weight kinds are the kernels' own:
"dense" (bf16 / fp16), "fp8" and "int8" (W8A8: x quantized to the weight's type first), "int4" and "nvfp4"
(weight-only, 16-bit x). A case is the GEMM's shape (M x rows, N out, K in), the GPU architecture (CUDA capability,
None when no GPU runs the kernels: the CPU, Triton's interpreter), and per kind:
- scale (fp8 / int8): "per_tensor" (one x scale, one weight scale), "per_row" (one x scale, one per weight row),
  "per_token" (one x scale per row, M > 1), as lowbit.kernels.linear.w8a8.scale_kind reads the scale tensors;
- group (int4): the quantization group along K; x16: x is bf16 / fp16 (dense: and the weight has x's dtype).
Op "moe" (lowbit.kernels.moe.fused_moe) picks how a MoE layer's experts run: the case's kind is the experts'
("dense", "fp8", "int8", "int4", "nvfp4"), m the number of (token, expert) pairs (tokens x top_k), n and k the gate/up
projection's (2 x intermediate, hidden), scale "per_token" for FP8 experts without static input scales; its kernels run
both projections. Op "moe_router": the router's linear and top-k (kind "dense", m tokens, n experts, k hidden).
Routes are decided from these numbers alone (no GPU needed). The int4 / nvfp4 rows are asked only where the
kernels run (w4a16.w4a16_gemm runs the reference otherwise), so they do not test arch.
"""
import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

from lowbit.kernels import tuning as _tuning
from lowbit.kernels.tuning import Tuning

W4_PACK_K = 128  # w4a16.PACK_K: a W4 weight's K is padded to a multiple of it (KP)
INT8_GEMV_ROWS = 8  # int8_gemv.MAX_M: one int32 accumulator per x row
W4_MMA_ROWS = 16  # w4_mma.MAX_M: two tiles of the mma's N = 8
W4_SMALL_M_ROWS = 16  # w4_small_m.SMALL_M_MAX: one MMA N tile
ZP_ADD_ROWS = 16  # w4_zero_point's in-place launch re-reads the zero scales once per row: a few rows only
HOPPER = (9, 0)  # wgmma (fp8_small_m, int8_small_m, fp8_gemv as measured)
FP8_MMA = (8, 9)  # cuBLAS fp8 (torch._scaled_mm)


@dataclass(frozen=True)
class Case:
    """One linear call as the routes see it (the module docstring says what each field means)."""
    kind: str
    m: int
    n: int
    k: int
    arch: tuple[int, int] | None
    scale: str = "per_tensor"
    group: int = 128
    x16: bool = True

    def on(self, capability: tuple[int, int]) -> bool:
        """A GPU runs the kernels, of this capability or later."""
        return self.arch is not None and tuple(self.arch) >= capability

    @property
    def kp(self) -> int:
        return -(-self.k // W4_PACK_K) * W4_PACK_K


class Row(NamedTuple):
    kinds: tuple[str, ...]
    applies: Callable[[Case, Tuning], bool]
    kernel: str


def _scaled_mm_fits(c: Case) -> bool:
    """torch._scaled_mm needs an fp8-capable GPU (sm_89+) and K, N multiples of 16."""
    return c.on(FP8_MMA) and c.k % 16 == 0 and c.n % 16 == 0


def _fp8_small_m(c: Case, t: Tuning) -> bool:
    """Up to a per-scale-kind M; per-tensor scales only at long K (or where cuBLAS cannot run)."""
    return (c.on(HOPPER) and c.m <= t.fp8_small_m_max_m[c.scale]
            and (c.scale != "per_tensor" or c.k >= t.fp8_small_m_per_tensor_min_k or not _scaled_mm_fits(c)))


def _w4_mma(c: Case, t: Tuning) -> bool:
    """M within w4_mma_rows for the kind, 16-bit x, and weights w4_mma takes (NVFP4, INT4 groups of 128k)."""
    lowest, highest = t.w4_mma_rows.get(c.kind, (0, 0))
    return (lowest <= c.m <= highest and 1 <= c.m <= W4_MMA_ROWS and c.x16
            and (c.kind == "nvfp4" or c.group % 128 == 0))


W8A8 = ("fp8", "int8")
W4 = ("int4", "nvfp4")
LINEAR = (
    # decode rows on CUDA cores
    Row(("int8",), lambda c, t: c.on((0, 0)) and c.m <= min(t.int8_gemv_max_m, INT8_GEMV_ROWS) and c.k % 4 == 0,
        "int8_gemv"),
    Row(("fp8",), lambda c, t: (c.on(HOPPER) and c.m == 1 and c.scale != "per_token"
                                and c.n * c.k <= t.fp8_gemv_max_weights), "fp8_gemv"),
    # small M on Hopper's tensor cores (swap-AB wgmma, split K finished in the same launch)
    Row(("int8",), lambda c, t: c.on(HOPPER) and c.m <= t.int8_small_m_max_m, "int8_small_m"),
    Row(("fp8",), _fp8_small_m, "fp8_small_m"),
    # cuBLAS fp8: per-tensor scales; per-row weight scales at small M as a per-tensor GEMM then the column scales;
    # else its row-wise kernel
    Row(("fp8",), lambda c, t: _scaled_mm_fits(c) and c.scale == "per_tensor", "scaled_mm"),
    Row(("fp8",), lambda c, t: _scaled_mm_fits(c) and c.scale == "per_row" and c.m <= t.per_tensor_then_scale_max_m,
        "scaled_mm_then_scale"),
    Row(("fp8",), lambda c, t: _scaled_mm_fits(c), "scaled_mm_rowwise"),
    Row(W8A8, lambda c, t: True, "scaled_gemm"),  # Triton GEMM with a dequantizing epilogue
    # weight-only 4-bit
    Row(W4, _w4_mma, "w4_mma"),
    Row(W4, lambda c, t: c.m <= t.w4_gemv_max_m, "w4_gemv"),
    Row(W4, lambda c, t: c.m >= t.w4_dequant_min_m[c.kind], "w4_dequant"),  # dequantize, then cuBLAS
    Row(W4, lambda c, t: (c.kind == "int4" and 2 <= c.m <= W4_SMALL_M_ROWS
                          and c.n * c.kp >= t.w4_small_m_min_weights), "w4_small_m"),
    Row(W4, lambda c, t: True, "w4_tensor_core"),  # w4a16's dequantize-in-the-loop tensor-core kernel
    # 16-bit weights
    Row(("dense",), lambda c, t: c.on((0, 0)) and c.m == 1 and c.x16, "dense_gemv"),
    Row(("dense",), lambda c, t: True, "cublas"),
)
# how an int4 layer's zero points join its W4 kernel (lowbit.kernels.linear.w4_zero_point)
ZERO_POINT = (
    # the GEMV and w4_mma subtract them from the codes themselves, wherever LINEAR gives them the case
    Row(("int4",), lambda c, t: _first_row(t, "linear", c, None) == "w4_gemv", "zp_gemv"),
    Row(("int4",), lambda c, t: _first_row(t, "linear", c, None) == "w4_mma", "zp_mma"),
    Row(("int4",), lambda c, t: c.m == 1, "zp_bias"),  # folded into the W4 kernel's fp32 bias
    Row(("int4",), lambda c, t: c.m <= ZP_ADD_ROWS, "zp_add"),  # one Triton launch, in place
    Row(("int4",), lambda c, t: True, "zp_addmm"),  # torch group sums + fp32 addmm
)
MOE_KINDS = ("dense", "fp8", "int8", "int4", "nvfp4")
# how a MoE layer's experts run (lowbit.kernels.moe): a few pairs (decode) one program per pair and N tile, reading
# the weight rows of its expert with no row padding; more, the pairs sorted by expert into row blocks of grouped GEMMs
MOE = (
    # 16-bit and static-FP8 experts: gate/up with SiLU, then down with the combine (two launches, moe.decode)
    Row(("dense", "fp8"), lambda c, t: (c.on((0, 0)) and c.scale == "per_tensor" and c.m <= t.moe_decode_max_pairs
                                        and c.x16), "moe_decode"),
    Row(MOE_KINDS, lambda c, t: c.m <= t.moe_gemv_max_pairs[c.kind], "moe_gemv"),
    Row(MOE_KINDS, lambda c, t: True, "moe_grouped"),
)
# how a MoE router (16-bit weight [E, H], no bias) picks each token's experts (lowbit.kernels.moe.route): at one
# token its GEMV and the top-k in one launch, else the linear then the top-k kernel
MOE_ROUTER = (
    Row(("dense",), lambda c, t: c.on((0, 0)) and c.m == 1 <= t.moe_router_topk_max_tokens and c.x16, "router_topk"),
    Row(("dense",), lambda c, t: True, "linear_then_route"),
)
TABLES = {"linear": LINEAR, "zero_point": ZERO_POINT, "moe": MOE, "moe_router": MOE_ROUTER}

# the kernels each family's tensor-core entry point may take (w8a8.tensor_core_linear, w4a16.tensor_core_gemm)
W8A8_TENSOR_CORE = ("int8_small_m", "fp8_small_m", "scaled_mm", "scaled_mm_then_scale", "scaled_mm_rowwise",
                    "scaled_gemm")
W4_TENSOR_CORE = ("w4_small_m", "w4_tensor_core")


def route(op: str, kind: str, m: int, n: int, k: int, arch: tuple[int, int] | None, *, scale: str = "per_tensor",
          group: int = 128, x16: bool = True, only: tuple[str, ...] | None = None,
          table: Tuning | None = None) -> str:
    """The kernel of the first row of TABLES[op] for `kind` that applies (among `only`, when given), with the Tuning
    `table` (default: tuning.current()). Cached: layers call it at every step."""
    arch = None if arch is None else tuple(arch)
    return _first_row(table or _tuning.current(), op, Case(kind, m, n, k, arch, scale, group, x16), only)


@functools.lru_cache(maxsize=65536)
def _first_row(t: Tuning, op: str, case: Case, only: tuple[str, ...] | None) -> str:
    kind = case.kind
    for row in TABLES[op]:
        if kind in row.kinds and (only is None or row.kernel in only) and row.applies(case, t):
            return row.kernel
    raise ValueError(f"no {op} route for {case}")
