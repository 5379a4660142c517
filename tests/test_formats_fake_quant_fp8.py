"""The table-based FP8 fake quantization equals torch's own float8_e4m3fn round trip bit for bit."""
import torch


def _torch_round_trip(x, scale):
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def test_fake_quant_fp8_bitwise_equal_to_the_cast():
    from lowbit.formats.numerics import fake_quant_fp8, fake_quant_fp8_per_token

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 700, generator=g) * torch.logspace(-6, 4, 700)  # subnormal codes to saturation, both signs
    x[0, :3] = torch.tensor([0.0, -0.0, float("inf")])
    for scale in (torch.tensor(0.37), torch.rand(64, 1, generator=g) + 1e-3):
        before = x.clone()
        got = fake_quant_fp8(x, scale)
        assert torch.equal(got, _torch_round_trip(x, scale)) and torch.equal(x, before)  # x itself is never written
        assert torch.equal(fake_quant_fp8(x.bfloat16(), scale), _torch_round_trip(x.bfloat16(), scale))
    assert torch.equal(torch.signbit(fake_quant_fp8(x, torch.tensor(1.0))), torch.signbit(_torch_round_trip(x, 1.0)))
    keys = x.reshape(4, 16, 700).transpose(1, 2)  # a non-contiguous input (attention's keys are one)
    assert torch.equal(fake_quant_fp8(keys, torch.tensor(0.5)), _torch_round_trip(keys, torch.tensor(0.5)))
    finite = x[1:]  # row 0's inf makes its per-token scale inf (NaN out, in both)
    per_token = (finite.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    assert torch.equal(fake_quant_fp8_per_token(finite), _torch_round_trip(finite, per_token))
