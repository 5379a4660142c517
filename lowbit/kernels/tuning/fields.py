"""The Tuning table's fields: every tile, threshold and split target the kernels and their routes read."""
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple


class DecodeVariant(NamedTuple):
    """How paged_decode runs one launch."""
    block_n: int  # tokens per tile
    warps: int
    stages: int  # Triton software-pipelining stages (1: none)
    # one block-table id per cache block: tiles [block_n / block_size, block_size, D], 64-bit address math per block,
    # rows past the context clamped to its last token (no load masks), next tile's ids loaded during this tile's math;
    # an FP8 cache needs it (its V, stored transposed per block, is read block by block)
    blocks: bool = False
    maxnreg: int | None = None  # a register cap per thread (Triton's maxnreg), None: the compiler's choice


class PrefillTiles(NamedTuple):
    """How paged_prefill runs one launch."""
    block_t: int  # new tokens per program (rows = block_t * GP)
    block_n: int  # keys per tile
    warps: int
    stages: int
    blocks: bool = False  # K/V gathered block by block (as paged_attention's decode), else row by row
    dot_acc: bool = False  # P.V accumulates inside the dot (acc * alpha as its accumulator), V's scale once at the end
    heavy_first: bool = False  # grid (kv head, seq, tile) with the last token tiles (most keys) launched first


def frozen(mapping: dict) -> Mapping:
    """A read-only view of a table, so one Tuning cannot be changed in place (replace it: tuning.override)."""
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: routes cache per table
class Tuning:
    """One GPU architecture's values. Configs are tuples in the order the kernel's `config` argument takes them;
    "rows" are x rows (M); a weight kind ("int4", "nvfp4") or scale kind keys the per-kind tables."""

    # ---- FP8 / INT8 W8A8 routes (lowbit.kernels.routes, op "linear")
    int8_gemv_max_m: int  # INT8 rows up to this run int8_gemv (dp4a on CUDA cores)
    int8_small_m_max_m: int  # then up to this the small-M GEMM's int8 form (int8 wgmma)
    fp8_gemv_max_weights: int  # one FP8 row of a layer of at most N x K weights runs fp8_gemv
    fp8_small_m_max_m: Mapping  # scale kind ("per_tensor", "per_row", "per_token") -> largest M on fp8_small_m
    fp8_small_m_per_tensor_min_k: int  # per-tensor scales take fp8_small_m only from this K (else cuBLAS)
    per_tensor_then_scale_max_m: int  # per-row weight scales on cuBLAS: per-tensor GEMM then column scales up to here
    # ---- W8A8 kernels
    fp8_gemv_config: tuple  # (BLOCK_N, BLOCK_K, num_warps) of fp8_gemv
    int8_gemv_config: tuple  # (BLOCK_N, BLOCK_K bytes, num_warps) of int8_gemv at every M
    fp8_small_m_smem_bytes: int  # shared memory per block for fp8_small_m's pipelined weight and x tiles
    scaled_gemm_configs: tuple  # ((max M, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)), ...), first fit
    # ---- W4 (INT4, NVFP4) routes
    w4_mma_rows: Mapping  # weight kind -> (lowest, highest) M run on w4_mma ahead of the other kernels
    w4_gemv_max_m: int  # then M up to this on the CUDA-core GEMV
    w4_dequant_min_m: Mapping  # weight kind -> M from which the weight is dequantized and run through cuBLAS
    w4_small_m_min_weights: int  # INT4 layers of at least N x KP weights take w4_small_m at its rows
    # ---- W4 kernels
    w4_gemv_config: Mapping  # weight kind -> (BLOCK_N, BLOCK_K, num_warps) at M = 1
    w4_gemv_config_m2: Mapping  # the same at M = 2
    w4_mma_config: tuple  # (BLOCK_N, BLOCK_K, num_warps) of w4_mma
    w4_mma_wide_config: tuple  # w4_mma's config for rows 9-16 of layers with N >= w4_mma_wide_n
    w4_mma_wide_n: int
    w4_prefetch_scales: bool  # the tensor-core kernel loads the next K tile's INT4 row scales during this one
    w4_gemm_tuned: Mapping  # (kind, KP, N, M bucket) -> (BLOCK_M, BLOCK_N, split, num_warps, num_stages)
    # ---- dense (bf16 / fp16) GEMV and elementwise ops
    dense_gemv_step_bytes: int  # weight bytes per row and K step
    dense_gemv_warps: int
    dense_gemv_max_programs_at_4_rows: int  # 4 rows per program up to this many programs, else 8
    silu_config: tuple  # (BLOCK columns per program, num_warps) of silu_and_mul
    # ---- paged attention
    decode_variants: Mapping  # name -> DecodeVariant
    decode_full_grid: int  # batch x KV heads from which FP8 decode takes decode_variants["blk32w2s3"]
    decode_max_splits: int
    decode_target_programs: int  # context splits fill the GPU with about this many programs
    decode_long_context: tuple  # ((max batch, keys), ...): keys past which a batch takes the long-context splits
    decode_max_splits_long: int
    decode_target_programs_long: int
    decode_combine_rows: int  # partial rows the combine holds at once ([rows, D] fp32 over 4-8 warps)
    prefill_tiles: Mapping  # (FP8 cache, longest new sequence > 256 tokens) -> PrefillTiles

    # ---- fused MoE (lowbit.kernels.moe)
    moe_gemv_config: Mapping  # expert kind -> (BLOCK_N, BLOCK_K, num_warps, K splits) of the per-pair GEMV
    # routes op "moe": expert kind -> (token, expert) pairs up to which the per-pair GEMV runs, more the grouped GEMM
    moe_gemv_max_pairs: Mapping = field(
        default_factory=lambda: frozen({kind: 32 for kind in ("dense", "fp8", "int8", "int4", "nvfp4")}))
    # 16-bit and static-FP8 experts at a few pairs (lowbit.kernels.moe.decode): projection ("gate_up", "down") ->
    # (BLOCK_N, weight bytes per row and K step, num_warps); routes op "moe" takes it up to moe_decode_max_pairs
    moe_decode_config: Mapping = field(default_factory=lambda: frozen({"gate_up": (8, 2048, 4), "down": (16, 1024, 2)}))
    moe_decode_max_pairs: int = 64
    moe_router_topk_max_tokens: int = 1  # routes op "moe_router": the router's GEMV and top-k in one launch (0: off)
    # split decode merges its partials in its last split to arrive (no combine launch) up to this batch x KV heads
    decode_fused_combine_max_pairs: int = 1 << 16
