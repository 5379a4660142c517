"""KV offload to host (`host_cache_size`) on a tiny dummy model: a prefix evicted from a small device pool comes back
from the host pool instead of being recomputed, and every output equals the engine's without the host cache."""
import pytest
import torch

from lowbit.serve.engine.block_manager import chain_hash
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.testing.dummy_weights import LLAMA_3_1_8B, dummy_checkpoint

torch.set_num_threads(1)
TINY = dict(LLAMA_3_1_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, vocab_size=512, max_position_embeddings=256, dtype="float32")
BS = 4
PREFIX = [(7 * i + 3) % 500 for i in range(40)]  # 10 full blocks shared by A and C
TRAFFIC = [(11 * i + 5) % 500 for i in range(56)]  # B: 14 blocks, evicts most of A's from a 16-block pool
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)


class CharTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def tiny_engine(fmt="bf16", **config) -> Engine:
    ckpt = dummy_checkpoint(fmt, TINY, device="cpu")
    cfg = dict(max_batch_size=4, max_num_tokens=64, num_kv_blocks=16, block_size=BS, device="cpu", dtype="float32")
    return Engine(ckpt.path, EngineConfig(**cfg | config), ckpt=ckpt, tokenizer=CharTokenizer())


def counting_prefill(engine) -> dict[str, int]:
    """request id -> prompt tokens the runner computed for it (tokens before its prompt's end)."""
    counts, run = {}, engine.runner.run

    def counted(batch, rows, pending=None):
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            prompt_part = max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
            counts[seq.request_id] = counts.get(seq.request_id, 0) + prompt_part
        return run(batch, rows, pending)

    engine.runner.run = counted
    return counts


def run_one(engine, request_id, prompt, params=PARAMS):
    engine.add_request(request_id, prompt, params, stream=False)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out.outputs[0]
    raise AssertionError("no output")


def serve_a_b_c(engine):
    """A (the prefix), B (other traffic), C (the prefix again): their outputs and prompt tokens computed."""
    counts = counting_prefill(engine)
    outs = {r: run_one(engine, r, p) for r, p in
            [("A", PREFIX + [1, 2, 3]), ("B", TRAFFIC), ("C", PREFIX + [4, 5, 6])]}
    return outs, counts


LOGPROB_TOL = 1e-5  # fp32: a restored prefix changes which rows share a GEMM, and the BLAS may round a row by its batch


def same(a, b) -> bool:
    """Same tokens and text; logprobs (value, top entries) equal to within LOGPROB_TOL."""
    def close(x, y):
        return abs(x[0] - y[0]) <= LOGPROB_TOL and [t for t, _ in x[1]] == [t for t, _ in y[1]] and all(
            abs(u - v) <= LOGPROB_TOL for (_, u), (_, v) in zip(x[1], y[1]))
    return (a.token_ids == b.token_ids and a.text == b.text and len(a.logprobs) == len(b.logprobs)
            and all(close(x, y) for x, y in zip(a.logprobs, b.logprobs)))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_an_evicted_prefix_comes_back_from_the_host_not_recomputed(fmt):
    off_outs, off_counts = serve_a_b_c(tiny_engine(fmt))
    engine = tiny_engine(fmt, host_cache_size=64 * 1024)
    on_outs, on_counts = serve_a_b_c(engine)
    assert on_counts["A"] == off_counts["A"] == 43 and on_counts["B"] == 56
    # off: B evicted most prefix blocks (tail first), so C recomputes them; on: they come back from the host, and
    # C computes only its last 3 tokens (the block of its last token is never matched)
    recomputed = off_counts["C"] - 3
    assert recomputed >= 6 * BS and on_counts["C"] == 3
    g = engine.gauges()
    assert g["lowbit_host_cache_hit_tokens_total"][0] == recomputed
    assert g["lowbit_host_cache_restored_blocks_total"][0] == recomputed // BS
    assert g["lowbit_host_cache_offloaded_blocks_total"][0] >= recomputed // BS
    assert g["lowbit_host_cache_bytes_used"][0] == engine.block_manager.host.num_used * \
        engine.runner.host_cache.bytes_per_slot > 0
    assert g["lowbit_kv_blocks_used"][0] == 0
    for r in "ABC":
        assert same(on_outs[r], off_outs[r]), r
    # the same computation as a device prefix hit: a pool large enough to keep the prefix gives C bit for bit
    big_outs, big_counts = serve_a_b_c(tiny_engine(fmt, num_kv_blocks=64))
    assert big_counts["C"] == 3 and same(on_outs["C"], big_outs["C"])


