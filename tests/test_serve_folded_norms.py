"""Batch-1 decode with the norms folded into the GEMVs (models/llama.py FOLD_NORMS_AT_ONE_ROW), on the CPU under the
Triton interpreter: the same greedy tokens as the unfolded model, and logits within fp16 tolerance, on a tiny fp16
Llama whose single-sequence decode steps take the folded path."""
import pytest
import torch

from lowbit.bench_cli import load_script
from lowbit.kernels._triton import HAS_TRITON, interpreting
from lowbit.serve.models import llama

pytestmark = pytest.mark.skipif(not (HAS_TRITON and interpreting()) or torch.cuda.is_available(),
                                reason="CPU interpreter test (TRITON_INTERPRET=1 before triton's import)")
LOGITS_TOL = 2e-2  # relative L2 per step: fp16 roundings, the sum of squares added in another order


def run(engine, bench, prompt, fold: bool, monkeypatch):
    monkeypatch.setattr(llama, "FOLD_NORMS_AT_ONE_ROW", fold)
    calls = [0]
    one_row = llama.LlamaModel.forward_one_row

    def counted(self, *args):
        calls[0] += 1
        return one_row(self, *args)
    monkeypatch.setattr(llama.LlamaModel, "forward_one_row", counted)
    tokens, logits, _ = bench.greedy_with_logits(engine, [prompt], 6)
    return tokens, logits, calls[0]


def test_folded_norms_give_the_same_tokens_and_logits(monkeypatch):
    from lowbit.serve import attention
    from lowbit.serve.triton_attention import TritonAttentionBackend

    bench = load_script("serve_bench.py")
    args = bench.parse(["--tiny", "--device", "cpu"])
    engine = bench.build_engine(args, "bf16", dtype="float16", enable_prefix_caching=False, max_batch_size=2,
                                num_kv_blocks=32)
    prompt = bench.random_prompts(1, 13, 512, seed=5)[0]
    saved = attention._backend
    try:
        attention.set_attention_backend(TritonAttentionBackend())
        tok_f, logits_f, folded = run(engine, bench, prompt, True, monkeypatch)
        tok_u, logits_u, unfolded = run(engine, bench, prompt, False, monkeypatch)
    finally:
        attention.set_attention_backend(saved)
    assert folded == 5 and unfolded == 0  # the prompt's step is not one row; its 5 decode steps are
    assert tok_f == tok_u
    for a, b in zip(logits_f, logits_u):
        assert ((a - b).norm() / b.norm()).item() < LOGITS_TOL
