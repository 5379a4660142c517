"""N-gram prompt lookup: the tokens that followed the latest earlier occurrence of a sequence's last n tokens."""
import numpy as np

from lowbit.serve.engine.sequence import Sequence


class NgramDrafter:
    """Proposes, for each sequence, up to k tokens copied from its own history (prompt and output): the longest
    suffix of length n..1 that occurred before, at its most recent occurrence. A deterministic proposal."""

    def __init__(self, ngram_size: int):
        assert ngram_size >= 1
        self.n = ngram_size

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """limits[i]: at most that many tokens for seqs[i] (0: none)."""
        return [lookup(s.token_ids, self.n, k) if k > 0 else [] for s, k in zip(seqs, limits)]

    def after_verify(self, seqs: list[Sequence]) -> None:
        """Nothing kept per sequence."""

    def release(self, seq: Sequence) -> None:
        """Nothing kept per sequence."""

    def gauges(self) -> dict:
        return {}


def lookup(token_ids: list[int], n: int, k: int) -> list[int]:
    """Up to k tokens following the most recent earlier occurrence of the last m tokens (m = n, n-1, ..., 1: the
    longest that occurs); [] when none occurs. An occurrence must be followed by at least one token."""
    length = len(token_ids)
    if length < 2:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    # candidate ends: positions e < length - 1 whose token equals the last one (e + 1 is then a continuation)
    ends = np.flatnonzero(ids[:length - 1] == ids[-1])[::-1]  # most recent first
    for m in range(min(n, length - 1), 0, -1):
        for e in ends.tolist():
            if e + 1 >= m and token_ids[e + 1 - m:e + 1] == token_ids[length - m:]:
                return token_ids[e + 1:e + 1 + k]
    return []