def test_restored_bytes_equal_the_evicted_ones():
    engine = tiny_engine("fp8", host_cache_size=64 * 1024)
    run_one(engine, "A", PREFIX + [1, 2, 3])
    bm, caches = engine.block_manager, [m.kv_cache for m in engine.runner.attn_layers]
    prefix_hashes, h = set(), None
    for i in range(0, len(PREFIX), BS):
        h = chain_hash(h, tuple(PREFIX[i:i + BS]))
        prefix_hashes.add(h)
    before = {bm.blocks[b].hash: [c[:, b].view(torch.uint8).clone() for c in caches]
              for b in range(bm.num_blocks) if bm.blocks[b].hash in prefix_hashes}
    run_one(engine, "B", TRAFFIC)
    run_one(engine, "C", PREFIX + [4, 5, 6])
    restored = [b for b in range(bm.num_blocks) if bm.blocks[b].hash in before]
    assert len(restored) == len(before) == 10 and bm.num_restored >= 6
    for b in restored:
        for c, old in zip(caches, before[bm.blocks[b].hash]):
            assert torch.equal(c[:, b].view(torch.uint8), old)


@pytest.mark.parametrize("overlap", [False, True])
def test_concurrent_shared_prefixes_with_preemption_equal_no_host_cache(overlap):
    prompts = {f"r{i}": PREFIX[:24 + 4 * i] + [100 + i] * (3 + i) for i in range(4)}
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)

    def serve(engine):
        outs = {}
        for rid, p in prompts.items():
            engine.add_request(rid, p, params, stream=False)
        while engine.has_unfinished():
            outs |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
        for rid, p in prompts.items():  # again, after the others' blocks pushed these out
            outs[rid + "'"] = run_one(engine, rid + "'", p, params)
        return outs

    off = serve(tiny_engine(num_kv_blocks=14, overlap_steps=overlap))
    engine = tiny_engine(num_kv_blocks=14, host_cache_size=64 * 1024, overlap_steps=overlap)
    on = serve(engine)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_restored > 0
    assert on.keys() == off.keys()
    for rid in off:
        assert same(on[rid], off[rid]), rid
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)


def test_host_cache_size_too_small_for_a_block_is_refused_at_load():
    with pytest.raises(ValueError, match="host_cache_size 100 bytes holds no KV block"):
        tiny_engine(host_cache_size=100)


def test_host_cache_size_from_the_command_line_and_config(tmp_path):
    import argparse
    import subprocess
    import sys

    from lowbit.serve.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.engine_config(parser.parse_args(["m", "--host-cache-size", "4GiB"])).host_cache_size == 4 << 30
    extra = tmp_path / "extra.yaml"
    extra.write_text("host_cache_size: 512MiB\n")
    assert cli.engine_config(parser.parse_args(["m", "--config", str(extra)])).host_cache_size == 512 << 20
    assert EngineConfig(host_cache_size="1.5G").host_cache_size == 1_500_000_000
    bad = subprocess.run([sys.executable, "-m", "lowbit.cli", "serve", "m", "--host-cache-size", "4XB"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["error: host_cache_size '4XB': expected bytes, e.g. 4GiB, 512MiB, "
                                               "2G or 1000000"]
