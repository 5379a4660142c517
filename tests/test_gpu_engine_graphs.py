"""The GPU-only pieces, checked on the CPU: decode through DecodeGraphs' static, padded buffers (the replay emulated
by running the forward on those buffers) and the KV pool arithmetic (free memory faked)."""
import numpy as np
import pytest
import torch

from lowbit.serve.runner import kv_cache
from lowbit.serve.runner.cuda_graphs import DecodeGraphs
from lowbit.serve.runner.model_runner import HostInputs, PendingTokens


class EmulatedGraph:
    """replay() = the captured forward, run eagerly on the same static buffers."""

    def __init__(self, graphs: DecodeGraphs, key: tuple[int, bool]):
        self.graphs, self.key = graphs, key

    def replay(self):
        self.graphs.logits[self.key].copy_(self.graphs._forward(*self.key))


def emulated(model, max_batch_size, max_blocks, vocab, num_kv_heads=2, num_kinds=1):
    g = DecodeGraphs(model, max_batch_size, max_blocks, num_kv_heads, torch.device("cpu"), sizes=(1, 2, 4),
                     num_kinds=num_kinds)
    for key in [(bs, False) for bs in g.sizes] + [(bs, True) for bs in g.long_sizes]:
        g.logits[key] = torch.empty(key[0], vocab)
        g.graphs[key] = EmulatedGraph(g, key)
    return g


def host_inputs(ids, slots, lens, tables) -> HostInputs:
    """A decode step's HostInputs (positions: context length - 1; pending sources: those of the PendingTokens)."""
    b = len(ids)
    lens = np.array(lens, np.int32)
    return HostInputs(np.array(ids, np.int64), lens.astype(np.int64) - 1, np.array(slots, np.int64),
                      np.arange(b), np.array([-1, 1, -1][:b] + [-1] * (b - 3), np.int64),
                      np.arange(b + 1, dtype=np.int32), lens, np.array(tables, np.int32), True, [1] * b, lens.tolist())


def upload(arrays):
    return [torch.from_numpy(a) for a in arrays]


def counted(graphs: DecodeGraphs) -> list[int]:
    """[number of DecodeGraphs.run calls so far], kept up to date."""
    calls, run = [0], graphs.run

    def counting(*args):
        calls[0] += 1
        return run(*args)
    graphs.run = counting
    return calls


def test_graph_sizes_and_padding():
    seen = []

    class Fake(torch.nn.Module):
        def forward(self, ids, ctx):
            seen.append((ids.clone(), ctx.slot_mapping.clone(), ctx.context_lens.clone(), ctx.block_tables.clone()))
            return torch.zeros(ids.shape[0], 2)

        def compute_logits(self, h):
            return h[:, :1].expand(-1, 5).float() + torch.arange(h.shape[0])[:, None]

    g = emulated(Fake(), 6, 3, 5)
    assert g.sizes == [1, 2, 4, 6]
    host = host_inputs(ids=[11, 12, 13], slots=[20, 41, 7], lens=[5, 10, 2], tables=[[1], [2], [0]])
    logits = g.run(host, upload, PendingTokens(torch.tensor([70, 71]), np.array([-1, 1, -1])))
    ids, slots, lens, tables = seen[-1]
    assert ids[:3].tolist() == [11, 71, 13] and len(ids) == 4  # batch 3 runs in the graph of 4; 71 pending
    assert slots.tolist() == [20, 41, 7, -1] and lens.tolist() == [5, 10, 2, 1]
    assert tables[:3, 0].tolist() == [1, 2, 0]
    assert logits.shape == (3, 5) and logits[:, 0].tolist() == [0, 1, 2]


