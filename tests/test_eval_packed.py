"""Documents in padded batches (evaluate/packed.py) score as one document at a time, up to float rounding."""
import torch

from tests import interop_fixtures
from tests.test_eval_lockstep import _jobs
from tests.test_eval_parallel import tiny_fp8  # noqa: F401  (fixture)


def _gap(one, packed) -> float:
    """Largest |loglikelihood difference| / max(1, |loglikelihood|); asserts the layout and greedy flags agree."""
    assert [len(r) for r in packed] == [len(r) for r in one]
    assert [g for r in packed for _, g in r] == [g for r in one for _, g in r]
    return max(abs(a - b) / max(1.0, abs(a)) for r1, r2 in zip(one, packed) for (a, _), (b, _) in zip(r1, r2))


def test_packed_matches_one_document_float_model():
    from lowbit.evaluate.harness import score_continuations
    from lowbit.evaluate.packed import score_packed

    model = interop_fixtures.tiny_llama().eval()
    jobs = [([t % 1024 for t in ctx], [[t % 1024 for t in c] for c in conts]) for ctx, conts in _jobs(1, 12)]
    one = [score_continuations(model, ctx, conts, "cpu") for ctx, conts in jobs]
    packed = list(score_packed(model, jobs, "cpu", tokens=160))  # several batches, some rows alone
    assert _gap(one, packed) < 1e-5  # float32 rounding only: a wrong mask or position would be off by far more
    assert len({lp for r in one for lp, _ in r}) > 20  # distinct jobs score differently: a reordering would show


def test_packed_matches_one_document_fp8(tiny_fp8):  # noqa: F811
    from lowbit.evaluate.harness import score_continuations
    from lowbit.evaluate.packed import score_packed

    model, _ = tiny_fp8
    jobs = _jobs(0, 14)
    one = [score_continuations(model, ctx, conts, "cpu") for ctx, conts in jobs]
    # FP8 fake quantization turns float-rounding differences into a flipped FP8 step now and then
    assert _gap(one, list(score_packed(model, jobs, "cpu"))) < 1e-2


def test_batches_keep_the_token_budget():
    from lowbit.evaluate.packed import _batches

    lengths = [5, 40, 7, 300, 12, 12, 33]
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches = _batches(order, lengths, tokens=64)
    assert [i for b in batches for i in b] == order
    assert all(len(b) * max(lengths[i] for i in b) <= 64 or len(b) == 1 for b in batches)
    assert batches[-1] == [3]  # longer than the budget: alone


def test_task_scores_equal_packed_and_exact(tiny_fp8):  # noqa: F811
    from lowbit.evaluate.harness import inproc_lm, run_task

    model, tokenizer = tiny_fp8
    exact = run_task(inproc_lm(model, tokenizer, exact=True), "arc_easy", limit=8)
    packed = run_task(inproc_lm(model, tokenizer, exact=False), "arc_easy", limit=8)
    assert exact["n"] == packed["n"] == 8
    assert packed["per_doc"] == exact["per_doc"] and packed["metrics"] == exact["metrics"]
