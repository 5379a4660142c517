"""The eval scorer's worker processes give bitwise the scores of one process, in document order."""
import pytest
import torch

from tests import interop_fixtures


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    """A tiny FP8 (W8A8 + FP8 KV) checkpoint with the embedded tokenizer's vocabulary, read by the reference reader."""
    from lowbit import formats
    from lowbit.checkpoint import load_reference_model

    out = tmp_path_factory.mktemp("fp8")
    small = dict(interop_fixtures.SMALL)
    interop_fixtures.SMALL["vocab_size"] = 49152  # real text tokenizes into the embedded model's ids
    try:
        interop_fixtures.lowbit_fp8_checkpoint(out, formats.get("FP8"))
    finally:
        interop_fixtures.SMALL.update(small)
    return load_reference_model(out)


def test_workers_give_bitwise_equal_scores_in_order(tiny_fp8):
    from lowbit.evaluate.parallel import score_all

    model, _ = tiny_fp8
    g = torch.Generator().manual_seed(0)
    jobs = [(torch.randint(0, 49152, (int(n),), generator=g).tolist(),
             [torch.randint(0, 49152, (int(m),), generator=g).tolist() for m in torch.randint(1, 6, (3,), generator=g)])
            for n in torch.randint(3, 20, (9,), generator=g)]
    one = list(score_all(model, jobs, "cpu", workers=1))
    two = list(score_all(model, jobs, "cpu", workers=2))
    assert len(one) == len(jobs) and all(len(r) == 3 for r in one)
    assert two == one  # floats compared exactly, order included
    assert len({lp for r in one for lp, _ in r}) > 20  # distinct jobs score differently: a reordering would show


def test_task_scores_equal_with_workers(tiny_fp8):
    from lowbit.evaluate.harness import inproc_lm, run_task

    model, tokenizer = tiny_fp8
    one = run_task(inproc_lm(model, tokenizer, workers=1), "arc_easy", limit=8)
    two = run_task(inproc_lm(model, tokenizer, workers=2), "arc_easy", limit=8)
    assert one["n"] == two["n"] == 8
    assert two["per_doc"] == one["per_doc"] and two["metrics"] == one["metrics"]
