"""Incremental detokenization and stop strings for one sequence.

Decodes a short window of ids at a time (a few prompt tokens as left context, so that a leading space or a
multi-byte character split across tokens comes out right) and holds back text that could still become a stop
string, so that a stop string never reaches a client. A request nobody streams and without stop strings decodes
once, when it finishes (`once=True`): the same text for whole characters; a trailing incomplete one is dropped.
"""
CONTEXT_TOKENS = 6


def decoder(tokenizer):
    """ids -> text as tokenizer.decode(ids, skip_special_tokens=True) gives it. A fast tokenizer without space
    clean-up is called through its Rust backend directly: the same text, without ~4 us of Python per call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if getattr(tokenizer, "is_fast", False) and backend is not None and not tokenizer.clean_up_tokenization_spaces:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], decode=None, once: bool = False):
        """decode: `decoder(tokenizer)`, built once per tokenizer and shared (default: built here).
        once: no text until finished, then one decode (only without stop strings)."""
        self._decode = decode or decoder(tokenizer)
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.once = once and not stop
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_emitted = 0  # characters of self.text already returned by take()

    def add(self, token_id: int) -> bool:
        """Appends a token; returns True when the text now contains a stop string (it is cut off there)."""
        self.ids.append(token_id)
        if self.once:
            return False
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False  # an incomplete character: wait for the next token
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def take(self, finished: bool) -> str:
        """New text that is safe to send: all of it when finished, else all but the stop-string holdback."""
        if self.once and finished and len(self.ids) > self.read_offset:
            self._decode_once()
        end = len(self.text) if finished else max(self.num_emitted, len(self.text) - self.holdback)
        out = self.text[self.num_emitted:end]
        self.num_emitted = end
        return out

    def _decode_once(self) -> None:
        before = self._decode(self.ids[:self.read_offset])
        self.text = self._decode(self.ids)[len(before):].rstrip("\ufffd")
        self.read_offset = len(self.ids)
