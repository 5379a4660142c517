"""How NVFP4 rounds each linear's input in the float model (one held-out BoolQ sequence of 512 tokens): per layer and
input kind, the relative squared error of the input (tokens after the first) and of W x, the first (attention-sink)
token's, and the channel RMS max / median with the top channel.

    OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_act_error.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench.accuracy import heldout  # noqa: E402
from lowbit.calibrate.nvfp4_cpu import nvfp4_fake_quant  # noqa: E402
from lowbit.models import DEFAULT_MODEL, resolve  # noqa: E402
from lowbit.quantize.api import load_float_model  # noqa: E402


def readers(layer):
    return {"qkv": layer.self_attn.q_proj, "gate": layer.mlp.gate_proj, "o": layer.self_attn.o_proj,
            "down": layer.mlp.down_proj}


@torch.no_grad()
def main() -> int:
    torch.set_num_threads(1)
    model, tok = load_float_model(resolve(DEFAULT_MODEL))
    x = torch.tensor([heldout(tok, 1)[0][1]])
    seen = {}
    for i, layer in enumerate(model.model.layers):
        for kind, lin in readers(layer).items():
            lin.register_forward_pre_hook(lambda mod, args, k=(i, kind): seen.__setitem__(k, args[0][0]))
    model(x)
    for i, layer in enumerate(model.model.layers):
        row = []
        for kind, lin in readers(layer).items():
            a = seen[(i, kind)]
            q = nvfp4_fake_quant(a, a.abs().amax())  # input amax: this sequence's max, as max calibration sets it
            rel_x = (q - a).pow(2).sum(-1) / a.pow(2).sum(-1)
            y, yq = a @ lin.weight.T, q @ lin.weight.T
            rel_y = (yq - y).pow(2).sum(-1) / y.pow(2).sum(-1)
            rms = a.pow(2).mean(0).sqrt()
            row.append(f"{kind} x {rel_x[1:].mean():.4f} (sink {rel_x[0]:.3f}) Wx {rel_y[1:].mean():.4f} "
                       f"(sink {rel_y[0]:.3f}) rms max/median {rms.max() / rms.median():.0f} @{rms.argmax().item()}")
        print(i, " | ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
