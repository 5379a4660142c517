"""`--load-format dummy` checkpoints (lowbit.testing.dummy_weights) for every format on a tiny Llama config on CPU: the
names a checkpoint lists are exactly the tensors its modules draw, with the dtypes and shapes of FORMATS.md, and the
same name draws the same tensor twice (seeded by name)."""

import torch

from lowbit.testing.dummy_weights import FORMATS, LLAMA_3_1_8B, dummy_checkpoint

TINY = dict(LLAMA_3_1_8B, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, vocab_size=256)  # K a multiple of the 4-bit formats' 128
WEIGHT_DTYPE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int4_awq": torch.uint8, "nvfp4": torch.uint8,
                "w8a8_sq": torch.int8, "int8_dynamic": torch.int8}


def test_every_format_lists_exactly_what_it_draws():
    for fmt in FORMATS:
        tensors = dummy_checkpoint(fmt, TINY, device="cpu").tensors()
        modules = {name.rsplit(".", 1)[0] for name in tensors}
        for module in modules:
            drawn = tensors.__class__(tensors.ckpt)._draw_module(module)
            listed = {name.rsplit(".", 1)[1] for name in tensors if name.rsplit(".", 1)[0] == module}
            assert set(drawn) == listed, (fmt, module, sorted(drawn), sorted(listed))
        q = tensors["model.layers.0.self_attn.q_proj.weight"]
        assert q.dtype == WEIGHT_DTYPE[fmt], (fmt, q.dtype)


def test_w8a8_sq_tensors():
    tensors = dummy_checkpoint("w8a8_sq", TINY, device="cpu").tensors()
    p = "model.layers.0.mlp.down_proj."
    w, ws, s, smooth = (tensors[p + n] for n in ("weight", "weight_scale", "input_scale", "pre_quant_scale"))
    assert w.shape == (128, 256) and w.dtype == torch.int8 and int(w.abs().max()) <= 127
    assert ws.shape == (128,) and ws.dtype == torch.float32 and s.numel() == 1 and smooth.shape == (256,)
    again = dummy_checkpoint("w8a8_sq", TINY, device="cpu").tensors()[p + "weight"]
    assert torch.equal(w, again)
