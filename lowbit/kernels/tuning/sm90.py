"""Hopper (sm_90: H100, H200): values measured on the H200 at Llama-3.1-8B shapes (per-token times: its four linears x
32 layers). The measurement scripts are in dev/bench/."""
from lowbit.kernels.tuning.fields import DecodeVariant, PrefillTiles, Tuning, frozen


def _w4_gemm_tuned() -> dict:
    """(kind, KP, N, M bucket) -> (BLOCK_M, BLOCK_N, split, num_warps, num_stages): the sweep winners of w4a16's
    tensor-core kernel for the Llama-3.1-8B linears (buckets: w4a16.m_bucket)."""
    rows = {
        ("int4", 4096, 4096): {1: (16, 64, 8, 4, 3), 16: (16, 64, 8, 4, 3), 32: (32, 64, 4, 4, 3),
                               64: (64, 64, 4, 4, 3), 128: (128, 64, 4, 4, 3), 256: (128, 64, 2, 4, 3),
                               4096: (128, 128, 1, 8, 3)},
        ("int4", 4096, 6144): {1: (16, 64, 4, 4, 3), 16: (16, 64, 4, 4, 3), 32: (32, 64, 4, 4, 3),
                               64: (64, 64, 4, 4, 3), 128: (128, 64, 4, 4, 3), 256: (128, 64, 2, 4, 3),
                               4096: (128, 128, 1, 8, 3)},
        ("int4", 4096, 28672): {1: (16, 128, 4, 8, 3), 16: (16, 64, 4, 4, 3), 32: (32, 64, 1, 4, 3),
                                64: (64, 64, 2, 4, 3), 128: (128, 64, 1, 4, 3), 256: (128, 64, 1, 4, 3),
                                4096: (128, 128, 1, 8, 3)},
        ("int4", 14336, 4096): {1: (16, 64, 8, 4, 3), 16: (16, 64, 8, 4, 3), 32: (32, 64, 8, 4, 3),
                                64: (64, 64, 4, 4, 3), 128: (128, 64, 4, 4, 3), 256: (128, 64, 2, 4, 3),
                                4096: (128, 128, 1, 8, 3)},
        ("nvfp4", 4096, 4096): {1: (16, 64, 8, 4, 3), 16: (16, 64, 4, 4, 3), 32: (32, 128, 4, 8, 3),
                                64: (64, 128, 4, 8, 3), 128: (128, 64, 4, 4, 3), 256: (128, 64, 2, 4, 3),
                                4096: (128, 128, 1, 8, 3)},
        ("nvfp4", 4096, 6144): {1: (16, 64, 8, 4, 3), 16: (16, 64, 4, 4, 3), 32: (32, 64, 4, 4, 3),
                                64: (64, 64, 4, 4, 3), 128: (128, 64, 4, 4, 3), 256: (128, 64, 2, 4, 3),
                                4096: (128, 128, 1, 8, 3)},
        ("nvfp4", 4096, 28672): {1: (16, 64, 4, 4, 3), 16: (16, 64, 2, 4, 3), 32: (32, 128, 1, 8, 3),
                                 64: (64, 256, 1, 8, 3), 128: (128, 128, 1, 8, 3), 256: (128, 128, 2, 8, 3),
                                 4096: (128, 128, 1, 8, 3)},
        ("nvfp4", 14336, 4096): {1: (16, 64, 16, 4, 3), 16: (16, 64, 8, 4, 3), 32: (32, 128, 8, 8, 3),
                                 64: (64, 128, 8, 8, 3), 128: (128, 64, 4, 4, 3), 256: (128, 64, 2, 4, 3),
                                 4096: (128, 128, 1, 8, 3)},
    }
    return {(kind, kp, n, bucket): config for (kind, kp, n), by_m in rows.items() for bucket, config in by_m.items()}


