"""A decode step's inputs into the CUDA graphs' static buffers in one launch: the step's uploaded arrays copied
(block-table rows into the graphs' wider rows), the tokens the previous step sampled on the device merged in, and
the padding rows past the batch set to store nothing. Replaces ~10 small copies and merge ops per step (~26 us of
device time at batch 1 on the H200). The verify graphs (runner/verify_graphs.py) load q tokens per sequence
(tokens_per_row) the same way: token arrays [b * q], sequence row i's tokens at [i * q, (i + 1) * q)."""
from functools import partial

import torch

from lowbit.kernels._triton import kernel, tl, use_triton, wait_for_producers

_TABLE_BLOCK = 256  # block-table entries per copy step


def merge_pending(ids: torch.Tensor, source: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
    """ids [T] with token t taken from pending[source[t]] where source[t] >= 0 (a token sampled on the device)."""
    return torch.where(source >= 0, pending[source.clamp(min=0)], ids)


def load_decode_inputs_ref(ids, positions, slots, source, pending, context_lens, tables, out: dict,
                           tokens_per_row: int = 1) -> None:
    """q = tokens_per_row. ids, positions, slots, source [b * q] int64; context_lens [b] int32; tables [b, w] int32;
    pending: the previous step's sampled tokens (int64 [S]) or None. out: the static buffers "input_ids",
    "positions", "slot_mapping" [bs * q] int64, "context_lens" [bs] int32, "block_tables" [bs, W >= w] int32, bs >= b.
    Row i < b takes the step's values (tokens [i * q, (i + 1) * q)), a token from pending[source[t]] when
    source[t] >= 0 (pending given), and tables[i] in its first w entries (the rest keeps older entries: kernels read
    only the first context_lens[i] keys). Padding rows b..bs store nothing (slot -1) and attend to q keys (context
    length q: one key per new token, so a q-token query has a key at every position)."""
    (b, w), n = tables.shape, tables.shape[0] * tokens_per_row
    out["input_ids"][:n] = ids if pending is None else merge_pending(ids, source, pending)
    out["positions"][:n] = positions
    out["slot_mapping"][:n] = slots
    out["slot_mapping"][n:] = -1
    out["context_lens"][:b] = context_lens
    out["context_lens"][b:] = tokens_per_row
    out["block_tables"][:b, :w] = tables


@partial(kernel, do_not_specialize=("b", "w", "q"))  # any batch, table width and q: one compiled variant
def _load_kernel(ids_ptr, pos_ptr, slot_ptr, src_ptr, pending_ptr, lens_ptr, tables_ptr, out_ids, out_pos,
                 out_slots, out_lens, out_tables, b, w, q, out_table_stride, HAS_PENDING: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program i: row i of the static buffers (its q tokens, context length and block table)."""
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    if row < b:
        for j in range(q):
            t = row * q + j
            token = tl.load(ids_ptr + t)
            if HAS_PENDING:
                src = tl.load(src_ptr + t)
                if src >= 0:
                    token = tl.load(pending_ptr + src)
            tl.store(out_ids + t, token)
            tl.store(out_pos + t, tl.load(pos_ptr + t))
            tl.store(out_slots + t, tl.load(slot_ptr + t))
        tl.store(out_lens + row, tl.load(lens_ptr + row))
        for start in range(0, w, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            keep = cols < w
            entries = tl.load(tables_ptr + row * w + cols, mask=keep)
            tl.store(out_tables + row * out_table_stride + cols, entries, mask=keep)
    else:
        for j in range(q):
            tl.store(out_slots + row * q + j, -1)
        tl.store(out_lens + row, q)


def load_decode_inputs(ids, positions, slots, source, pending, context_lens, tables, out: dict,
                       tokens_per_row: int = 1) -> None:
    """load_decode_inputs_ref's contract, one launch (Triton) for CUDA tensors or under the interpreter (source is
    not read without pending)."""
    if not use_triton(ids):
        return load_decode_inputs_ref(ids, positions, slots, source, pending, context_lens, tables, out,
                                      tokens_per_row)
    b, w = tables.shape
    o_tables = out["block_tables"]
    assert tables.is_contiguous() and o_tables.stride(1) == 1 and o_tables.shape[1] >= w, (tables.shape, o_tables.shape)
    bs = out["context_lens"].shape[0]
    _load_kernel[(bs,)](ids, positions, slots, source, ids if pending is None else pending, context_lens, tables,
                        out["input_ids"], out["positions"], out["slot_mapping"], out["context_lens"], o_tables,
                        b, w, tokens_per_row, o_tables.stride(0), HAS_PENDING=pending is not None, BLOCK=_TABLE_BLOCK, num_warps=1)
