"""N-gram prompt lookup: the tokens that followed the latest earlier occurrence of a sequence's last n tokens."""
from lowbit.serve.engine.sequence import Sequence

# the shortest suffix looked up (unless ngram_size is 1): a single-token match is weak evidence in a large vocabulary;
# replayed on the embedded model's greedy chat text it drafted mostly rejected tokens (dev/bench/spec_policy_sim.py)
MIN_MATCH = 2


class NgramIndex:
    """One sequence's history as a map from each m-gram (m = 1..n) to the end of its most recent occurrence that a
    token follows. Updated with the tokens appended since the last lookup, so a lookup costs O(n + new tokens), not
    O(history). Relies on the history only growing between lookups (drafts are appended and removed within a step,
    after the lookup)."""

    def __init__(self, n: int):
        self.n = n
        self.last: dict[tuple[int, ...], int] = {}  # m-gram -> end position e (token e + 1 follows it)
        self.indexed = 0  # m-grams ending before this position are in `last`

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens following the most recent earlier occurrence of the last m tokens (m = n, n-1, ...,
        MIN_MATCH (1 when n is): the longest that occurs); [] when none occurs."""
        length, n, last = len(token_ids), self.n, self.last
        for e in range(self.indexed, length - 1):  # every end with a token after it
            for m in range(1, min(n, e + 1) + 1):
                last[tuple(token_ids[e + 1 - m:e + 1])] = e
        self.indexed = max(self.indexed, length - 1)
        for m in range(min(n, length - 1), min(n, MIN_MATCH) - 1, -1):
            e = last.get(tuple(token_ids[length - m:]))
            if e is not None:
                return token_ids[e + 1:e + 1 + k]
        return []


def lookup(token_ids: list[int], n: int, k: int) -> list[int]:
    """One lookup without a kept index (NgramIndex.propose on a fresh index)."""
    return NgramIndex(n).propose(token_ids, k)


class NgramDrafter:
    """Proposes, for each sequence, up to k tokens copied from its own history (prompt and output): the longest
    suffix of length n..MIN_MATCH that occurred before, at its most recent occurrence. A deterministic proposal. Keeps an
    NgramIndex per running sequence."""

    def __init__(self, ngram_size: int):
        assert ngram_size >= 1
        self.n = ngram_size
        self.indexes: dict[int, NgramIndex] = {}  # by seq_id

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """limits[i]: at most that many tokens for seqs[i] (0: none). Every token of seqs is on the host."""
        out = []
        for s, k in zip(seqs, limits):
            index = self.indexes.get(s.seq_id)
            if index is None:
                index = self.indexes[s.seq_id] = NgramIndex(self.n)
            out.append(index.propose(s.token_ids, k) if k > 0 else [])
        return out

    def after_verify(self, seqs: list[Sequence]) -> None:
        """Nothing to do: an index catches up at its next lookup."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: its index goes."""
        self.indexes.pop(seq.seq_id, None)

    def gauges(self) -> dict:
        return {}
