"""NVFP4 experts (weight-only) of tiny Qwen3-MoE and Mixtral checkpoints, quantized by the format's own quantize in
modelopt's per-expert layout (the rest 16-bit; gate's and up's weight_scale_2 differ): the engine against the
reference reader, and the loader's refusal of malformed expert tensors."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit import formats
from lowbit.serve import LLM
from test_serve_engine import check_against_reference
from test_serve_moe_quant import EXPERTS, experts_checkpoint

torch.set_num_threads(1)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_nvfp4_engine_matches_reader(family, tmp_path):
    path = experts_checkpoint(tmp_path / family, family, formats.W4A16_NVFP4)
    llm = check_against_reference(path, max_num_tokens=16)
    layer = llm.engine.runner.model.model.layers[0]
    experts = getattr(layer, layer.mlp_name).experts
    assert experts.w13.dtype == torch.uint8 and experts.w13.shape == (EXPERTS, 2 * 32, 64 // 2)
    assert experts.nvfp4.w13_block.shape == (EXPERTS, 2 * 32, 64 // 16)
    assert experts.nvfp4.w13_global[0].unique().numel() == 2  # gate's and up's own weight_scale_2


def test_malformed_block_scales_are_refused(tmp_path):
    path = experts_checkpoint(tmp_path / "bad", "qwen3_moe", formats.W4A16_NVFP4)
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    name = "model.layers.0.mlp.experts.2.up_proj.weight_scale"
    tensors[name] = tensors[name][:, :2].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.2: NVFP4 up tensors"):
        LLM(str(path), num_kv_blocks=16)
