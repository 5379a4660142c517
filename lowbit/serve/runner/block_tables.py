"""The running sequences' block tables as one padded int32 array, updated in place step by step."""
import numpy as np

# Block tables go to the kernels this many entries wide (a multiple): the attention kernels take the row stride as an
# int argument, which Triton specializes on divisibility by 16, so a width that only grows would compile a new kernel
# variant (~1 s, mid-run) the first step the longest table reaches 16 * k blocks.
TABLE_WIDTH_MULTIPLE = 16


class BlockTables:
    """The running sequences' block tables as one padded int32 array kept across steps: a row per sequence of the
    last step, into which a step writes only the blocks a sequence gained. Relies on BlockManager's contract that a
    held block_table only grows by append (a new allocation is a new list)."""

    def __init__(self, rows: int, cols: int, multiple: int = TABLE_WIDTH_MULTIPLE, kind: int = 0):
        self.kind = kind  # which of a sequence's block_tables (one per layer kind) this holds
        self.array = np.zeros((rows, cols), np.int32)
        self.multiple = multiple  # the width handed out is a multiple of this
        self.free = list(range(rows - 1, -1, -1))  # rows held by no sequence, popped from the end
        self.entries: dict[int, list] = {}  # seq_id -> [row, the block_table list written from, blocks written]

    def gather(self, seqs: list) -> np.ndarray:
        """[len(seqs), longest table rounded up to `multiple`] int32, padded with 0. Sequences absent from this step
        give up their rows."""
        old, self.entries = self.entries, {}
        rows, width = [], 1
        for seq in seqs:
            entry = self.entries[seq.seq_id] = old.pop(seq.seq_id, None) or [self._free_row(), None, 0]
            row, table = entry[0], seq.block_tables[self.kind] if self.kind else seq.block_table
            if entry[1] is not table:  # allocated anew (first step, or after a preemption)
                entry[1], entry[2] = table, 0
                self.array[row] = 0
            if entry[2] < len(table):
                self._write(row, table, entry[2])
                entry[2] = len(table)
            rows.append(row)
            width = max(width, len(table))
        self.free += [entry[0] for entry in old.values()]
        width = -(-width // self.multiple) * self.multiple
        if width > self.array.shape[1]:
            self.array = np.pad(self.array, ((0, 0), (0, width - self.array.shape[1])))
        return self.array[rows, :width]

    def _write(self, row: int, table: list[int], start: int) -> None:
        if len(table) > self.array.shape[1]:
            self.array = np.pad(self.array, ((0, 0), (0, len(table))))
        self.array[row, start:len(table)] = table[start:]

    def _free_row(self) -> int:
        if not self.free:
            n = len(self.array)
            self.array = np.pad(self.array, ((0, max(n, 1)), (0, 0)))
            self.free = list(range(len(self.array) - 1, n - 1, -1))
        return self.free.pop()
