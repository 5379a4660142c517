"""Experiment (not shipped: no gain on the embedded model, docs/accuracy.md).

NVFP4 weights corrected for the inputs the quantized model feeds them (sequential, layer by layer), then block-scale
searched: each linear's float weight W becomes the least-squares W' that maps the quantized model's NVFP4 inputs X~
onto the float model's outputs X W^T, ridge-damped toward W:

  W'^T = (X~^T X~ + lam I)^-1 (X~^T X W^T + lam W^T),   lam = damp * mean(diag(X~^T X~))

X [tokens, in] the linear's input in the float model, X~ the same input in the fake-quant model after its input
quantizer, with every earlier linear already corrected and searched. W' absorbs, in the mean-square sense, the error
the earlier layers and the input's own NVFP4 rounding leave; the per-tensor amax (weight_scale_2) becomes max |W'|
shared across linears that read one input, then nvfp4_clip.search_clamp picks the block scales with E[x~^2].
Same tensors, names and shapes in the checkpoint.
"""
import torch
from torch import nn

from lowbit.calibrate.nvfp4_clip import search_clamp
from lowbit.errors import UserError


class _Stop(Exception):
    pass


def _groups(layer) -> list[list[nn.Linear]]:
    a, m = layer.self_attn, layer.mlp
    return [[a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]]


def _first_layer_inputs(body, tokens: torch.Tensor):
    """(hidden [n, seq, d], kwargs) that body.layers[0] receives for `tokens`."""
    got = {}

    def grab(mod, args, kwargs):
        got["h"], got["kw"] = (args[0] if args else kwargs.pop("hidden_states")), kwargs
        raise _Stop

    h = body.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        body(tokens, use_cache=False)
    except _Stop:
        pass
    finally:
        h.remove()
    return got["h"], {k: v for k, v in got["kw"].items() if k != "hidden_states"}


def _run(layer, h, kw):
    out = layer(h, **kw)
    return out[0] if isinstance(out, tuple) else out


def _capture(layer, h, kw, modules: list[nn.Module], post: bool) -> list[torch.Tensor]:
    """Inputs of `modules` (post: their outputs: input quantizers) as [tokens, in] when layer runs on h."""
    got = {}

    def keep(i, t):
        got[i] = t.detach().reshape(-1, t.shape[-1]).double()

    hooks = [m.register_forward_hook(lambda m, args, out, i=i: keep(i, out)) if post else
             m.register_forward_pre_hook(lambda m, args, i=i: keep(i, args[0])) for i, m in enumerate(modules)]
    try:
        _run(layer, h, kw)
    finally:
        for hook in hooks:
            hook.remove()
    return [got[i] for i in range(len(modules))]


@torch.no_grad()
def correct_group(linears: list[nn.Linear], x: torch.Tensor, xq: torch.Tensor, damp: float, diag: bool = False) -> None:
    """linears reading one input: W <- ridge least squares onto x's outputs from xq (diag: one gain per input
    channel, c_j = E[x_j xq_j] / (E[xq_j^2] + lam)), shared amax, block search."""
    if diag:
        d = xq.pow(2).sum(0)
        c = (x * xq).sum(0) / (d + damp * d.mean())
        news = [lin.weight.double() * c[None, :] for lin in linears]
        return _set(linears, news, xq)
    h = xq.T @ xq
    lam = damp * h.diagonal().mean()
    h.diagonal().add_(lam)
    c = xq.T @ x
    chol = torch.linalg.cholesky(h)
    news = []
    for lin in linears:
        w = lin.weight.double()
        news.append(torch.cholesky_solve(c @ w.T + lam * w.T, chol).T)
    _set(linears, news, xq)


def _set(linears, news, xq) -> None:
    amax = torch.stack([n.abs().amax() for n in news]).amax().float()
    sq = xq.pow(2).sum(0).float()
    for lin, new in zip(linears, news):
        old = lin.weight_quantizer.amax
        lin.weight_quantizer.amax = amax.reshape(old.shape).to(old.device, old.dtype)
        lin.weight.copy_(search_clamp(new.to(lin.weight.dtype), amax, sq))


@torch.no_grad()
def nvfp4_asym_correct(model: nn.Module, float_model: nn.Module, batches: list[list[int]], damp: float,
                       diag: bool = False, drift_only: bool = False) -> None:
    """Sequentially corrects and block-searches every NVFP4 linear of model (max-calibrated fake-quant) against
    float_model (the same weights, unquantized)."""
    if model.config.model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        raise UserError(f"NVFP4 input correction: model type {model.config.model_type!r} is not supported")
    tokens = torch.tensor(batches)
    hf, kw = _first_layer_inputs(float_model.model, tokens)
    hq = hf.clone()
    for lf, lq in zip(float_model.model.layers, model.model.layers):
        xs = _capture(lf, hf, kw, [g[0] for g in _groups(lf)], post=False)
        for x, gq in zip(xs, _groups(lq)):
            # drift_only: the regressor is the input before its NVFP4 rounding (earlier layers' drift only)
            xq, = _capture(lq, hq, kw, [gq[0].input_quantizer], post=not drift_only)
            correct_group(gq, x, xq, damp, diag)
        hf, hq = _run(lf, hf, kw), _run(lq, hq, kw)
