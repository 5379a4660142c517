"""The embedded model served in FP8 with its own INT4-AWQ copy drafting for it (`LLM(..., speculative="draft")`):
greedy outputs equal plain decoding and most drafts are accepted; the acceptance is printed (pytest -s)."""
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


def test_fp8_target_with_its_int4_awq_copy_drafting(quantized):
    from lowbit.serve import LLM, SamplingParams

    target, draft = quantized("fp8"), quantized("int4_awq")
    prompts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
               "Summarise: The committee agreed to fund the new library wing and to delay the road repairs until "
               "spring.\nSummary:"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = LLM(str(target), num_kv_blocks=64).generate(prompts, params)
    llm = LLM(str(target), num_kv_blocks=64, speculative="draft", draft_model=str(draft), num_draft_tokens=4)
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    s = llm.engine.spec
    rate = s.num_accepted / s.num_drafted
    print(f"\nfp8 target, int4_awq draft, k=4: acceptance {rate:.2f}, accepted per verify step "
          f"{s.num_accepted / s.num_verified:.2f}")
    assert rate > 0.5
    assert llm.engine.block_manager.num_used_blocks == 0 and s.drafter.block_manager.num_used_blocks == 0
