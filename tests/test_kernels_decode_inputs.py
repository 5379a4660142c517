"""The decode graphs' input load (lowbit.kernels.ops.decode_inputs): the Triton kernel (CPU interpreter, or the GPU)
writes exactly what its torch reference writes into static buffers that already hold an earlier step's values."""
import pytest
import torch

from lowbit.kernels._triton import HAS_TRITON, interpreting
from lowbit.kernels.ops.decode_inputs import load_decode_inputs, load_decode_inputs_ref

DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON or (DEVICE == "cpu" and not interpreting()),
                                reason="needs the Triton interpreter or a GPU")


def static_buffers(bs: int, width: int, g: torch.Generator) -> dict:
    """Buffers as an earlier, larger step left them (random values everywhere)."""
    def rand(*shape, dtype=torch.int64):
        return torch.randint(0, 1000, shape, generator=g).to(dtype)
    return {"input_ids": rand(bs), "positions": rand(bs), "slot_mapping": rand(bs),
            "context_lens": rand(bs, dtype=torch.int32), "block_tables": rand(bs, width, dtype=torch.int32)}


def step_arrays(b: int, w: int, samples: int, g: torch.Generator):
    ids = torch.randint(0, 50000, (b,), generator=g)
    source = torch.randint(-1, samples, (b,), generator=g) if samples else torch.full((b,), -1)
    pending = torch.randint(50000, 60000, (samples,), generator=g) if samples else None
    return (ids, torch.randint(0, 4000, (b,), generator=g), torch.randint(0, 9000, (b,), generator=g), source, pending,
            torch.randint(1, 4000, (b,), generator=g, dtype=torch.int32),
            torch.randint(0, 500, (b, w), generator=g, dtype=torch.int32))


@pytest.mark.parametrize("b,bs,w,width,samples", [(1, 1, 16, 16, 1), (3, 4, 16, 64, 5), (5, 8, 272, 512, 0),
                                                  (8, 8, 32, 32, 8)])
def test_kernel_writes_what_the_reference_writes(b, bs, w, width, samples):
    """Batches below and at the graph's size, tables narrower than the static rows and wider than one 256-entry
    copy step, with and without tokens pending on the device (some rows from the host, some from the samples)."""
    g = torch.Generator().manual_seed(b * 100 + w)
    before = static_buffers(bs, width, g)
    arrays = [a.to(DEVICE) if a is not None else None for a in step_arrays(b, w, samples, g)]
    want = {k: v.clone() for k, v in before.items()}
    load_decode_inputs_ref(*[a.cpu() if a is not None else None for a in arrays], want)
    got = {k: v.clone().to(DEVICE) for k, v in before.items()}
    load_decode_inputs(*arrays, got)
    for name in want:
        assert torch.equal(got[name].cpu(), want[name]), name


def test_reference_merges_pending_tokens_and_pads():
    """What the reference promises, spelled out on one small case."""
    out = {"input_ids": torch.zeros(4, dtype=torch.int64), "positions": torch.zeros(4, dtype=torch.int64),
           "slot_mapping": torch.zeros(4, dtype=torch.int64), "context_lens": torch.zeros(4, dtype=torch.int32),
           "block_tables": torch.full((4, 32), 7, dtype=torch.int32)}
    load_decode_inputs_ref(torch.tensor([10, 11]), torch.tensor([5, 6]), torch.tensor([40, 41]), torch.tensor([1, -1]),
                           torch.tensor([90, 91]), torch.tensor([6, 7], dtype=torch.int32),
                           torch.ones(2, 16, dtype=torch.int32), out)
    assert out["input_ids"][:2].tolist() == [91, 11] and out["slot_mapping"].tolist() == [40, 41, -1, -1]
    assert out["context_lens"].tolist() == [6, 7, 1, 1] and out["positions"][:2].tolist() == [5, 6]
    assert (out["block_tables"][:2, :16] == 1).all() and (out["block_tables"][:2, 16:] == 7).all()
    assert (out["block_tables"][2:] == 7).all()


def multi_token_step(b: int, q: int, w: int, samples: int, g: torch.Generator):
    """step_arrays with q tokens per sequence: token arrays [b * q], per-sequence arrays [b]."""
    ids, positions, slots, source, pending, lens, tables = step_arrays(b * q, w, samples, g)
    return ids, positions, slots, source, pending, lens[:b], tables[:b]


@pytest.mark.parametrize("b,bs,q,samples", [(1, 1, 2, 0), (3, 4, 5, 4), (2, 8, 9, 0)])
def test_kernel_writes_what_the_reference_writes_for_q_tokens_per_row(b, bs, q, samples):
    """The verify graphs' load: q tokens per row, padding rows' q slots skipped."""
    g = torch.Generator().manual_seed(b * 10 + q)
    before = static_buffers(bs * q, 64, g)
    before["context_lens"], before["block_tables"] = before["context_lens"][:bs], before["block_tables"][:bs]
    arrays = [a.to(DEVICE) if a is not None else None for a in multi_token_step(b, q, 16, samples, g)]
    want = {k: v.clone() for k, v in before.items()}
    load_decode_inputs_ref(*[a.cpu() if a is not None else None for a in arrays], want, tokens_per_row=q)
    got = {k: v.clone().to(DEVICE) for k, v in before.items()}
    load_decode_inputs(*arrays, got, tokens_per_row=q)
    for name in want:
        assert torch.equal(got[name].cpu(), want[name]), name
    assert (want["slot_mapping"][b * q:] == -1).all() and (want["context_lens"][b:] == q).all()
    assert torch.equal(want["positions"][:b * q], arrays[1].cpu())
