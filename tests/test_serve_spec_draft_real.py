"""The embedded model's INT4-AWQ copy drafting for it (`LLM(..., speculative="draft")`): for the bf16 model, greedy
outputs equal plain decoding; for its FP8 copy the acceptance is reported (pytest -s) and checked, not the outputs:
an FP8 target's k + 1-token verify forward rounds differently from its one-token decode step, so near-ties flip with
any drafter (n-gram too)."""
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """recipe -> checkpoint directory: the store's copy when there is one, else quantized here (~1 min each)."""
    from lowbit.models import is_model_dir, store_path
    from lowbit.quantize.api import quantize

    def get(recipe: str):
        if is_model_dir(store_path(f"smollm2-135m-{recipe}")):
            return store_path(f"smollm2-135m-{recipe}")
        out = tmp_path_factory.mktemp("q") / recipe
        return quantize("smollm2-135m", recipe, out=out, num_samples=4, seq_len=128).out
    return get


@pytest.mark.parametrize("target", ["bf16", "fp8"])
def test_the_int4_awq_copy_drafting_for_the_model(quantized, target):
    from lowbit.serve import LLM, SamplingParams

    path, draft = "smollm2-135m" if target == "bf16" else str(quantized(target)), str(quantized("int4_awq"))
    prompts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
               "Summarise: The committee agreed to fund the new library wing and to delay the road repairs until "
               "spring.\nSummary:"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = LLM(path, num_kv_blocks=64).generate(prompts, params)
    llm = LLM(path, num_kv_blocks=64, speculative="draft", speculative_adaptive=False,
              draft_model=draft, num_draft_tokens=4)
    spec = llm.generate(prompts, params)
    if target == "bf16":
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    s = llm.engine.spec
    rate = s.num_accepted / s.num_drafted
    print(f"\n{target} target, int4_awq draft, k=4: acceptance {rate:.2f}, accepted per verify step "
          f"{s.num_accepted / s.num_verified:.2f}")
    assert rate > 0.3
    assert llm.engine.block_manager.num_used_blocks == 0 and s.drafter.block_manager.num_used_blocks == 0
