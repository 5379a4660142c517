"""KV-cache scales: every attention layer must leave calibration with a calibrated k and v amax.

modelopt exports `k_proj.k_scale` / `v_proj.v_scale` = amax / 448 from the k/v bmm quantizers; a quantizer without
an amax would export nothing (engines then assume 1.0), so a missing one is an error, never a silent default.
"""
import torch


def kv_quantizers(model) -> dict:
    """{attention module name: (k_bmm_quantizer, v_bmm_quantizer)} for every quantized attention module."""
    return {name: (m.k_bmm_quantizer, m.v_bmm_quantizer)
            for name, m in model.named_modules() if hasattr(m, "k_bmm_quantizer")}


def check_kv_calibrated(model) -> None:
    quantizers = kv_quantizers(model)
    if not quantizers:
        raise RuntimeError("the recipe quantizes the KV cache but no attention module has k/v quantizers")
    for name, pair in quantizers.items():
        for kind, q in zip("kv", pair):
            amax = getattr(q, "amax", None)
            if not q.is_enabled or amax is None or not torch.isfinite(amax).all() or (amax <= 0).any():
                raise RuntimeError(f"{name}: {kind} cache quantizer is not calibrated (amax={amax})")


KV_MULTIPLIERS = (1.0, 1.5, 2.0, 3.0, 4.0)  # x the max-calibrated amax; below 1 clips the sink token's keys
KV_SEARCH_SEQS = 4  # calibration sequences scored per candidate (each candidate is one forward over them)


@torch.no_grad()
def calibration_nll(model, seqs: list[list[int]]) -> float:
    """Mean next-token negative log-likelihood (nats) of the model over the token sequences."""
    device = next(model.parameters()).device
    total = 0.0
    for seq in seqs:
        ids = torch.tensor([seq], device=device)
        logits = model(ids).logits[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()
    return total / len(seqs)


@torch.no_grad()
def search_kv_scales(model, batches: list[list[int]], multipliers=KV_MULTIPLIERS) -> tuple[float, float]:
    """Multiply every layer's k amax by the multiplier that gives the lowest calibration NLL, then every v amax
    likewise (k first, v given k's choice); returns (k multiplier, v multiplier). The exported k/v scales are
    amax / 448, so the choice is what engines read. One multiplier per model and per k/v: the score is the whole
    model's NLL, which a per-layer search would need a forward per layer and candidate to measure."""
    quantizers = kv_quantizers(model)
    base = {name: (k.amax.clone(), v.amax.clone()) for name, (k, v) in quantizers.items()}
    seqs = batches[:KV_SEARCH_SEQS]
    scores = {}

    def apply(ck: float, cv: float) -> None:
        for name, (k, v) in quantizers.items():
            k.amax = base[name][0] * ck
            v.amax = base[name][1] * cv

    def score(ck: float, cv: float) -> float:
        if (ck, cv) not in scores:
            apply(ck, cv)
            scores[ck, cv] = calibration_nll(model, seqs)
        return scores[ck, cv]

    best_k = min(multipliers, key=lambda c: score(c, 1.0))
    best_v = min(multipliers, key=lambda c: score(best_k, c))
    apply(best_k, best_v)
    return best_k, best_v
