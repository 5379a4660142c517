"""Rotation pass: RMSNorm weights folded into the next linears, then an orthogonal rotation of the residual stream
(and optionally of each attention head's values) folded into the weights; the float function is unchanged.

Row-vector convention: a residual h (1 x d) becomes h Q with Q orthogonal (d x d). A linear reading the residual,
y = h W^T, keeps y with W' = W Q; a linear writing it, out = z W^T (+ b), gives out Q with W' = Q^T W (b' = b Q);
the embedding's rows become E Q. RMSNorm commutes with Q once its weight is ones (rms(hQ) = rms(h)), so norm weights
are folded into the reading linears first (W' = W diag(g)); the final norm folds into lm_head, which then unties
from the embedding (the checkpoint gains an lm_head tensor, tie_word_embeddings false). No online transform: the
model keeps its architecture, tensor names and shapes, so any engine serves the result.

Q = diag(s) (H_{2^k} kron O_m) for d = 2^k m (m odd): H a normalized Walsh-Hadamard matrix, O_m a seeded random
orthogonal matrix (QR of a Gaussian; no Hadamard matrix of odd order > 1 exists), s seeded random signs. For
SmolLM2's 576 = 64 x 9 that is a 64-point Walsh-Hadamard with a 9 x 9 random orthogonal factor.
"""
import torch

from lowbit.errors import UserError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # RMSNorm w * x / rms(x), pre-norm blocks, no embedding scale


def walsh_hadamard(n: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix (n x n, n a power of 2), float64, orthogonal."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """Haar-random orthogonal n x n matrix (QR of a Gaussian, signs fixed by R's diagonal), float64."""
    q, r = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=generator))
    return (q * torch.sign(torch.diagonal(r))).contiguous()


def randomized_hadamard(d: int, seed: int = 0) -> torch.Tensor:
    """d x d orthogonal Q = diag(s) (H_{2^k} kron O_m), d = 2^k m with m odd; float64."""
    g = torch.Generator().manual_seed(seed)
    pow2 = d & -d  # largest power of 2 dividing d
    odd = d // pow2
    core = walsh_hadamard(pow2) if odd == 1 else torch.kron(walsh_hadamard(pow2), random_orthogonal(odd, g))
    signs = torch.randint(0, 2, (d,), generator=g, dtype=torch.float64) * 2 - 1
    return signs[:, None] * core


def _blocks(model):
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        raise UserError(f"rotation: model type {cfg.model_type!r} is not supported (only {', '.join(FAMILIES)})")
    body = model.model
    return body, list(body.layers)


@torch.no_grad()
def _fold_norm(norm, linears) -> None:
    """W' = W diag(g) for each linear reading the norm's output; the norm's weight becomes ones."""
    g = norm.weight.double()
    for lin in linears:
        lin.weight.copy_((lin.weight.double() * g[None, :]).to(lin.weight.dtype))
    norm.weight.fill_(1.0)


@torch.no_grad()
def _read(lin, q) -> None:
    lin.weight.copy_((lin.weight.double() @ q).to(lin.weight.dtype))


@torch.no_grad()
def _write(lin, q) -> None:
    lin.weight.copy_((q.T @ lin.weight.double()).to(lin.weight.dtype))
    if lin.bias is not None:
        lin.bias.copy_((lin.bias.double() @ q).to(lin.bias.dtype))


def fold_norms(model) -> None:
    """Every RMSNorm weight folded into the linears that read it; lm_head untied from the embedding."""
    body, layers = _blocks(model)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        _fold_norm(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj])
        _fold_norm(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])
    head = model.get_output_embeddings()
    if head.weight is body.embed_tokens.weight or head.weight.data_ptr() == body.embed_tokens.weight.data_ptr():
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    tied = getattr(model, "all_tied_weights_keys", None)  # transformers >= 5: {alias: canonical}, read by exports
    if tied:
        model.all_tied_weights_keys = {a: c for a, c in tied.items() if not a.startswith("lm_head.")}
    _fold_norm(body.norm, [head])


@torch.no_grad()
def rotate_heads(model, seed: int = 0) -> None:
    """Each value head's output rotated by one head_dim x head_dim randomized Hadamard R: v_proj rows
    W_v' = R^T W_v per kv head, o_proj columns W_o' = W_o R per attention head (attention mixes positions, not
    channels, so softmax(.) (v R) = (softmax(.) v) R)."""
    _, layers = _blocks(model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    r = randomized_hadamard(head_dim, seed + 1)
    for layer in layers:
        v, o = layer.self_attn.v_proj, layer.self_attn.o_proj
        wv = v.weight.double().view(-1, head_dim, v.in_features)  # [kv heads, head_dim, d]
        v.weight.copy_(torch.einsum("ji,hjd->hid", r, wv).reshape_as(v.weight).to(v.weight.dtype))
        if v.bias is not None:
            v.bias.copy_((v.bias.double().view(-1, head_dim) @ r).reshape(-1).to(v.bias.dtype))
        wo = o.weight.double().view(o.out_features, -1, head_dim)  # [d, heads, head_dim]
        o.weight.copy_((wo @ r).reshape_as(o.weight).to(o.weight.dtype))


@torch.no_grad()
def rotate_residual(model, seed: int = 0) -> None:
    """The residual stream rotated by Q (module docstring); norms must already be folded (weights ones)."""
    body, layers = _blocks(model)
    d = model.config.hidden_size
    norms = [body.norm] + [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(not torch.all(n.weight == 1) for n in norms):
        raise ValueError("rotate_residual: fold the RMSNorm weights first (fold_norms)")
    q = randomized_hadamard(d, seed)
    emb = body.embed_tokens
    emb.weight.copy_((emb.weight.double() @ q).to(emb.weight.dtype))
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _read(lin, q)
        for lin in (attn.o_proj, mlp.down_proj):
            _write(lin, q)
    _read(model.get_output_embeddings(), q)


def rotate(model, seed: int = 0, heads: bool = True) -> None:
    """The whole pass, in place on a float model: fold norms, rotate the residual, optionally the value heads."""
    fold_norms(model)
    rotate_residual(model, seed)
    if heads:
        rotate_heads(model, seed)
