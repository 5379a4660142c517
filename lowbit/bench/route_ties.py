"""Engine-check steps decided by a router tie: where the kernel path picks other experts than the fp32 reference path
only at rows whose reference router logits tie (the k-th and (k+1)-th apart by at most bf16's relative precision, eps
times the k-th: one or two ulps of the bf16 logits both paths route on), either choice is right, and the two paths'
logits may part by a whole expert's contribution.

Both paths run eagerly here (CUDA graphs off, so every router call is seen), the kernel path teacher-forced with the
reference's tokens, as the check runs them; kernels give the same numbers eagerly as in a graph replay.
"""
from contextlib import contextmanager

import torch

from lowbit.serve.layers import ops


@contextmanager
def recording_routes(engine, steps: list):
    """Within: each engine step appends a list to `steps`; each router call (layer order) appends (logits fp32 [T, E],
    expert ids [T, k]) to it. Wraps the ops.moe_route and ops.moe_router in force on entry (a reference path's, inside
    one)."""
    route, router, run = ops.moe_route, ops.moe_router, engine.runner.run

    def recording_run(*a, **kw):
        steps.append([])
        return run(*a, **kw)

    def recording_route(logits, top_k, renormalize):
        weights, ids = route(logits, top_k, renormalize)
        steps[-1].append((logits.float().cpu(), ids.cpu()))
        return weights, ids

    def recording_router(x, weight, top_k, renormalize):
        weights, ids, logits = router(x, weight, top_k, renormalize)
        steps[-1].append((logits.float().cpu(), ids.cpu()))
        return weights, ids, logits

    engine.runner.run, ops.moe_route, ops.moe_router = recording_run, recording_route, recording_router
    try:
        yield
    finally:
        engine.runner.run, ops.moe_route, ops.moe_router = run, route, router


def tie_rows(ref_logits: torch.Tensor, ref_ids: torch.Tensor, ker_ids: torch.Tensor) -> list[dict] | None:
    """Rows whose chosen experts differ -> [{row, gap}]; None when any of them is not a reference tie."""
    k = ref_ids.shape[1]
    top = torch.topk(ref_logits, k + 1, dim=-1).values
    gap, ulp = top[:, k - 1] - top[:, k], torch.finfo(torch.bfloat16).eps * top[:, k - 1].abs()
    differ = (ref_ids.sort(-1).values != ker_ids.sort(-1).values).any(-1).nonzero().flatten().tolist()
    if any(gap[r] > ulp[r] for r in differ):
        return None
    return [{"row": r, "gap": gap[r].item()} for r in differ]


def router_tie_steps(engine, prompts, osl) -> dict[int, list[dict]]:
    """Steps whose routing differs between the paths only at reference ties -> {step: [{layer, row, gap}]}; a step
    that routes identically, or differs anywhere else, is not listed. Empty for a model without routers."""
    from lowbit.bench.serve_bench import greedy_with_logits, reference_path

    graphs, engine.runner.graphs = engine.runner.graphs, None
    ref_steps, ker_steps = [], []
    try:
        with reference_path(engine), recording_routes(engine, ref_steps):
            _, _, picks = greedy_with_logits(engine, prompts, osl)
        with recording_routes(engine, ker_steps):
            greedy_with_logits(engine, prompts, osl, forced=picks)
    finally:
        engine.runner.graphs = graphs
    ties = {}
    for s, (ref, ker) in enumerate(zip(ref_steps, ker_steps)):
        rows = [(layer, tie_rows(rl, rid, kid)) for layer, ((rl, rid), (_, kid)) in enumerate(zip(ref, ker))]
        if rows and all(r is not None for _, r in rows) and any(r for _, r in rows):
            ties[s] = [{"layer": layer, **r} for layer, rs in rows for r in rs]
    return ties

