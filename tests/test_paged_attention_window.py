"""The paged decode (split context) and prefill/extend kernels with a sliding window and logit soft-capping against
paged_decode_ref / paged_prefill_ref (themselves checked against transformers in test_attention_window.py): windows
smaller than the context, FP8 and model-dtype caches, grouped-query heads, several context splits; and the blocks
wholly before the window are never read (poisoned with NaN, the output is unchanged).

CPU: the Triton interpreter at tiny shapes in fp16 (bf16 tl.dot is wrong there). GPU: bf16 at Llama-8B heads.
"""
import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels import tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.attention import paged_attention as pa  # noqa: E402
from lowbit.kernels.attention.paged_prefill import paged_prefill  # noqa: E402
from tests.test_paged_attention import DEVICE, DTYPE, SHAPES, make_case, rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not interpreting(),
                                reason="needs a GPU or the Triton interpreter (TRITON_INTERPRET=1 before triton)")
BS = SHAPES["bs"]
TOL = 1e-2  # relative L2 error, as the plain kernels' tests
WINDOWS = [(3, None), (2 * BS + 1, None), (2 * BS + 1, 2.0), (None, 1.5)]  # (window, softcap)


def _poison_before_window(c, ctx_lens, first_pos, window):
    """NaN into every block that ends before the first query's window (blocks a window may free)."""
    for b, (n, p) in enumerate(zip(ctx_lens, first_pos)):
        dead = max(0, p - window + 1) // BS
        if dead:
            c["cache"][:, c["tables"][b, :dead].long()] = float("nan")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("window,softcap", WINDOWS)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_window_softcap_matches_reference(fp8, window, softcap, splits):
    kv_dtype = torch.float8_e4m3fn if fp8 else DTYPE
    ctx = [1, 17, 70, 45]
    c = make_case(ctx, [1] * len(ctx), dtype=DTYPE, kv_dtype=kv_dtype, seed=11, **SHAPES)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    args = (c["q"], c["cache"], c["tables"], c["ctx"], 0.125, *c["scales"])
    kw = dict(sliding_window=window, logit_softcap=softcap)
    ref = pa.paged_decode_ref(*args, **kw)
    if window is not None:
        assert rel_err(pa.paged_decode_ref(*args, logit_softcap=softcap), ref) > 0.05  # the window matters here
        _poison_before_window(c, ctx, [n - 1 for n in ctx], window)
    out = pa.paged_decode(*args, num_splits=splits, **kw)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("name", list(tuning.current().decode_variants))
def test_decode_window_in_every_variant(name):
    """Row-by-row (model-dtype) and block-by-block tiles, tiles of 32 tokens so a window spans several."""
    variant = tuning.current().decode_variants[name]
    variant = variant if DEVICE == "cuda" else variant._replace(block_n=min(variant.block_n, 32))
    fp8 = variant.blocks
    ctx = [5, 90, 64]
    c = make_case(ctx, [1] * 3, dtype=DTYPE, kv_dtype=torch.float8_e4m3fn if fp8 else DTYPE, seed=12, **SHAPES)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    args = (c["q"], c["cache"], c["tables"], c["ctx"], 0.125, *c["scales"])
    ref = pa.paged_decode_ref(*args, sliding_window=41, logit_softcap=3.0)
    _poison_before_window(c, ctx, [n - 1 for n in ctx], 41)
    for splits in (1, 2):
        out = pa.paged_decode(*args, num_splits=splits, variant=variant, sliding_window=41, logit_softcap=3.0)
        assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_prefill_and_extend_window_softcap_match_reference(fp8, window, softcap):
    kv_dtype = torch.float8_e4m3fn if fp8 else DTYPE
    ctx, qlen = [70, 5, 40, 33], [70, 5, 9, 1]  # whole prompts, chunks after cached tokens, a decode row
    c = make_case(ctx, qlen, dtype=DTYPE, kv_dtype=kv_dtype, seed=13, **SHAPES)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    args = (c["q"], c["cache"], c["qsl"], c["ctx"], c["tables"], max(qlen), 0.125, *c["scales"])
    kw = dict(sliding_window=window, logit_softcap=softcap)
    ref = pa.paged_prefill_ref(*args, **kw)
    if window is not None:
        assert rel_err(pa.paged_prefill_ref(*args, logit_softcap=softcap), ref) > 0.05
        _poison_before_window(c, ctx, [n - q for n, q in zip(ctx, qlen)], window)
    out = paged_prefill(*args, **kw)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref) < TOL


def test_backend_passes_window_and_softcap_to_both_kernels():
    """A mixed step through TritonAttentionBackend: decode rows and prefill rows both windowed and capped."""
    from lowbit.serve.layers.triton_attention import TritonAttentionBackend
    from lowbit.serve.runner.context import StepContext

    ctx, qlen = [33, 60, 40], [1, 1, 12]
    c = make_case(ctx, qlen, dtype=DTYPE, kv_dtype=torch.float8_e4m3fn, seed=14, **SHAPES)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    step = StepContext(positions=None, slot_mapping=None, query_start_loc=c["qsl"], context_lens=c["ctx"],
                       block_tables=c["tables"], logits_indices=None, is_decode=False, query_lens_cpu=qlen,
                       context_lens_cpu=ctx)
    kw = dict(sliding_window=7, logit_softcap=2.5)
    out = TritonAttentionBackend.attend(c["q"], c["cache"], step, 0.125, *c["scales"], **kw)
    ref = pa.paged_prefill_ref(c["q"], c["cache"], c["qsl"], c["ctx"], c["tables"], 12, 0.125, *c["scales"], **kw)
    assert rel_err(out, ref) < TOL
