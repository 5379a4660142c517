"""Documents scored in lockstep (shared GEMMs) give bitwise the scores of one document at a time, in order."""
import threading
import time

import pytest
import torch

from tests.test_eval_parallel import tiny_fp8  # noqa: F401  (fixture)

VOCAB = 49152


def _jobs(seed: int, n: int):
    """Contexts of 1..40 tokens with 1..4 continuations of 1..12 tokens: every row class of every linear occurs."""
    g = torch.Generator().manual_seed(seed)
    jobs = []
    for _ in range(n):
        ctx = torch.randint(0, VOCAB, (int(torch.randint(1, 41, (1,), generator=g)),), generator=g).tolist()
        conts = [torch.randint(0, VOCAB, (int(m),), generator=g).tolist()
                 for m in torch.randint(1, 13, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)]
        jobs.append((ctx, conts))
    return jobs


def test_row_classes_found_here():
    from lowbit.evaluate.lockstep import row_classes

    for bias in (False, True):
        starts = row_classes(128, 64, bias, torch.get_num_threads())
        assert starts is not None and starts[0] == 1 and list(starts) == sorted(set(starts))


def test_lockstep_scores_bitwise_equal_in_order(tiny_fp8):  # noqa: F811
    from lowbit.evaluate.harness import score_continuations, score_continuations_lockstep
    from lowbit.evaluate.lockstep import Lockstep

    model, _ = tiny_fp8
    jobs = _jobs(0, 14)
    one = [score_continuations(model, ctx, conts, "cpu") for ctx, conts in jobs]
    assert [score_continuations_lockstep(model, ctx, conts, "cpu") for ctx, conts in jobs] == one  # alone
    lockstep = Lockstep(model, docs=5)
    assert lockstep.classes, "no linear of the tiny model has verified GEMM row classes on this machine"
    batched = list(lockstep.map(lambda job: score_continuations_lockstep(model, *job, "cpu"), jobs))
    assert batched == one  # floats compared exactly, order included
    assert len({lp for r in one for lp, _ in r}) > 20  # distinct jobs score differently: a reordering would show
    assert lockstep.gemms < lockstep.parked  # inputs of several documents did share GEMMs
    assert not any("forward" in vars(m) for m in model.modules())  # the linears' own forward again


def test_lockstep_raises_a_documents_error(tiny_fp8):  # noqa: F811
    from lowbit.evaluate.harness import score_continuations_lockstep
    from lowbit.evaluate.lockstep import Lockstep

    model, _ = tiny_fp8

    def score(job):
        if job is None:
            raise ValueError("bad document")
        return score_continuations_lockstep(model, *job, "cpu")

    threads = threading.active_count()
    with pytest.raises(ValueError, match="bad document"):
        list(Lockstep(model, docs=3).map(score, [*_jobs(1, 2), None, *_jobs(2, 2)]))
    assert not any("forward" in vars(m) for m in model.modules())
    time.sleep(0.2)
    assert threading.active_count() == threads  # the other documents were unwound, not left parked


def test_lockstep_stopped_early_unwinds(tiny_fp8):  # noqa: F811
    from lowbit.evaluate.harness import score_continuations_lockstep
    from lowbit.evaluate.lockstep import Lockstep

    model, _ = tiny_fp8
    threads = threading.active_count()
    results = Lockstep(model, docs=4).map(lambda job: score_continuations_lockstep(model, *job, "cpu"), _jobs(3, 6))
    first = next(results)
    results.close()
    assert first == score_continuations_lockstep(model, *_jobs(3, 1)[0], "cpu")
    assert not any("forward" in vars(m) for m in model.modules())
    time.sleep(0.2)
    assert threading.active_count() == threads


def test_task_scores_equal_in_lockstep(tiny_fp8):  # noqa: F811
    from lowbit.evaluate.harness import inproc_lm, run_task

    model, tokenizer = tiny_fp8
    one = run_task(inproc_lm(model, tokenizer), "arc_easy", limit=8)
    batched = run_task(inproc_lm(model, tokenizer, batch=4), "arc_easy", limit=8)
    assert one["n"] == batched["n"] == 8
    assert batched["per_doc"] == one["per_doc"] and batched["metrics"] == one["metrics"]


def test_workers_in_lockstep_give_bitwise_equal_scores(tiny_fp8):  # noqa: F811
    from lowbit.evaluate.harness import score_continuations
    from lowbit.evaluate.parallel import score_all

    model, _ = tiny_fp8
    jobs = _jobs(4, 11)
    one = [score_continuations(model, ctx, conts, "cpu") for ctx, conts in jobs]
    assert list(score_all(model, jobs, "cpu", workers=2, batch=3)) == one
