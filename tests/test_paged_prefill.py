"""The grouped-query prefill kernel (lowbit/kernels/paged_prefill.py) against paged_prefill_ref.

CPU: the Triton interpreter at tiny shapes in fp16 (bf16 tl.dot is wrong there). GPU: bf16 at Llama-8B heads.
"""
import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels import paged_attention as pa  # noqa: E402
from lowbit.kernels.norm import quantize_fp8_ref  # noqa: E402
from lowbit.kernels.paged_prefill import paged_prefill  # noqa: E402
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
F8QK_CONFIGS = ([(8, 16, 4, 2, False, True, True, True), (16, 32, 4, 2, True, False, False, True)] if DEVICE == "cpu"
                else [(32, 128, 8, 3, False, True, True, True), (32, 128, 8, 3, False, False, False, True)])


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


def exact_q8(q, seed):
    """q with the same shape whose per-row e4m3 quantization (amax / 448) is exact: e4m3 codes, each row holding a
    +-448, times a power-of-two row scale."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(q.shape, generator=g) * 60).clamp(-440, 440).to(torch.float8_e4m3fn).float()
    codes[..., 0] = 448.0
    scale = 2.0 ** torch.randint(-12, -6, q.shape[:-1] + (1,), generator=g)
    return (codes * scale).to(q.dtype).to(q.device)


@pytest.mark.parametrize("config", F8QK_CONFIGS)
@pytest.mark.parametrize("exact", [True, False])
def test_fp8_qk_prefill(config, exact):
    """PrefillTiles.fp8_qk (S = q8.K^T on FP8 operands). When q's per-row e4m3 quantization is exact it computes what
    the fp16-q kernel does (same products, fp32 sums in another order); for any q it stays within q's rounding (e4m3:
    3 mantissa bits) of the reference."""
    ctx, qlen = [70, 5, 33, LONG // 3, 40], [70, 5, 9, 1, 23]
    c = make_case(ctx, qlen, dtype=DTYPE, kv_dtype=torch.float8_e4m3fn, seed=6, **SHAPES)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    q = exact_q8(c["q"], 7) * 40 if exact else c["q"]  # x40 (exact): scores spread like the random q's
    args = (q, c["cache"], c["qsl"], c["ctx"], c["tables"], max(qlen), 0.125, *c["scales"])
    out, ref = paged_prefill(*args, config=config), pa.paged_prefill_ref(*args)
    if exact:
        fp16_q = paged_prefill(*args, config=config[:7])
        per_row = (out.float() - fp16_q.float()).norm(dim=-1) / fp16_q.float().norm(dim=-1)
        assert rel_err(out, fp16_q) < 2e-3 and per_row.max().item() < 2e-2
        assert rel_err(out, ref) < 1e-2
    else:
        per_row = (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)
        assert rel_err(out, ref) < 4e-2
        assert per_row.max().item() < 2e-1  # tiny CPU shapes (D = 32): worst row 0.126; H200 (D = 128): < 0.1


def test_fp8_qk_needs_fp8_cache():
    c = make_case([20], [20], dtype=DTYPE, kv_dtype=DTYPE, seed=8, **SHAPES)
    with pytest.raises(ValueError, match="FP8 KV"):
        paged_prefill(c["q"], c["cache"], c["qsl"], c["ctx"], c["tables"], 20, 0.125, 1.0, 1.0,
                      config=(16, 32, 4, 2, False, False, False, True))


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
    from lowbit.serve.context import StepContext
    from lowbit.serve.triton_attention import TritonAttentionBackend, leading_single_tokens

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
