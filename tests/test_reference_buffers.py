"""The reference reader builds models on the meta device: computed non-persistent buffers that no checkpoint holds
(Gemma's embed_scale, rotary tables) are recreated as the model's own code makes them."""
import json
import math

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from lowbit import formats
from lowbit.checkpoint.reference import load_reference_model
from tests.test_serve_gemma import save_tiny


def test_reader_recreates_gemma_embed_scale(tmp_path):
    """A Gemma 3 checkpoint with a quant config that leaves every layer in float takes the reader's meta-device path;
    its logits must equal transformers' own model of the same files."""
    save_tiny("gemma3", tmp_path)
    quant = {"quant_algo": formats.FP8.name, "kv_cache_quant_algo": None, "exclude_modules": ["*"]}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "test"}, "quantization": quant}))
    model, _ = load_reference_model(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    embed = model.model.embed_tokens
    assert embed.embed_scale.device.type == "cpu" and embed.embed_scale.item() == math.sqrt(64)
    ids = torch.tensor([[5, 9, 300, 17, 2, 900, 41, 41, 8, 77, 600, 3, 12, 99, 1000]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, hf(ids).logits)
