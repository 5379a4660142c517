"""Sliding-window serving on the engine: a windowed model's running sequences give back the KV blocks that fell out
of every layer's window (BlockManager.release_outside_window), and generate the same tokens as with no blocks freed
and as transformers' MistralForCausalLM (sliding window) — through chunked prefill, batching and overlapped steps."""
import shutil

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.serve.engine.block_manager import BlockManager
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.engine.sequence import Sequence
from lowbit.serve.layers.attention import Attention
from lowbit.serve.models import ARCHITECTURES
from lowbit.serve.models.llama import LlamaForCausalLM
from lowbit.serve.runner.loader import kv_window

torch.set_num_threads(1)
WINDOW, BS, CHUNK = 12, 4, 16
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
            sliding_window=WINDOW, tie_word_embeddings=False)


class WindowedLlama(LlamaForCausalLM):
    """Test-only stand-in for a Mistral model file: the Llama blocks with every layer windowed (config's
    sliding_window), which is Mistral's architecture."""

    def __init__(self, config: dict):
        super().__init__(config)
        for m in self.modules():
            if isinstance(m, Attention):
                m.sliding_window = config["sliding_window"]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(checkpoint dir, HF model): a tiny random MistralForCausalLM saved as an HF checkpoint."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**TINY)).eval()
    path = tmp_path_factory.mktemp("mistral")
    model.save_pretrained(path)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return path, model


@pytest.fixture
def served_arch(monkeypatch):
    if "MistralForCausalLM" not in ARCHITECTURES:  # until the Mistral model file exists
        monkeypatch.setitem(ARCHITECTURES, "MistralForCausalLM", WindowedLlama)


PROMPTS = [[(7 * i + 3) % 250 + 5 for i in range(n)] for n in (5, 30, 50)]
NEW = 40


def run(path, release: bool, overlap: bool, prompts=PROMPTS, new=NEW) -> tuple[list[list[int]], int]:
    """Greedy tokens of the prompts and the most KV blocks in use after any step."""
    engine = Engine(path, EngineConfig(max_batch_size=4, max_num_tokens=CHUNK, num_kv_blocks=64, block_size=BS,
                                       device="cpu", dtype="float32", overlap_steps=overlap))
    assert engine.block_manager.sliding_window == WINDOW
    if not release:
        engine.block_manager.sliding_window = None
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    tokens, peak = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        peak = max(peak, engine.block_manager.num_used_blocks)
    assert engine.block_manager.num_used_blocks == 0 and not engine.block_manager.released
    return [tokens[str(i)] for i in range(len(prompts))], peak


@pytest.mark.parametrize("overlap", [False, True])
def test_windowed_generation_frees_blocks_and_equals_transformers(mistral, served_arch, overlap):
    path, hf = mistral
    expected = []
    for ids in PROMPTS:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    freed, peak = run(path, release=True, overlap=overlap)
    kept, peak_kept = run(path, release=False, overlap=overlap)
    assert freed == kept == expected
    # per sequence: the window, the step's new tokens, and one partly filled block at either end (+1 step of lag
    # for commits under overlap); without freeing every sequence holds its whole history
    bound = len(PROMPTS) * (-(-(WINDOW + CHUNK) // BS) + 3)
    assert peak <= bound < peak_kept, (peak, bound, peak_kept)


def test_a_long_generation_holds_a_bounded_number_of_blocks(mistral, served_arch):
    """200 tokens after a 10-token prompt: the window's blocks (plus a partly filled one at each end), not 53."""
    path, _ = mistral
    freed, peak = run(path, release=True, overlap=False, prompts=[PROMPTS[0] * 2], new=200)
    kept, peak_kept = run(path, release=False, overlap=False, prompts=[PROMPTS[0] * 2], new=200)
    assert freed == kept
    assert peak <= -(-WINDOW // BS) + 2 and peak_kept >= 210 // BS - 1  # all but the last token computed


def test_kv_window_is_the_largest_window_and_none_with_any_global_layer():
    model = torch.nn.Sequential(Attention(2, 1, 8, sliding_window=4), Attention(2, 1, 8, sliding_window=9))
    assert kv_window(model) == 9
    model.append(Attention(2, 1, 8))
    assert kv_window(model) is None
    assert kv_window(torch.nn.Linear(2, 2)) is None


def _sequence(n_tokens: int) -> Sequence:
    return Sequence(list(range(100, 100 + n_tokens)), SamplingParams(max_tokens=1))


@pytest.mark.parametrize("caching", [True, False])
def test_block_manager_releases_blocks_before_the_window_and_keeps_table_positions(caching):
    bm = BlockManager(32, block_size=4, enable_prefix_caching=caching, sliding_window=6)
    seq = _sequence(40)
    bm.allocate(seq, [], 16)
    seq.num_computed_tokens = 16
    bm.commit(seq)
    table = list(seq.block_table)
    bm.release_outside_window(seq)  # next query at 16 sees keys 11..16: blocks 0, 1 (tokens 0..7) are out
    assert seq.block_table == table and bm.released[seq.seq_id][0] == 2
    assert bm.num_used_blocks == 2
    bm.release_outside_window(seq)  # idempotent
    assert bm.num_used_blocks == 2
    bm.append(seq, 8)
    seq.num_computed_tokens = 24
    bm.commit(seq)
    bm.release_outside_window(seq)  # next query at 24 sees 19..: blocks 0..3 out
    assert bm.num_used_blocks == 2 and seq.block_table[:4] == table
    bm.deallocate(seq)
    assert bm.num_free_blocks == 32 and not bm.released


def test_released_blocks_keep_the_hash_chain_for_prefix_reuse():
    """Blocks committed after earlier ones were released chain to the released block's hash: a later prompt with
    the same prefix still finds every block that is not yet handed out again."""
    bm = BlockManager(32, block_size=4, sliding_window=5)
    plain = BlockManager(32, block_size=4)
    for m in (bm, plain):
        seq = _sequence(40)
        m.allocate(seq, [], 4)
        for done in range(4, 25, 4):  # one block per step, released as the window passes
            seq.num_computed_tokens = done
            m.commit(seq)
            m.release_outside_window(seq)
            m.append(seq, 4)
        m.deallocate(seq)
    assert bm.hash_to_block_id.keys() == plain.hash_to_block_id.keys()
    assert len(bm.match_prefix(_sequence(40))) == len(plain.match_prefix(_sequence(40))) == 6
