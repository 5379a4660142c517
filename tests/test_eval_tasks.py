"""lowbit's offline tasks are lm-eval's tasks on shipped data, and its scorer matches lm-eval's HFLM."""
import pytest

from lowbit.evaluate import tasks
from lowbit.evaluate.harness import run_task


def test_prompts_and_metrics_come_from_lm_eval():
    from lm_eval.tasks._yaml_loader import load_yaml

    for name, (yaml_rel, _) in tasks.OFFLINE.items():
        stock = load_yaml(tasks.lm_eval_tasks_dir() / yaml_rel)
        ours = tasks.offline_config(name)
        for key in ("output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "metric_list", "process_docs"):
            assert ours.get(key) == stock.get(key), (name, key)
        assert "test_split" not in ours and ours["validation_split"] == "validation"


def test_shipped_data():
    sizes = {"arc_easy": 570, "arc_challenge": 299, "hellaswag": 10042, "piqa": 1838, "lambada": 5153}
    for name, n in sizes.items():
        cfg = tasks.offline_config(name)
        assert len(cfg["custom_dataset"]()["validation"]) == n


@pytest.fixture(scope="module")
def embedded(embedded_model_dir):
    from lowbit.checkpoint import load_reference_model

    return load_reference_model(embedded_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["arc_easy", "hellaswag", "piqa"])
def test_scores_equal_lm_eval_hflm(task, embedded):
    from lm_eval.models.huggingface import HFLM

    from lowbit.evaluate.harness import inproc_lm

    model, tokenizer = embedded
    ours = run_task(inproc_lm(model, tokenizer), task, limit=6)
    stock = run_task(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8), task, limit=6)
    assert ours["n"] == stock["n"] == 6
    assert ours["per_doc"]["acc"] == stock["per_doc"]["acc"]
    assert ours["per_doc"]["acc_norm"] == stock["per_doc"]["acc_norm"]
    assert ours["metrics"] == stock["metrics"]


def test_shared_context_loglikelihoods_equal_hflm(embedded):
    from lm_eval.models.huggingface import HFLM

    from lowbit.evaluate.harness import inproc_lm

    model, tokenizer = embedded
    pairs = [("Question: Which is a liquid?\nAnswer:", c) for c in (" water", " a solid block of ice", " stone")]
    pairs += [("The capital of France is", " Paris"), ("One two three", " four five six seven")]
    ours, stock = inproc_lm(model, tokenizer), HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4)
    requests = [((c, x), *stock._encode_pair(c, x)) for c, x in pairs]
    got = ours._loglikelihood_tokens(requests, disable_tqdm=True)
    want = stock._loglikelihood_tokens(requests, disable_tqdm=True)
    for (lp, greedy), (lp_ref, greedy_ref) in zip(got, want):
        assert abs(lp - lp_ref) < 1e-3 and greedy == greedy_ref


def test_scorer_works_with_attention_that_builds_no_mask(embedded):
    """An attention implementation registered without a mask function (like the reference reader's FP8 KV
    attention) gets no causal mask from transformers: the scorer must supply one for its cached continuations."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from lowbit.evaluate.harness import inproc_lm

    def sdpa_without_mask_function(*args, **kwargs):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)

    model, tokenizer = embedded
    pairs = [("Question: Which is a liquid?\nAnswer:", c) for c in (" water", " a solid block of ice")]
    pairs += [("One two three", " four five six seven")]
    stock = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)
    requests = [((c, x), *stock._encode_pair(c, x)) for c, x in pairs]
    want = stock._loglikelihood_tokens(requests, disable_tqdm=True)
    AttentionInterface.register("lowbit_test_nomask", sdpa_without_mask_function)
    model.set_attn_implementation("lowbit_test_nomask")
    try:
        got = inproc_lm(model, tokenizer)._loglikelihood_tokens(requests, disable_tqdm=True)
    finally:
        model.set_attn_implementation("sdpa")
    for (lp, greedy), (lp_ref, greedy_ref) in zip(got, want):
        assert abs(lp - lp_ref) < 1e-3 and greedy == greedy_ref


def test_first_documents_are_the_limited_documents():
    """Reading only the first N documents (lean run_task) gives lm-eval's first N documents, in order."""
    for name in tasks.OFFLINE:
        full = tasks.offline_config(name)["custom_dataset"]()["validation"]
        first = tasks.offline_config(name, 7)["custom_dataset"]()["validation"]
        assert len(first) == 7 and first.to_list() == full.select(range(7)).to_list(), name


@pytest.mark.parametrize("task", ["arc_easy", "hellaswag", "piqa", "lambada"])
def test_lean_run_builds_the_same_requests(task, monkeypatch):
    """lean run_task (first documents only, no environment report) sends the scorer exactly the same requests and
    restores lm-eval's environment report afterwards."""
    import lm_eval.evaluator as evaluator

    from transformers import AutoTokenizer

    from lowbit.evaluate import parallel
    from lowbit.evaluate.harness import inproc_lm
    from lowbit.models import DEFAULT_MODEL, resolve
    from tests.interop_fixtures import tiny_llama

    lm = inproc_lm(tiny_llama(), AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL)))  # the scorer is stubbed
    seen = {}

    def recording(model, jobs, device, workers, batch=1, exact=True):
        seen.setdefault(key, []).extend(jobs)
        for _ in jobs:
            yield [(-1.0, False)] * 8  # more answers than continuations: only the first ones are read

    monkeypatch.setattr(parallel, "score_all", recording)
    env_report = evaluator.add_env_info
    results = {}
    for key in ("full", "lean"):
        results[key] = run_task(lm, task, limit=5, lean=key == "lean")
    assert seen["lean"] == seen["full"] and len(seen["full"]) >= 5
    assert results["lean"]["per_doc"] == results["full"]["per_doc"] and results["lean"]["n"] == 5
    assert evaluator.add_env_info is env_report
