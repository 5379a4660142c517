"""The grouped-query prefill kernel (lowbit/kernels/attention/paged_prefill.py) against paged_prefill_ref.

CPU: the Triton interpreter at tiny shapes in fp16 (bf16 tl.dot is wrong there). GPU: bf16 at Llama-8B heads.
"""
import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels.attention import paged_attention as pa  # noqa: E402
from lowbit.kernels.ops.norm import quantize_fp8_ref  # noqa: E402
from lowbit.kernels.attention.paged_prefill import paged_prefill  # noqa: E402
from test_paged_attention import DEVICE, DTYPE, LONG, SHAPES, make_case, rel_err  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not interpreting(),
                                reason="needs a GPU or the Triton interpreter (TRITON_INTERPRET=1 before triton)")
# Tiles small enough for the interpreter's shapes, and ones that leave a partial tile at each end
# (block_t, block_n, warps, stages, blocks, dot_acc, heavy_first)
CONFIGS = ([None, (16, 32, 4, 2), (8, 16, 4, 2), (16, 32, 4, 2, True), (8, 16, 4, 2, True),
            (8, 16, 4, 2, False, True, True), (16, 32, 4, 2, True, True, False)] if DEVICE == "cpu" else
           [None, (16, 128, 4, 3), (64, 64, 8, 2), (16, 64, 4, 3, True), (32, 128, 8, 3, True),
            (32, 128, 8, 3, False, True, True), (16, 64, 4, 3, True, True, False)])


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [(SHAPES["hq"], SHAPES["hk"]), (4, 1), (2, 2), (6, 2)])  # G = 2, 4, 1, 3
def test_grouped_prefill_matches_reference(fp8, heads, config):
    """Whole prompts, a chunk after cached tokens, an extend of 9 and a decode row, in one call."""
    kv_dtype = torch.float8_e4m3fn if fp8 else DTYPE
    shapes = dict(SHAPES, hq=heads[0], hk=heads[1])
    ctx, qlen = [70, 5, 33, LONG // 3, 40], [70, 5, 9, 1, 23]
    c = make_case(ctx, qlen, dtype=DTYPE, kv_dtype=kv_dtype, seed=3, **shapes)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    args = (c["q"], c["cache"], c["qsl"], c["ctx"], c["tables"], max(qlen), 0.125, *c["scales"])
    out = paged_prefill(*args, config=config)
    ref = pa.paged_prefill_ref(*args)
    assert rel_err(out, ref) < 1e-2
    per_row = (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)
    assert per_row.max().item() < 3e-2  # no row (token, head) is wrong on its own


def test_grouped_prefill_fp8_output():
    """With out_scale the output is the bf16 output quantized to FP8 (out / out_scale), as in paged_prefill."""
    ctx, qlen = [70, 5, 33], [70, 5, 9]
    c = make_case(ctx, qlen, dtype=DTYPE, kv_dtype=torch.float8_e4m3fn, seed=4, **SHAPES)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    args = (c["q"], c["cache"], c["qsl"], c["ctx"], c["tables"], max(qlen), 0.125, *c["scales"])
    out_scale = torch.tensor(0.01, device=c["q"].device)
    fp8, plain = paged_prefill(*args, out_scale), paged_prefill(*args)
    assert fp8.dtype == torch.float8_e4m3fn
    differ = (fp8.view(torch.uint8) != quantize_fp8_ref(plain, out_scale).view(torch.uint8)).float().mean()
    # the interpreter mis-rounds ~2 % of fp32 -> fp8 casts (ENV.md); compiled, the epilogue is exact
    assert differ.item() < 0.05 if interpreting() else differ.item() == 0


@pytest.mark.parametrize("fp8", [False, True])
def test_mixed_step_splits_decodes_from_prefill(fp8):
    """A mixed step (one-token sequences first, then prefill chunks): the backend's decode + prefill split equals
    the prefill reference over the whole step, and so does a step whose only one-token rows are not leading."""
    from lowbit.serve.runner.context import StepContext
    from lowbit.serve.layers.triton_attention import TritonAttentionBackend, leading_single_tokens

    kv_dtype = torch.float8_e4m3fn if fp8 else DTYPE
    # decodes then prompts; a one-token row not leading; one-token prompts only (not a decode step either)
    for ctx, qlen in (([40, 17, 70, 33], [1, 1, 70, 9]), ([70, 40], [70, 1]), ([1, 30], [1, 1])):
        c = make_case(ctx, qlen, dtype=DTYPE, kv_dtype=kv_dtype, seed=5, **SHAPES)
        pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
        step = StepContext(positions=None, slot_mapping=None, query_start_loc=c["qsl"], context_lens=c["ctx"],
                           block_tables=c["tables"], logits_indices=None, is_decode=False, query_lens_cpu=qlen,
                           context_lens_cpu=ctx)
        out = TritonAttentionBackend.attend(c["q"], c["cache"], step, 0.125, *c["scales"])
        ref = pa.paged_prefill_ref(c["q"], c["cache"], c["qsl"], c["ctx"], c["tables"], max(qlen), 0.125,
                                   *c["scales"])
        assert leading_single_tokens(qlen) == {(1, 1, 70, 9): 2, (70, 1): 0, (1, 1): 2}[tuple(qlen)]
        per_row = (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)
        assert per_row.max().item() < 3e-2, per_row.max().item()  # decode rows included
