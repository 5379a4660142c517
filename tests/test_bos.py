"""Each tokenizer's own special-token convention (BOS when it adds one) in calibration batches, perplexity windows,
lm-eval requests (in process and through the server) and served prompts; the embedded tokenizer adds none, so its
batches are pinned to what they were."""
import hashlib
import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lowbit.calibrate.data import builtin_texts, load_texts, special_prefix, token_batches
from lowbit.evaluate.perplexity import NUM_SEQS, SEQ_LEN, heldout_sequences
from lowbit.models import DEFAULT_MODEL, resolve

# sha256 of json.dumps([held-out boolq 4 x 512, calibration boolq 8 x 128]) with the embedded tokenizer
PINNED = "1191ef5dc1e687d7ad8686bfe6c75b77075cfecc47e046756dce26dfc556cb15"


@pytest.fixture(scope="module")
def plain():
    return AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory):
    """The embedded tokenizer made Llama-style: it adds its BOS (<|im_start|>, id 1) by default."""
    path = tmp_path_factory.mktemp("bos-tokenizer")
    AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL), add_bos_token=True).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bos(bos_dir):
    tok = AutoTokenizer.from_pretrained(bos_dir)
    assert tok("hello world").input_ids == [tok.bos_token_id] + tok("hello world", add_special_tokens=False).input_ids
    return tok


def test_embedded_tokenizer_batches_are_unchanged(plain):
    assert special_prefix(plain) == []
    heldout = token_batches(plain, builtin_texts("boolq", "heldout"), 4, 512, seed=0)
    calib = token_batches(plain, load_texts("builtin:boolq"), 8, 128, seed=0)
    assert hashlib.sha256(json.dumps([heldout, calib]).encode()).hexdigest() == PINNED


def test_bos_once_per_calibration_sequence(plain, bos):
    assert special_prefix(bos) == [bos.bos_token_id]
    texts = load_texts("builtin:boolq")
    with_bos, without = token_batches(bos, texts, 8, 128, seed=0), token_batches(plain, texts, 8, 128, seed=0)
    assert all(len(s) == 128 and s[0] == bos.bos_token_id and bos.bos_token_id not in s[1:] for s in with_bos)
    # the same text stream, 127 tokens per sequence after the BOS
    assert [t for s in with_bos for t in s[1:]] == [t for s in without for t in s][:8 * 127]


def test_bos_once_per_perplexity_window(bos):
    seqs = heldout_sequences(bos, NUM_SEQS)
    assert len(seqs) == 2 * NUM_SEQS
    for _, ids in seqs:
        assert len(ids) == SEQ_LEN and ids[0] == bos.bos_token_id and bos.bos_token_id not in ids[1:]


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)).eval()


def test_eval_requests_start_with_bos_once(bos, bos_dir, plain, tiny_model):
    from lowbit.evaluate.harness import inproc_lm, server_lm

    context, continuation = "Question: is the sky blue?\nAnswer:", " yes"
    plain_ctx = plain(context).input_ids
    lms = [inproc_lm(tiny_model, bos), server_lm("http://127.0.0.1:9", "m", str(bos_dir))]
    for lm in lms:
        ctx, cont = lm._encode_pair(context, continuation)
        assert ctx == [bos.bos_token_id] + plain_ctx, type(lm).__name__
        assert cont == plain(" yes").input_ids
    plain_lm = server_lm("http://127.0.0.1:9", "m", str(resolve(DEFAULT_MODEL)))
    assert plain_lm._encode_pair(context, continuation)[0] == plain_ctx


def test_served_prompt_gets_bos_as_the_tokenizer_gives_it(bos_dir, bos, tmp_path):
    import asyncio
    import shutil

    from lowbit.serve import EngineConfig, SamplingParams
    from lowbit.serve.engine.engine import Engine
    from lowbit.serve.server.inputs import PromptProcessor

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    for f in bos_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    engine = Engine(str(tmp_path), EngineConfig(num_kv_blocks=8))
    prompt = "The capital of France is"
    expected = bos(prompt).input_ids
    assert expected[0] == bos.bos_token_id and expected.count(bos.bos_token_id) == 1
    served = asyncio.run(PromptProcessor(engine).completion([prompt]))
    assert served[0][0] == expected
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))  # LLM.generate's path for text prompts
    assert engine.scheduler.waiting[0].token_ids == expected