def test_long_context_graphs():
    """A batch whose longest context is over long_context(graph size) replays the graph captured with long host-side
    contexts (so its attention took decode_splits' long-context split count), where that count differs."""
    from lowbit.kernels.attention.paged_attention import decode_splits, long_context
    LONG_CONTEXT = long_context(1)  # keys past which a batch of up to 3 takes the long-context splits

    seen = []

    class Fake(torch.nn.Module):
        def forward(self, ids, ctx):
            seen.append(max(ctx.context_lens_cpu))
            return torch.zeros(ids.shape[0], 2)

        def compute_logits(self, h):
            return h[:, :1].expand(-1, 5).float()

    g = emulated(Fake(), 64, 3, 5, num_kv_heads=8)
    sizes = [1, 2, 4, 64]
    assert g.sizes == sizes
    assert g.long_sizes == {s for s in sizes if decode_splits(s, 8, long_context(s) + 1) != decode_splits(s, 8)}
    assert g.long_sizes == {1, 2, 4}  # batch 64 x 8 KV heads fills the GPU without splits
    for lens, bs, long in (([5, 10], 2, False), ([5, LONG_CONTEXT + 7], 2, True), ([5, 2000], 2, False),
                           ([5, 9, 1100], 4, True), ([5, 9, 1000], 4, False), ([LONG_CONTEXT + 7] * 40, 64, False)):
        b = len(lens)
        g.run(host_inputs(ids=[0] * b, slots=[0] * b, lens=lens, tables=[[0]] * b), upload, None)
        assert seen[-1] == (long_context(bs) + 1 if long else 1), (lens, seen[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")
def test_engine_decode_through_padded_graph_buffers_matches_eager():
    pytest.importorskip("triton")
    from lowbit.kernels._triton import interpreting
    from lowbit.serve.layers import attention
    from lowbit.serve.layers.triton_attention import TritonAttentionBackend
    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton's import")
    from lowbit.bench import serve_bench as bench
    args = bench.parse(["--tiny", "--device", "cpu"])
    engine = bench.build_engine(args, "bf16", enable_prefix_caching=False, max_batch_size=4, num_kv_blocks=64,
                                overlap_steps=True)  # decode inputs merge the tokens still on the device
    prompts = [bench.random_prompts(1, n, 512, seed=n)[0] for n in (3, 21, 40)]  # 3 sequences: padded to 4
    saved = attention._backend
    try:
        attention.set_attention_backend(TritonAttentionBackend())
        engine.runner.graphs = emulated(engine.runner.model, 4, 16, 512)
        runs = counted(engine.runner.graphs)
        tok_g, logits_g, _ = bench.greedy_with_logits(engine, prompts, 5)  # steps not overlapped
        overlapped_g, graph_runs = bench.greedy(engine, prompts, 5), runs[0]
        engine.runner.graphs = None
        tok_e, logits_e, _ = bench.greedy_with_logits(engine, prompts, 5)
        overlapped_e = bench.greedy(engine, prompts, 5)
    finally:
        attention.set_attention_backend(saved)
    assert tok_g == tok_e == overlapped_g == overlapped_e
    assert graph_runs == 8  # 4 decode steps per run
    for a, b in zip(logits_g, logits_e):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")
def test_kv_kinds_decode_through_padded_graph_buffers_matches_eager(tmp_path):
    """A model with full and windowed layers (a KV pool, slots and tables per kind): decode through the static
    per-kind buffers equals eager steps and transformers' generate, windows shorter than the prompts."""
    pytest.importorskip("triton")
    from lowbit.kernels._triton import interpreting
    from lowbit.serve.engine.config import EngineConfig
    from lowbit.serve.engine.engine import Engine
    from lowbit.serve.layers import attention
    from lowbit.serve.layers.triton_attention import TritonAttentionBackend
    from test_serve_gemma import PROMPTS, hf_greedy, save_tiny
    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton's import")
    from lowbit.bench import serve_bench as bench
    model = save_tiny("gemma3", tmp_path)
    engine = Engine(tmp_path, EngineConfig(max_batch_size=4, max_num_tokens=16, num_kv_blocks=64, device="cpu",
                                           dtype="float32", enable_prefix_caching=False, overlap_steps=True))
    assert engine.runner.kv_blocks == [160, 16]  # 64 x 3 layers less 16 x 2 windowed layers
    prompts = [PROMPTS[0], PROMPTS[1][:21], PROMPTS[2][:40]]  # 3 sequences: padded to 4
    saved = attention._backend
    try:
        attention.set_attention_backend(TritonAttentionBackend())
        engine.runner.graphs = emulated(engine.runner.model, 4, 16, 1024, num_kinds=2)
        runs = counted(engine.runner.graphs)
        tok_g, logits_g, _ = bench.greedy_with_logits(engine, prompts, 5)  # steps not overlapped
        overlapped_g, graph_runs = bench.greedy(engine, prompts, 5), runs[0]
        engine.runner.graphs = None
        tok_e, logits_e, _ = bench.greedy_with_logits(engine, prompts, 5)
    finally:
        attention.set_attention_backend(saved)
    assert tok_g == tok_e == overlapped_g == hf_greedy(model, prompts, 5)
    assert graph_runs == 8  # 4 decode steps per run
    for a, b in zip(logits_g, logits_e):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_kv_cache_fraction_and_cap(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    block = 2 * 2**20
    assert kv_cache.gpu_blocks_that_fit(block, 16, gib, "cuda") == int(9 * gib * 0.9 // block)
    assert kv_cache.gpu_blocks_that_fit(block, 16, gib, "cuda", 0.5, max_tokens=1000) == 63  # ceil(1000 / 16)
    with pytest.raises(RuntimeError, match="no room"):
        kv_cache.gpu_blocks_that_fit(block, 16, 11 * gib, "cuda")
