"""Per-token cost of a JSON-schema logits mask on the embedded model's vocabulary (49,152 tokens), xgrammar vs
outlines-core, on one CPU thread: compile once, then per generated token fill the allowed-token mask, apply it to a
[1, V] float32 logits row and advance the grammar with the token. The tokens are those of a fixed valid JSON text.

python3 dev/scripts/structured_mask_overhead.py  (OMP_NUM_THREADS=1)
"""
import json
import time

import torch

from lowbit.models import resolve

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "poetry"],
                   "address": {"city": "London", "zip": "W1"}})


def bench_xgrammar(tok, ids, vocab):
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.zeros(1, vocab)
    t0 = time.perf_counter()
    for i in ids:
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        assert matcher.accept_token(i), i
    total = (time.perf_counter() - t0) / len(ids)
    matcher = xgr.GrammarMatcher(compiled)
    t0 = time.perf_counter()
    for i in ids:
        matcher.fill_next_token_bitmask(mask)
        matcher.accept_token(i)
    return compile_s, total, (time.perf_counter() - t0) / len(ids)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the character a byte-level BPE vocabulary writes it as."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def bench_outlines(tok, ids, vocab):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tokens: dict[bytes, list[int]] = {}
    special = set(tok.all_special_ids)
    for s, i in tok.get_vocab().items():
        if i != tok.eos_token_id and i not in special:
            tokens.setdefault(bytes(byte_of[c] for c in s), []).append(i)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), Vocabulary(tok.eos_token_id, tokens))
    compile_s = time.perf_counter() - t0
    guide = Guide(index)
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    logits = torch.zeros(1, vocab)
    t0 = time.perf_counter()
    for i in ids:
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        bits = (mask.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1  # unpack the 32-bit words
        logits.masked_fill_(bits.view(1, -1)[:, :vocab] == 0, float("-inf"))
        guide.advance(i)
    total = (time.perf_counter() - t0) / len(ids)
    guide = Guide(index)
    t0 = time.perf_counter()
    for i in ids:
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        guide.advance(i)
    return compile_s, total, (time.perf_counter() - t0) / len(ids)


def main():
    from transformers import AutoTokenizer
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(resolve("smollm2-135m"))
    ids = tok.encode(TEXT, add_special_tokens=False)
    vocab = 49152
    print(f"vocab {vocab}, {len(ids)} tokens of a valid output, 1 thread")
    for name, bench in (("xgrammar", bench_xgrammar), ("outlines-core", bench_outlines)):
        compile_s, per_token, fill = bench(tok, ids, vocab)
        print(f"{name:14s} compile {compile_s * 1e3:7.1f} ms | per token: mask + apply + advance "
              f"{per_token * 1e6:7.1f} us, mask + advance alone {fill * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
