"""The interop phase of `lowbit bench serve`: the dummy int4 weights written in compressed-tensors, GPTQ and AutoAWQ
layouts exactly as those libraries pack them, read back by lowbit's readers to the same weights, and the tiny phase
on the CPU serving every layout to modelopt's greedy tokens."""
import json

import pytest
import torch

from lowbit import formats
from lowbit.testing.dummy_layouts import LAYOUTS, int4_codes, read_layout, to_layout
from interop_fixtures import awq_pack, ct_decompress, gptq_pack

M = "model.layers.0.mlp.down_proj"
GROUP = 32


def _codes(n=64, k=128):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    t = int4_codes(w, GROUP)
    u = formats.unpack_int4_rows(t["weight"]).to(torch.int64) + 8  # [out, in] in [0, 15]
    return t, u


def test_int4_codes_have_fp16_scales_and_round_to_nearest():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.02
    t = int4_codes(w, GROUP)
    assert torch.equal(t["weight_scale"], t["weight_scale"].half().float())
    err = (formats.W4A16_AWQ.dequantize(t) - w).abs()
    assert (err <= t["weight_scale"].repeat_interleave(GROUP, 1) / 2 + 1e-7).all()


def test_gptq_and_autoawq_tensors_are_packed_as_those_libraries_pack_them():
    t, u = _codes()
    groups, out = u.shape[1] // GROUP, u.shape[0]
    gptq = to_layout("gptq", M, t)
    qweight, qzeros = gptq_pack(u.t(), torch.full((groups, out), 8))  # v1: stores zero - 1
    assert torch.equal(gptq[f"{M}.qweight"], qweight) and torch.equal(gptq[f"{M}.qzeros"], qzeros)
    assert torch.equal(gptq[f"{M}.g_idx"].long(), torch.arange(u.shape[1]) // GROUP)
    awq = to_layout("autoawq", M, t)
    qweight, qzeros = awq_pack(u.t(), torch.full((groups, out), 8))
    assert torch.equal(awq[f"{M}.qweight"], qweight) and torch.equal(awq[f"{M}.qzeros"], qzeros)
    for disk in (gptq, awq):
        assert torch.equal(disk[f"{M}.scales"].float(), t["weight_scale"].t())


def test_compressed_tensors_tensors_decompress_in_the_library_to_the_same_weight():
    t, _ = _codes()
    qc = {"config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                                        "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                    "group_size": GROUP, "symmetric": True, "dynamic": False}}}}
    pytest.importorskip("compressed_tensors")
    theirs = ct_decompress(qc, to_layout("compressed-tensors", M, t), M)
    # fp16 scales on disk (as GPTQ / AutoAWQ store them): the library computes q * scale in fp16, the exact fp32
    # product rounded once
    assert theirs.dtype == torch.float16 and torch.equal(theirs, formats.W4A16_AWQ.dequantize(t).half())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_reads_back_to_the_same_weight(layout):
    t, _ = _codes()
    back = read_layout(layout, M, to_layout(layout, M, t))
    fmt = formats.W4A16_ZP if layout == "autoawq" else formats.W4A16_AWQ
    assert set(back) == set(fmt.tensors.required)
    assert torch.equal(fmt.dequantize(back), formats.W4A16_AWQ.dequantize(t))


def test_tiny_interop_phase_serves_every_layout_to_modelopts_tokens(tmp_path, capsys):
    from lowbit.bench import serve_bench

    out = tmp_path / "r.json"
    argv = ["--tiny", "--device", "cpu", "--phases", "interop", "--isl", "12", "--osl", "6", "--max-batch-size", "4",
            "--max-num-tokens", "128", "--json", str(out), "--markdown", str(tmp_path / "r.md")]
    assert serve_bench.main(argv) == 0
    res = json.loads(out.read_text())["interop"]
    assert [r["layout"] for r in res["rows"]] == list(LAYOUTS)
    for r in res["rows"]:  # the same linears, the same tokens; speed is judged on the GPU only
        assert r["same_tokens"] and r["kinds"] == res["rows"][0]["kinds"] and r["decode_tok_s"] > 0, r
    table = (tmp_path / "r.md").read_text()
    assert "| int4 layout (repacked at load) |" in table and "| autoawq |" in table
