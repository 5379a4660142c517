"""The verify step's CUDA graphs (runner/verify_graphs.py), checked on the CPU: the padded layout, which (batch size,
q) graph a step takes or eager, and speculative decoding through the graphs' static, padded buffers (the replay
emulated by running the captured forward on those buffers) giving the eager verify step's logits and tokens."""
import numpy as np
import pytest
import torch

from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.runner.model_runner import HostInputs
from lowbit.serve.runner.verify_graphs import VerifyGraphs, pad_rows
from test_serve_host_path import tiny_engine
from test_serve_spec import GREEDY, PROMPTS, generate

torch.set_num_threads(1)


def host_inputs(counts, context_lens, width=1, pending_source=None, logits_indices=None) -> HostInputs:
    """A multi-token step: token t of sequence i has id 1000 * i + t, position context - count + t, slot 10 * id."""
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    ids = np.concatenate([1000 * i + np.arange(c) for i, c in enumerate(counts)]).astype(np.int64)
    positions = np.concatenate([np.arange(n - c, n) for c, n in zip(counts, context_lens)]).astype(np.int64)
    rows = np.arange(qsl[-1]) if logits_indices is None else np.array(logits_indices, np.int64)
    return HostInputs(ids, positions, 10 * ids, rows, pending_source, qsl, np.array(context_lens, np.int32),
                      np.zeros((len(counts), width), np.int32), False, list(counts), list(context_lens))


def test_pad_rows_pads_each_sequence_at_the_back():
    host = host_inputs([3, 1, 2], [10, 5, 7], pending_source=np.array([-1, -1, 4, 2, -1, -1]),
                       logits_indices=[2, 3, 4, 5])
    p = pad_rows(host, 3)
    assert p.input_ids.tolist() == [0, 1, 2, 1000, 1000, 1000, 2000, 2001, 2001]
    assert p.slot_mapping.tolist() == [0, 10, 20, 10000, -1, -1, 20000, 20010, -1]
    assert p.positions.tolist() == [7, 8, 9, 4, 4, 4, 5, 6, 6]  # padding: the sequence's last position
    assert p.pending_source.tolist() == [-1, -1, 4, 2, 2, 2, -1, -1, -1]  # padding copies its last token
    assert p.context_lens.tolist() == [10, 7, 8]  # real tokens keep context - count + j as their position
    assert p.gather.tolist() == [2, 3, 6, 7]  # the wanted rows in the padded layout


class Fake(torch.nn.Module):
    def forward(self, ids, ctx):
        return torch.zeros(ids.shape[0], 2)

    def compute_logits(self, h):
        return h[:, :1].expand(-1, 5).float()


def test_graph_keys_bucket_batches_and_q_and_fall_back_to_eager():
    g = VerifyGraphs(Fake(), 6, (2, 3, 5), 4, block_size=4, device=torch.device("cpu"), sizes=(1, 2, 4))
    assert g.sizes == [1, 2, 4, 6] and g.tokens == [2, 3, 5]
    assert g.key(host_inputs([2, 1, 2], [9, 9, 9])) == (4, 2)
    assert g.key(host_inputs([4, 1], [9, 9])) == (2, 5)  # q rounds up to a captured one
    assert g.key(host_inputs([2] * 6, [9] * 6)) == (6, 2)
    assert g.key(host_inputs([2] * 7, [9] * 7)) is None  # more sequences than the largest graph
    assert g.key(host_inputs([6, 1], [9, 9])) is None  # more tokens than the largest q
    assert g.key(host_inputs([5, 1], [16, 12])) == (2, 5)  # padded context 16 = 4 blocks of 4: fits
    assert g.key(host_inputs([5, 1], [16, 13])) is None  # padded context 17 needs a fifth table entry
    assert g.key(host_inputs([2, 1], [9, 9], width=5)) is None  # tables wider than the static ones
    decode = host_inputs([1, 1], [9, 9])
    decode.is_decode = True
    assert g.key(decode) is None  # the decode graphs' step


class EmulatedGraph:
    """replay() = the captured forward, run eagerly on the same static buffers."""

    def __init__(self, graphs: VerifyGraphs, key: tuple[int, int]):
        self.graphs, self.key = graphs, key

    def replay(self):
        self.graphs._forward(*self.key)


