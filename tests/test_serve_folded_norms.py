"""Batch-1 decode with the norms (and SiLU-and-mul) folded into the GEMVs (models/llama.py FOLD_NORMS_AT_ONE_ROW,
FOLD_SILU_AT_ONE_ROW), on the CPU under the Triton interpreter: the same greedy tokens as the unfolded model, and logits within fp16 tolerance, on a tiny fp16
Llama whose single-sequence decode steps take the folded path."""
import pytest
import torch

from lowbit.bench_cli import load_script
from lowbit.kernels._triton import HAS_TRITON, interpreting
from lowbit.serve.layers import RMSNorm
from lowbit.serve.models import llama

pytestmark = pytest.mark.skipif(not (HAS_TRITON and interpreting()) or torch.cuda.is_available(),
                                reason="CPU interpreter test (TRITON_INTERPRET=1 before triton's import)")
LOGITS_TOL = 2e-2  # relative L2 per step: fp16 roundings, the sum of squares added in another order


def run(engine, bench, prompt, fold: bool, monkeypatch, silu: bool = False):
    monkeypatch.setattr(llama, "FOLD_NORMS_AT_ONE_ROW", fold)
    monkeypatch.setattr(llama, "FOLD_SILU_AT_ONE_ROW", silu)
    calls = [0]
    one_row = llama.LlamaModel.forward_one_row

    def counted(self, *args):
        calls[0] += 1
        return one_row(self, *args)
    monkeypatch.setattr(llama.LlamaModel, "forward_one_row", counted)
    tokens, logits, _ = bench.greedy_with_logits(engine, [prompt], 4)
    return tokens, logits, calls[0]


def test_folded_norms_give_the_same_tokens_and_logits(monkeypatch):
    """Unfolded, norms folded, norms and SiLU-and-mul folded: one engine, the same prompt."""
    from lowbit.serve import attention
    from lowbit.serve.triton_attention import TritonAttentionBackend

    bench = load_script("serve_bench.py")
    args = bench.parse(["--tiny", "--device", "cpu"])
    engine = bench.build_engine(args, "bf16", dtype="float16", enable_prefix_caching=False, max_batch_size=2,
                                num_kv_blocks=32)
    prompt = bench.random_prompts(1, 6, 512, seed=5)[0]
    g = torch.Generator().manual_seed(0)
    model = engine.runner.model
    for module in model.modules():  # norm weights far from 1 and a stream far from unit RMS: a norm left out shows
        if isinstance(module, RMSNorm):
            module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
    model.model.embed_tokens.weight.mul_(4.0)
    saved = attention._backend
    try:
        attention.set_attention_backend(TritonAttentionBackend())
        tok_u, logits_u, unfolded = run(engine, bench, prompt, False, monkeypatch)
        runs = [run(engine, bench, prompt, True, monkeypatch, silu) for silu in (False, True)]
    finally:
        attention.set_attention_backend(saved)
    assert unfolded == 0
    for tok_f, logits_f, folded in runs:
        assert folded == 3  # the prompt's step is not one row; its 3 decode steps are
        assert tok_f == tok_u
        for a, b in zip(logits_f, logits_u):
            assert ((a - b).norm() / b.norm()).item() < LOGITS_TOL
