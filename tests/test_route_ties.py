"""The engine check's router-tie rule (lowbit.bench.route_ties, serve_bench.without_router_ties): only steps over a
bar whose routing differs from the reference's at reference ties are left out, never more than a quarter of them,
and the recorder sees every router call of both paths."""
import torch

from lowbit.bench import route_ties, serve_bench
from lowbit.testing.dummy_weights import QWEN3_30B_A3B, dummy_checkpoint

TINY_MOE = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                vocab_size=256, max_position_embeddings=256, dtype="float32")


def test_tie_rows_lists_a_flip_at_a_reference_tie():
    logits = torch.tensor([[2.0, 1.5, 1.5, 0.1], [3.0, 2.0, 1.0, 0.0]])  # row 0 ties for the 2nd expert
    ref = torch.tensor([[0, 1], [0, 1]])
    assert route_ties.tie_rows(logits, ref, torch.tensor([[0, 2], [1, 0]])) == [{"row": 0, "gap": 0.0}]
    assert route_ties.tie_rows(logits, ref, ref) == []


def test_tie_rows_refuses_a_flip_that_is_no_tie():
    logits = torch.tensor([[2.0, 1.5, 1.4, 0.1]])  # gap 0.1: far above bf16's eps x 1.5
    assert route_ties.tie_rows(logits, torch.tensor([[0, 1]]), torch.tensor([[0, 2]])) is None
    near = route_ties.tie_rows(logits + torch.tensor([[0, 0, 0.0999, 0]]), torch.tensor([[0, 1]]),
                               torch.tensor([[2, 0]]))  # 1.5 against 1.4999: a tie within bf16's precision
    assert [r["row"] for r in near] == [0] and 0 < near[0]["gap"] < 1e-3


def _engine(moe: bool):
    """A stand-in engine whose model has (or has not) a router."""
    from types import SimpleNamespace

    from torch import nn

    from lowbit.serve.layers.moe import SparseMoe

    layer = SparseMoe(8, 8, 2, 1, True) if moe else nn.Linear(8, 8)
    return SimpleNamespace(runner=SimpleNamespace(model=nn.ModuleList([layer])))


def _cmp(rel, gap=None):
    gap = gap or [0.0] * len(rel)
    return {"rel_err_per_step": rel, "argmax_gap_per_step": gap, "logits_rel_err_max": max(rel),
            "argmax_gap_max": max(gap)}


def test_without_router_ties_leaves_out_only_tie_decided_steps(monkeypatch):
    ties = {1: [{"layer": 1, "row": 0, "gap": 0.0}], 3: [{"layer": 0, "row": 0, "gap": 0.0}]}
    monkeypatch.setattr(route_ties, "router_tie_steps", lambda engine, prompts, osl: ties)
    steps = [0.004, 0.037, 0.005, 0.004, 0.004, 0.004, 0.004, 0.004]
    out = serve_bench.without_router_ties(_engine(True), [], 8, _cmp(steps), 0.03, 0.1)
    assert out["logits_rel_err_max"] == 0.005 and out["router_tie_steps"] == {1: ties[1]}  # step 3 was under the bar
    steps = [0.004, 0.004, 0.031, 0.004, 0.004, 0.004, 0.004, 0.004]
    out = serve_bench.without_router_ties(_engine(True), [], 8, _cmp(steps), 0.03, 0.1)
    assert out["logits_rel_err_max"] == 0.031 and "router_tie_steps" not in out  # step 2 over the bar: no tie there
    cmp = _cmp([0.004, 0.004, 0.004, 0.004], [0, 0.5, 0, 0])
    out = serve_bench.without_router_ties(_engine(True), [], 4, cmp, 0.03, 0.1)
    assert out["argmax_gap_max"] == 0 and list(out["router_tie_steps"]) == [1]  # a greedy flip at a tie step


def test_without_router_ties_leaves_a_model_without_routers_alone(monkeypatch):
    def never(engine, prompts, osl):
        raise AssertionError("a model without routers is not re-run")
    monkeypatch.setattr(route_ties, "router_tie_steps", never)
    cmp = _cmp([0.004, 0.04, 0.004, 0.004])
    assert serve_bench.without_router_ties(_engine(False), [], 4, cmp, 0.03, 0.1) is cmp


def test_without_router_ties_never_leaves_out_more_than_a_quarter(monkeypatch):
    ties = {s: [{"layer": 0, "row": 0, "gap": 0.0}] for s in range(4)}
    monkeypatch.setattr(route_ties, "router_tie_steps", lambda engine, prompts, osl: ties)
    cmp = _cmp([0.04, 0.04, 0.004, 0.004])
    assert serve_bench.without_router_ties(_engine(True), [], 4, cmp, 0.03, 0.1) is cmp


def test_recorder_sees_every_router_call_of_both_paths():
    """On the CPU engine: per step one record per MoE layer, each the expert ids top-k gives on its logits; the
    reference path's router (swapped in by reference_path) is recorded too."""
    from lowbit.serve.engine.config import EngineConfig
    from lowbit.serve.engine.engine import Engine

    ckpt = dummy_checkpoint("bf16", TINY_MOE, device="cpu", std=0.2)
    engine = Engine(ckpt.path, EngineConfig(max_batch_size=4, max_num_tokens=64, device="cpu", dtype="float32",
                                            num_kv_blocks=64), ckpt=ckpt, tokenizer=serve_bench.DummyTokenizer())
    prompts = [[(5 * i + n) % 250 + 3 for i in range(n)] for n in (3, 21)]
    for reference in (False, True):
        steps = []
        with serve_bench.reference_path(engine) if reference else torch.no_grad():
            with route_ties.recording_routes(engine, steps):
                serve_bench.greedy(engine, prompts, 3)
        assert len(steps) >= 3 and all(len(s) == 2 for s in steps)  # both layers are MoE layers
        for s in steps:
            for logits, ids in s:
                assert torch.equal(ids.sort(-1).values, torch.topk(logits, 2, -1).indices.sort(-1).values)
    assert route_ties.router_tie_steps(engine, prompts, 3) == {}  # float paths: no flips on this model