def emulate(runner, tokens) -> list:
    """Installs emulated verify graphs (sizes 1, 2, 4) on runner; returns [(graph logits, eager logits)] per run,
    the eager forward run on the same inputs afterwards (it rewrites the same K/V into the same slots)."""
    g = VerifyGraphs(runner.model, 4, tokens, 32, runner.config.block_size, runner.device, sizes=(1, 2, 4))
    for key in [(bs, q) for bs in g.sizes for q in g.tokens]:
        g.graphs[key] = EmulatedGraph(g, key)
    pairs, run = [], g.run

    def checked(host, upload, pending):
        out = run(host, upload, pending).clone()
        runner.verify_graphs = None
        try:
            pairs.append((out, runner.run_host(host, pending)))
        finally:
            runner.verify_graphs = g
        return out
    g.run = checked
    runner.verify_graphs = g
    return pairs


@pytest.mark.parametrize("overlap", [False, True])
def test_ngram_speculation_through_padded_verify_graph_buffers_matches_eager(overlap):
    """Tiny fp32 model, torch attention: every verify step (1-4 drafts per sequence, batches of 1-4 padded to a
    graph's size) gives the eager verify step's logits within 1e-5 and the outputs of plain decoding."""
    settings = dict(num_kv_blocks=96, overlap_steps=overlap)
    plain = generate(tiny_engine(**settings), PROMPTS, GREEDY)
    engine = tiny_engine(speculative="ngram", speculative_adaptive=False, num_draft_tokens=4, **settings)
    pairs = emulate(engine.runner, range(2, 6))
    spec = generate(engine, PROMPTS, GREEDY)
    assert [s[0] for s in spec] == [p[0] for p in plain]
    assert len(pairs) >= engine.spec.num_steps > 0 and engine.spec.num_accepted > 0
    for graph, eager in pairs:
        torch.testing.assert_close(graph, eager, rtol=0, atol=1e-5)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")
def test_padded_verify_buffers_through_the_triton_kernels_match_eager():
    """The same through the GPU attention backend (paged_prefill on the padded rows, under TRITON_INTERPRET=1):
    identical greedy tokens and logits within 1e-5 of the eager verify step's."""
    pytest.importorskip("triton")
    from lowbit.kernels._triton import interpreting
    from lowbit.serve.layers import attention
    from lowbit.serve.layers.triton_attention import TritonAttentionBackend
    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton's import")
    prompts, params = PROMPTS[:2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain_engine = tiny_engine(num_kv_blocks=96)  # (an engine on the CPU installs the torch backend)
    engine = tiny_engine(speculative="ngram", speculative_adaptive=False,
                         num_draft_tokens=3, ngram_size=1, num_kv_blocks=96)  # drafts often
    pairs = emulate(engine.runner, range(2, 5))
    saved = attention._backend
    try:
        attention.set_attention_backend(TritonAttentionBackend())
        plain = generate(plain_engine, prompts, params)
        spec = generate(engine, prompts, params)
        assert isinstance(attention._backend, TritonAttentionBackend)
    finally:
        attention.set_attention_backend(saved)
    assert [s[0] for s in spec] == [p[0] for p in plain]
    assert len(pairs) >= engine.spec.num_steps > 0 and engine.spec.num_accepted > 0
    for graph, eager in pairs:
        torch.testing.assert_close(graph, eager, rtol=0, atol=1e-5)


def test_draft_model_catch_up_and_verify_through_padded_graph_buffers_match_eager():
    """Draft-model speculation with the target's verify step and the draft model's 2-token catch-up both through
    emulated verify graphs: the outputs of plain decoding, logits within 1e-5 of the eager steps'."""
    from test_serve_spec_draft import draft_engine
    plain = generate(tiny_engine(num_kv_blocks=96), PROMPTS, GREEDY)
    engine = draft_engine("perturbed", num_kv_blocks=96)
    target_pairs = emulate(engine.runner, range(2, 6))
    draft_pairs = emulate(engine.spec.drafter.runner, (2,))
    spec = generate(engine, PROMPTS, GREEDY)
    assert [s[0] for s in spec] == [p[0] for p in plain]
    assert len(target_pairs) >= engine.spec.num_steps > 0 and len(draft_pairs) > 0
    assert 0 < engine.spec.num_accepted < engine.spec.num_drafted
    for graph, eager in target_pairs + draft_pairs:
        torch.testing.assert_close(graph, eager, rtol=0, atol=1e-5)
