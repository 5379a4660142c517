"""Incremental detokenization: the text streamed token by token equals the one-shot decode, and the backend fast
path gives exactly what tokenizer.decode gives."""
import random

from transformers import AutoTokenizer

from lowbit.serve.engine.detokenizer import Detokenizer, decoder


def stream(tokenizer, prompt, completion, stop, decode):
    detok = Detokenizer(tokenizer, prompt, stop, decode)
    pieces = []
    for token in completion:
        hit = detok.add(token)
        pieces.append(detok.take(hit))
        if hit:
            break
    pieces.append(detok.take(True))
    return "".join(pieces), detok.text


def test_streamed_text_equals_one_shot_decode_on_both_paths(embedded_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    fast, slow = decoder(tokenizer), (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    rng = random.Random(0)
    text = "Paged attention keeps the KV cache in blocks; café naïve 日本語 emoji 🙂 end."
    ids = tokenizer.encode(text, add_special_tokens=False)
    streamed, final = stream(tokenizer, tokenizer.encode("Once upon a time"), ids, [], fast)
    assert streamed == final == text
    for _ in range(20):  # random ids: partial characters, special tokens; both paths give the same stream
        completion = [rng.randrange(tokenizer.vocab_size) for _ in range(30)]
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(5)]
        assert stream(tokenizer, prompt, completion, [], fast) == stream(tokenizer, prompt, completion, [], slow)
    streamed, final = stream(tokenizer, [1, 2], ids, ["café"], fast)
    assert final == text[:text.index("café")] and streamed == final


def test_decode_once_gives_the_incremental_text(embedded_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    prompt = tokenizer.encode("Once upon a time")
    for text in ("Paged attention keeps the KV cache in blocks; café naïve 日本語 emoji 🙂 end.", " a b\n\nc  d"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        once = Detokenizer(tokenizer, prompt, [], once=True)
        for token in ids:
            assert once.add(token) is False and once.take(False) == ""
        assert once.take(True) == once.text == stream(tokenizer, prompt, ids, [], decoder(tokenizer))[1]
    emoji = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1  # a character split over tokens: cut short, the incomplete character is dropped
    once = Detokenizer(tokenizer, prompt, [], once=True)
    for token in tokenizer.encode("ok", add_special_tokens=False) + emoji[:-1]:
        once.add(token)
    assert once.take(True) == "ok"
    assert Detokenizer(tokenizer, prompt, ["x"], once=True).once is False  # stop strings need every step
