"""Max calibration of one float decoder layer: each linear's input amax, which linears share an input, and the
attention's k/v amax by attention module (keys after rotary, as the cache stores them), recorded while the layer runs unquantized."""
from contextlib import contextmanager

import torch
from torch import nn

from lowbit.calibrate.nvfp4_clip import add_column_squares

KV_ATTENTION = "lowbit_kv_amax"  # transformers attention implementation: sdpa, recording k/v amax on the way


class LayerAmax:
    """Running amax (fp32 scalars) by module name, relative to the layer: `inputs` per linear, `k`/`v` per attention
    module; `shared[name]` is the name of the first linear that saw the same input tensor (q/k/v, gate/up);
    `squares[name]` [in] the sum over tokens of each input column's square (NVFP4's weight scale search)."""

    def __init__(self):
        self.inputs: dict[str, torch.Tensor] = {}
        self.squares: dict[str, torch.Tensor] = {}
        self.shared: dict[str, str] = {}
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}


def _running_max(store: dict, name: str, x: torch.Tensor) -> None:
    a = x.detach().abs().amax().float()
    store[name] = a if name not in store else torch.maximum(store[name], a)


def _kv_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    stats, name = module._lowbit_amax
    _running_max(stats.k, name, key)
    _running_max(stats.v, name, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextmanager
def record(layer: nn.Module, config, kv: bool, squares: bool = False):
    """Yields a LayerAmax that fills while `layer` runs; kv: record k/v amax too (the layer's attention runs
    through sdpa with a recording step, by switching `config`'s attention implementation while inside); squares:
    each linear's input column squares too (only the NVFP4 `output` search reads them)."""
    stats = LayerAmax()
    seen: list[tuple[torch.Tensor, str]] = []  # (input, first linear that saw it) within one forward of the layer

    def hook(name):
        def pre(_, args):
            x = args[0]
            _running_max(stats.inputs, name, x)
            if squares:
                add_column_squares(stats.squares, name, x)
            lead = next((n for t, n in seen if t is x), None)
            if lead is None:
                seen.append((x, name))
            stats.shared.setdefault(name, lead or name)
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
    handles.append(layer.register_forward_hook(lambda *_: seen.clear()))
    saved = config._attn_implementation
    mods = dict(layer.named_modules()) if kv else {}  # the attention function finds its module's name here
    try:
        if kv:
            from transformers import AttentionInterface

            AttentionInterface.register(KV_ATTENTION, _kv_attention)
            config._attn_implementation = KV_ATTENTION
            for name, m in mods.items():
                m._lowbit_amax = (stats, name)
        yield stats
    finally:
        for h in handles:
            h.remove()
        for m in mods.values():
            del m._lowbit_amax
        config._attn_implementation = saved
