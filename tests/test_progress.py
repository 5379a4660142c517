"""Calibration progress when stderr is a log file: a line per batch with decoder layers counted, AWQ's later
passes named, on a tiny random Llama (the hooks count real forward calls)."""
import re

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lowbit.calibrate.loop import BATCH_SIZE, forward_loop
from lowbit.progress import Progress


def test_calibration_progress_per_batch_and_layer(capsys):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    batches = [[i % 64 for i in range(j, j + 8)] for j in range(BATCH_SIZE * 2 + 1)]  # 3 batches: 4, 4, 1
    loop = forward_loop(batches, desc="calibrating tiny", later_passes="awq_lite pass")
    loop(model)
    loop(model)
    lines = capsys.readouterr().err.splitlines()
    first = [x for x in lines if x.startswith("[lowbit] calibrating tiny, batch")]
    second = [x for x in lines if x.startswith("[lowbit] calibrating tiny, awq_lite pass 2, batch")]
    # a line when each batch starts (its first layer done) and the last one; 3 layers x 3 batches = 9 steps
    assert [re.sub(r" \(.*", "", x) for x in first] == [
        "[lowbit] calibrating tiny, batch 1/3: 1/9 layers", "[lowbit] calibrating tiny, batch 2/3: 4/9 layers",
        "[lowbit] calibrating tiny, batch 3/3: 7/9 layers", "[lowbit] calibrating tiny, batch 3/3: 9/9 layers"]
    assert len(second) == 4 and second[-1].split(" (")[0].endswith("batch 3/3: 9/9 layers")
    assert not model.model.layers[0]._forward_hooks  # the counting hooks are gone


def test_progress_lines_are_throttled(capsys):
    with Progress(1000, "step", "items", every=3600) as bar:
        for _ in range(1000):
            bar.update()
    lines = capsys.readouterr().err.splitlines()
    assert [x.split(" (")[0] for x in lines] == ["[lowbit] step: 1/1000 items", "[lowbit] step: 1000/1000 items"]
