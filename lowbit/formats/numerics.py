"""Shared numerics of the checkpoint formats, as pure torch: packing, e2m1 codes, NVFP4 blocks, fake quantization.

Every function here is a reference: exact unpacking, dequantization and fake quantization of activations.
Scales are dequantization multipliers (x ~= q * scale). Shapes are written [out, in] for weights.

Checked against real modelopt 0.47 CPU exports (tests/test_formats_export.py, tests/test_formats_nvfp4.py):
- NVFP4: codes, e4m3 block scales (1.0 for an all-zero block, clamped to [2^-9, 448]) and packing equal
  NVFP4QTensor.quantize bit for bit; a negative value that rounds to 0 keeps its sign (code 8). Dequantize as
  e2m1 * (block_scale * weight_scale_2), the fp32 product first: that is modelopt's order and gives its fake-quant
  weight exactly.
- int4 rows (W4A16_AWQ): uint8 [out/2, in], row 2j in the low nibble.
- int8 static activations use the full range [-128, 127] (modelopt's input quantizer is not narrow-range).
- FP8: export computes w / (amax/448), modelopt's fake quant w * (448/amax); on exact rounding ties (common on
  GGUF-derived weights) the two round to neighbouring codes, so a checkpoint and the fake-quant model it came from
  can differ by one code step on ~0.2 % of a layer's weights.
"""
import functools

import torch

FP8_MAX = 448.0
INT8_MAX = 127.0
INT4_MAX = 7.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])



# ---- int4, modelopt AWQ layout: uint8 [out/2, in], row 2j in the low nibble, row 2j+1 in the high nibble
def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """q: int8 [out, in] in [-8, 7] -> uint8 [out/2, in] (two's complement nibbles)."""
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[0::2] | (u[1::2] << 4)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out/2, in] -> int8 [out, in]."""
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    lo = torch.where(lo > 7, lo - 16, lo)
    hi = torch.where(hi > 7, hi - 16, hi)
    return torch.stack([lo, hi], dim=1).reshape(-1, packed.shape[1])


# ---- e2m1 (NVFP4) nibbles: uint8 [out, in/2], even element in the low nibble; nibble = sign<<3 | index
def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to the nearest e2m1 code (ties to the even index), uint8 in [0, 15]."""
    values = E2M1_VALUES.to(x.device)
    mag = x.abs().clamp(max=E2M1_MAX).float()
    dist = (mag.unsqueeze(-1) - values).abs()
    idx = dist.argmin(dim=-1)  # argmin returns the first (lower, even-mantissa) index on exact ties
    # Ties between index i and i+1 where i is odd must go to the even neighbour i+1.
    upper = (idx + 1).clamp(max=7)
    tie = (dist.gather(-1, upper.unsqueeze(-1)).squeeze(-1) == dist.gather(-1, idx.unsqueeze(-1)).squeeze(-1))
    idx = torch.where(tie & (idx % 2 == 1) & (upper != idx), upper, idx)
    sign = (x < 0).to(torch.uint8) << 3  # negative values that round to 0 keep the sign (code 8), as modelopt
    return sign | idx.to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    values = E2M1_VALUES.to(codes.device)
    mag = values[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] -> uint8 [..., n/2]."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> uint8 codes [..., n]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def nvfp4_block_scale(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales as modelopt's export writes them: amax_block / (6 * global_scale), 1.0 for an all-zero
    block, clamped to [2^-9, 448] (the smallest e4m3 subnormal; nothing underflows to 0 or overflows to NaN)."""
    scale = block_amax.float() / (E2M1_MAX * global_scale.float())
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(min=2.0**-9, max=FP8_MAX).to(torch.float8_e4m3fn)


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor):
    """Block-16 NVFP4 quantization of x [..., n] (n % 16 == 0) with a given fp32 global scale (amax/(6*448)).

    Returns (codes uint8 [..., n], block_scale float8_e4m3fn [..., n/16]), equal to modelopt's export.
    """
    blocks = x.float().reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    block_scale = nvfp4_block_scale(blocks.abs().amax(dim=-1), global_scale)
    scale = (block_scale.float() * global_scale.float()).unsqueeze(-1)  # fp32 product first, as modelopt does
    return e2m1_codes(blocks / scale).reshape(x.shape), block_scale


def nvfp4_dequantize(codes: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., n], block_scale [..., n/16] -> float32 [..., n] = e2m1 * (block_scale * global_scale)."""
    values = e2m1_decode(codes).reshape(*codes.shape[:-1], -1, NVFP4_BLOCK)
    scale = (block_scale.float() * global_scale.float()).unsqueeze(-1)
    return (values * scale).reshape(codes.shape)


def amax(t: torch.Tensor, dim=None) -> torch.Tensor:
    """|t|'s maximum (over `dim`, or all of t) in float32, floored at 1e-8 so a zero weight gets a finite scale."""
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim)
    return a.float().clamp(min=1e-8)


# ---- activations (fake quantization: quantize and dequantize again)
def quantize_int8_per_channel(w: torch.Tensor) -> dict:
    """w [out, in] -> {"weight": int8 [out, in] in [-127, 127], "weight_scale": fp32 [out] = amax(|row|) / 127}."""
    w = w.float()
    scale = amax(w, 1) / INT8_MAX
    return {"weight_scale": scale, "weight": (w / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)}


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    y = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).contiguous()  # a new float32 tensor: x is never written
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1).int()
    # the value of each code read from a table, into y: on CPU ~3x faster than torch's float8 -> float32 cast
    torch.index_select(_fp8_values(y.device), 0, codes, out=y.view(-1))
    return y.mul_(scale)


@functools.lru_cache(maxsize=None)
def _fp8_values(device: torch.device) -> torch.Tensor:
    """float32 [256]: the value of every float8_e4m3fn bit pattern."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def fake_quant_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return fake_quant_fp8(x, scale)


def fake_quant_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static int8 activations use the full range [-128, 127] (modelopt's input quantizer, TRT-LLM's s8 cast)."""
    return (x.float() / scale).round().clamp(-INT8_MAX - 1, INT8_MAX) * scale


def fake_quant_int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token int8 (lowbit.kernels act_quant): scale = amax(|row|) / 127, q in [-127, 127]."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=1e-12)
    return (x.float() / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale


def fake_quant_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Dynamic NVFP4 activation quantization (block scales from each block's amax, global scale from the
    checkpoint's input_scale). A block whose e4m3 scale underflows to 0 becomes 0, as in NVIDIA's kernels;
    modelopt's fake quant instead zeroes blocks whose scale * global_scale < 1e-5 (negligible difference)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    in_range = (blocks.abs().amax(dim=-1) / (E2M1_MAX * global_scale.float())).clamp(max=FP8_MAX)
    scale = (in_range.to(torch.float8_e4m3fn).float() * global_scale.float()).unsqueeze(-1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.where(scale > 0, e2m1_decode(e2m1_codes(blocks / safe)) * scale, torch.zeros_like(blocks))
    return y.reshape(x.shape)