SM90 = Tuning(
    # INT8 (SmoothQuant), ms per token, int8_gemv / small-M int8 GEMM / Triton int8 GEMM: M = 1 1.99 / 2.14 / 7.80,
    # M = 2 2.14 / 2.19 / 7.60, M = 3 2.89 / 2.17 / 7.44, M = 8 4.30 / 2.17 / 7.06, M = 32 - / 2.29 / 5.18 (cuBLAS
    # bf16 3.8-4.1): the GEMV up to 2 rows, the small-M GEMM up to 32.
    int8_gemv_max_m=2,
    # fused MoE at Qwen3-30B-A3B shapes (top-8), us per layer, per-pair GEMV / grouped GEMM (dev/bench/moe_kernel.py):
    # bf16 16 tokens (128 pairs) 265 / 559, 64 (512) 688 / 710, 256 (2048) 2332 / 744; fp8 64 563 / 1094, 256
    # 2010 / 895; int4 16 375 / 633, 64 1281 / 801; nvfp4 8 476 / 743, 16 873 / 895, 64 3271 / 1143. int8 as fp8
    # (not measured).
    moe_gemv_max_pairs=frozen({"dense": 512, "fp8": 512, "int8": 512, "int4": 128, "nvfp4": 128}),
    # the per-pair GEMV's tiles: (BLOCK_N, BLOCK_K, warps, K splits) with the least time summed over 1, 2, 4 and 8
    # tokens (`python3 dev/bench/moe_gemv_sweep.py`; us at 1 token, new / old tiles: bf16 31 / 48,
    # fp8 23 / 33, int8 31 / 30 (faster from 4 tokens), int4 unchanged, nvfp4 57 / 71 (1.24-1.40x at 1-8 tokens));
    # INT4's BLOCK_K is cut to divide the group
    moe_gemv_config=frozen({"dense": (8, 256, 2, 1), "fp8": (16, 256, 4, 1), "int8": (64, 128, 4, 1),
                            "int4": (32, 128, 4, 1), "nvfp4": (16, 128, 2, 1)}),
    # The fused decode launches (moe.decode's two MoE launches, router_topk, the decode kernel's own split combine)
    # stay off until measured on an H200 (`bash dev/scripts/h200_wave2g.sh ...` switches them on in its copy).
    moe_decode_max_pairs=0,
    moe_router_topk_max_tokens=0,
    decode_fused_combine_max_pairs=0,
    int8_small_m_max_m=32,
    # One FP8 row: fp8_gemv is faster on qkv (4096->6144, 8.2 vs 9.9 us) and even on o; gate_up and down stay faster
    # on fp8_small_m / cuBLAS (33.8 vs 30.5 us, 21.8 vs 18.1).
    fp8_gemv_max_weights=4096 * 6144,
    # fp8_small_m against cuBLAS: faster with per-row weight scales up to M = 32 (qkv 9.1 vs 12.3 us at M = 1) and
    # per-token x scales (7.6 vs 14.6 us, 4096->4096); with per-tensor scales (merged layers, whose part scales are
    # deferred) only at long K: down 14336->4096 18.5-19.7 us vs cuBLAS 19.6-20.3 at M = 1..24, while cuBLAS wins
    # at K = 4096 (o 7.2-7.5 vs 10.6-11.6 us).
    fp8_small_m_max_m=frozen({"per_tensor": 24, "per_row": 32, "per_token": 32}),
    fp8_small_m_per_tensor_min_k=8192,
    # Per-row weight scales on cuBLAS: the per-tensor GEMM into fp32, then the column scales, beats cuBLAS's row-wise
    # kernel up to this M (qkv M = 1 12.8 vs 19.1 us, gate_up 33.9 vs 45.5).
    per_tensor_then_scale_max_m=32,
    fp8_gemv_config=(8, 1024, 2),
    # (4, 2048, 4) against (8, 2048, 4), ms per token: M = 1 2.05 / 2.12, M = 2 2.21 / 2.32, M = 8 4.32 / 4.48.
    int8_gemv_config=(4, 2048, 4),
    fp8_small_m_smem_bytes=220 * 1024,  # of Hopper's 227 KB per block
    # the Triton int8 / fp8 GEMM: more programs than 128x256 tiles give at 64 < M <= 512
    scaled_gemm_configs=((64, (64, 64, 128, 4, 4)), (512, (64, 128, 128, 4, 4)), (None, (128, 256, 128, 8, 3))),
    # w4_mma against the other routes, ms per token: INT4 at M = 2 / 4 / 8 2.11 / 2.19 / 2.47 against
    # 2.32 / 2.97 / 3.00, NVFP4 2.51 / 2.57 / 2.66 against 2.59 / 4.33 / 4.35; it loses at M = 1 to the GEMV and at
    # M = 16 to w4_small_m (INT4) and the tensor-core kernel (NVFP4 3.22 vs 3.61).
    w4_mma_rows=frozen({"int4": (2, 8), "nvfp4": (2, 8)}),
    # The GEMV at M = 2 (after w4_mma_rows): INT4 2.26 ms per token against w4_small_m's 2.88, NVFP4 2.51 against
    # the tensor-core kernel's 4.28.
    w4_gemv_max_m=2,
    # The tensor-core kernel against dequantize + cuBLAS, ms per token: INT4 9.23 vs 10.83 at M = 256, 14.90 vs
    # 12.83 at 384 (three 128-row tiles); NVFP4 7.50 vs 10.22 at 128, 14.09 vs 10.84 at 192 (two tiles).
    w4_dequant_min_m=frozen({"int4": 257, "nvfp4": 129}),
    # w4_small_m beats the tensor-core kernel on large INT4 layers at 2 <= M <= 16 (gate_up 1.43-1.50x cuBLAS bf16
    # against 1.16x, down 1.26-1.33x against 1.13-1.15x); smaller layers (qkv, o) are ~4 % slower on it, NVFP4
    # (0.55-0.61x) pays more for its per-plane block scales than the unpacking saves.
    w4_small_m_min_weights=32 * 2**20,
    # 8 rows per program for INT4; 4 for NVFP4 (per token 1.779 ms against 1.809 at 8). BLOCK_K 2048 divides every KP of
    # Llama-3.1-8B: no masked step.
    w4_gemv_config=frozen({"int4": (8, 2048, 2), "nvfp4": (4, 2048, 2)}),
    w4_gemv_config_m2=frozen({"int4": (8, 2048, 2), "nvfp4": (4, 2048, 2)}),
    w4_mma_config=(16, 2048, 4),
    # rows 9-16 of wide layers: NVFP4 M = 16, 4096 -> 28672 51.4 us against w4_mma_config's 62.0; the narrower
    # Llama-3.1-8B layers are 3-15 % faster on w4_mma_config
    w4_mma_wide_config=(32, 1024, 4),
    w4_mma_wide_n=16384,
    # INT4's row scales are plain loads used after the dot (Triton's pipeline copies only the dot's operands ahead):
    # prefetching them makes INT4 1-3 % faster at M = 16-64 (NVFP4's scales feed the operand: pipelined already)
    w4_prefetch_scales=True,
    w4_gemm_tuned=frozen(_w4_gemm_tuned()),
    # us per call, 4 rows per program up to 1024 programs (o 4096->4096 9.8, down 14336->4096 28.8), else 8 (qkv
    # 4096->6144 14.4, gate_up 4096->28672 57.7, lm_head 4096->128256 237.1); cuBLAS bf16 13.6 / 31.9 / 15.4 /
    # 56.5 / 238.9
    dense_gemv_step_bytes=2048,  # 1024 bf16 or 2048 FP8 elements per row and K step
    dense_gemv_warps=4,
    dense_gemv_max_programs_at_4_rows=1024,
    silu_config=(1024, 4),
    # Decode tiles, us per launch at Llama-8B heads, shuffled block tables, FP8 KV (batch x context 512x1500 /
    # 256x200 / 512x200 / 256x1024 / 64x4096): blk64w2s3 400.4 / 49.4 / 82.0 / 148.5 / 143.7 (3.95 TB/s at
    # 512x1500); blk32w2s3 (121 registers, 4 warps per scheduler) 393.3 / 45.1 / 74.7 / 144.4 / 163.1: 32-token
    # tiles win wherever FULL_GRID programs fill the card and lose at 64 x 4096. V stored transposed per block lets
    # Triton copy K and V tiles asynchronously straight into the MMA operand layout (no register transpose of V).
    decode_variants=frozen({
        "rows64": DecodeVariant(64, 4, 3),  # bf16 KV
        "blk128w2": DecodeVariant(128, 2, 1, blocks=True),  # FP8 KV, one stage (kept for comparison)
        "blk64w2s3": DecodeVariant(64, 2, 3, blocks=True),  # FP8 KV, fewer than decode_full_grid programs
        "blk32w2s3": DecodeVariant(32, 2, 3, blocks=True),  # FP8 KV, decode_full_grid programs or more
    }),
    decode_full_grid=2048,  # 256 sequences x 8 KV heads and up
    decode_max_splits=16,
    decode_target_programs=264,  # 2 per SM on the H200's 132 SMs
    # Past these keys a small batch takes more splits (~4 programs per SM). us per call at context 2048 / 3072 /
    # 4096 / 32768, short -> long splits: batch 1 7.6 / 9.0 / 10.1 / 48.2 -> 8.4 / 8.6 / 9.2 / 27.2, batch 8
    # 15.6 / 23.2 / 29.7 / 180.8 -> 13.6 / 18.9 / 25.9 / 140.4. Below ~3072 keys the idle programs and the wider
    # combine cost more than the extra splits gain at batch 1-3; larger batches gain earlier (batch 4-6 from 1536
    # keys, batch 8 from 1024, batch 16 from 512).
    decode_long_context=((3, 3072), (6, 1024), (None, 512)),
    decode_max_splits_long=64,
    decode_target_programs_long=512,
    decode_combine_rows=64,
    # By (FP8 cache, longest new sequence > 256 tokens), us per launch at Llama-8B heads (bf16 4x2048/2048,
    # 4x512/2048, 64x128/128 | fp8 the same): (16, 64, 4, 3) blocks 437 / 203 / 99 | 595 / 272 / 111;
    # (64, 64, 8, 3) dot_acc heavy_first 381 / 168 / 113 | 477 / 211 / 114. 256 rows (64 tokens x 4 heads) need
    # dot_acc (FP8 770 us without it); the block-wise gather wins only for bf16 KV and short prompts, and an FP8
    # cache (V transposed per block) must read block by block.
    prefill_tiles=frozen({
        (False, False): PrefillTiles(16, 64, 4, 3, blocks=True),
        (False, True): PrefillTiles(64, 64, 8, 3, dot_acc=True, heavy_first=True),
        (True, False): PrefillTiles(64, 64, 8, 3, blocks=True, dot_acc=True, heavy_first=True),
        (True, True): PrefillTiles(64, 64, 8, 3, blocks=True, dot_acc=True, heavy_first=True),
    }),
)
