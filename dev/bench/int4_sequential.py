"""Sequential AWQ clip search for dev/bench/int4_levers.py: layer L's clips searched on the inputs that the
already clipped and quantized layers < L produce (awq_clip.py searches every layer on the float model's inputs)."""
import torch

from lowbit.calibrate.awq_clip import _GroupClip, clip_ratios
from lowbit.calibrate.loop import BATCH_SIZE


class _Stop(Exception):
    pass


def layer0_inputs(model, batches):
    """[(hidden [b, s, d], kwargs)] entering decoder layer 0, one per chunk of BATCH_SIZE sequences."""
    body = getattr(model, model.base_model_prefix)
    calls = []

    def grab(_mod, args, kwargs):
        calls.append((args[0], kwargs))
        raise _Stop

    hook = body.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for i in range(0, len(batches), BATCH_SIZE):
            try:
                body(torch.tensor(batches[i:i + BATCH_SIZE]), use_cache=False)
            except _Stop:
                pass
    finally:
        hook.remove()
    return calls


def _out(o):
    return o[0] if isinstance(o, tuple) else o


@torch.no_grad()
def sequential_clip_search(model, batches, max_tokens_per_batch: int = 64, min_clip_ratio: float = 0.5,
                           shrink_step: float = 0.05) -> None:
    from modelopt.torch.quantization.utils import is_quantized_linear

    ratios = clip_ratios(min_clip_ratio, shrink_step)
    calls = layer0_inputs(model, batches)
    for layer in getattr(model, model.base_model_prefix).layers:
        linears = [m for m in layer.modules() if is_quantized_linear(m) and m.weight_quantizer.is_enabled
                   and m.weight_quantizer.block_sizes is not None]
        searches = {id(m): _GroupClip(m, ratios) for m in linears}  # weight quantizers off: float weights
        hooks = [m.register_forward_pre_hook(lambda mod, args: searches[id(mod)].add(
            mod.input_quantizer(args[0]), max_tokens_per_batch)) for m in linears]
        try:
            for h, kw in calls:
                layer(h, **kw)
        finally:
            for hk in hooks:
                hk.remove()
        for m in linears:
            m.weight_quantizer.amax = searches[id(m)].best_amax(m)
            m.weight_quantizer.enable()
        calls = [(_out(layer(h, **kw)), kw) for h, kw in calls]  # the quantized layer's outputs feed the next
