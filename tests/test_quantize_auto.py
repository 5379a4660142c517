"""`quantize --recipe auto`: the gate decides; a mix passes where no single format can; nothing passing exits 1."""
import json

import pytest
import torch

from tests import interop_fixtures


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny Llama (embedded tokenizer's vocabulary) whose layer-1 down_proj has an outlier in every block of 16
    inputs: 4-bit formats (a scale per group or block) lose the small weights there, 8-bit ones keep them."""
    out = tmp_path_factory.mktemp("tiny")
    small = dict(interop_fixtures.SMALL)
    interop_fixtures.SMALL["vocab_size"] = 49152
    try:
        model = interop_fixtures.tiny_llama(seed=1)
    finally:
        interop_fixtures.SMALL.update(small)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[:, ::16] *= 40
    model.save_pretrained(out)
    interop_fixtures.copy_tokenizer(out)
    return out


def run_auto(tiny_model, tmp_path, monkeypatch, gate, max_bits, trials=6):
    from lowbit.cli import main

    monkeypatch.setenv("LOWBIT_HOME", str(tmp_path / "home"))
    out, report = tmp_path / "auto", tmp_path / "auto.json"
    code = main(["quantize", str(tiny_model), "--recipe", "auto", "--gate", gate, "--max-bits", str(max_bits),
                 "--confidence", "0", "--trials", str(trials), "--num-samples", "2", "--seq-len", "64", "-o", str(out),
                 "--report", str(report)])
    return code, out, json.loads(report.read_text())


def test_only_a_mix_passes(tiny_model, tmp_path, monkeypatch, capsys):
    """7 bits/weight leave out every 8-bit format on all layers; 4 bits everywhere fails kl<=0.04 (measured ~0.19)."""
    code, out, report = run_auto(tiny_model, tmp_path, monkeypatch, "kl<=0.04", 7)
    print(json.dumps([(t["bits"], t["counts"], t["summary"]) for t in report["trials"]], default=str))
    assert code == 0 and report["passed"]
    first, chosen = report["trials"][0], report["chosen"]
    assert len(first["counts"]) == 1 and not first["passed"]  # every unit in the smallest format fails
    assert len(chosen["counts"]) > 1 and chosen["bits"] <= 7  # a mix of formats passes within the budget
    assert all(t["bits"] <= 7 for t in report["trials"])
    assert chosen["summary"]["kl"][0] <= 0.04
    assert "gate PASSED" in capsys.readouterr().out
    from lowbit.checkpoint import read
    from lowbit.formats.layers import MIXED_PRECISION

    ckpt = read(out)
    assert ckpt.quant_algo == MIXED_PRECISION
    algos = {ckpt.layer_algo(n) for n in chosen["layers"] for n in n.split(",")}
    assert len(algos) > 1  # the checkpoint holds the mix the report names
    from tests.test_serve_engine import check_against_reference

    check_against_reference(out, max_num_tokens=16)  # the engine serves each layer on its kernel, as the reader reads it


def test_nothing_passes_exits_1_with_the_best_reported(tiny_model, tmp_path, monkeypatch, capsys):
    code, out, report = run_auto(tiny_model, tmp_path, monkeypatch, "kl<=0.000001", 7, trials=2)
    assert code == 1 and not report["passed"] and len(report["trials"]) == 2
    assert not any(t["passed"] for t in report["trials"])
    assert report["chosen"] == report["trials"][-1] | {"checkpoint": str(out)}  # the largest, most accurate mix
    assert out.is_dir() and "gate FAILED" in capsys.readouterr().out


def test_auto_needs_a_gate(capsys):
    from lowbit.cli import main

    assert main(["quantize", "--recipe", "auto"]) == 2
    assert "needs --gate" in capsys.readouterr().err


def test_auto_nvfp4_units_search_their_block_scales_as_the_recipe_does():
    """--recipe auto's nvfp4 choice carries the recipe's weight_scale_search: the unit's tensors keep weight_scale_2
    (the unit's shared amax) and round with a smaller E[x^2]-weighted error than max block scales."""
    from torch import nn

    from lowbit.calibrate import sensitivity as sens
    from lowbit.quantize.auto import CANDIDATES, candidate_choices

    choices = candidate_choices(CANDIDATES)
    assert choices["nvfp4"].weight_scale_search == "output" and choices["fp8"].weight_scale_search is None
    g = torch.Generator().manual_seed(3)
    model = nn.ModuleDict({"q_proj": nn.Linear(64, 48, bias=False), "k_proj": nn.Linear(64, 16, bias=False)})
    with torch.no_grad():
        for m in model.values():
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * torch.logspace(-1, 0.5, 64))
    x = torch.randn(256, 64, generator=g) * torch.linspace(0.2, 3.0, 64)
    stats = sens.InputStats({n: float(x.abs().max()) for n in model}, {n: x.pow(2).sum(0) for n in model})
    fmt = choices["nvfp4"].fmt
    searched = sens.quantize_unit(model, ("q_proj", "k_proj"), choices["nvfp4"], stats)
    plain = sens.quantize_unit(model, ("q_proj", "k_proj"), sens.Choice("nvfp4", fmt, 16), stats)
    for name, m in model.items():
        assert torch.equal(searched[name]["weight_scale_2"], plain[name]["weight_scale_2"])
        err = {k: (((fmt.dequantize(t[name]).float() - m.weight) ** 2) * stats.squares[name]).sum().item()
               for k, t in (("searched", searched), ("plain", plain))}
        assert err["searched"] < 0.95 * err["plain"], err
