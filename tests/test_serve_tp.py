"""Tensor parallelism on the CPU (gloo, 2 ranks): each format's sharding rules reproduce the whole linear, and a TP=2
engine gives TP=1's greedy tokens and logprobs through batching, chunked prefill and preemption; a TP size that
would split a quantization group is refused with one line; a killed rank ends the engine with an error, not a hang."""
import time

import pytest
import torch

from lowbit import formats
from lowbit.serve.distributed.runner import RankFailure
from lowbit.serve.distributed.sharding import Shard, local_config, shard_linear
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.testing.dummy_weights import LLAMA_3_1_8B, dummy_checkpoint

torch.set_num_threads(1)
# q/k/v 256 / 128 / 128 rows and intermediate 256 over two ranks: whole 128-wide int4 groups on each rank
TINY = dict(LLAMA_3_1_8B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=500, max_position_embeddings=256, dtype="float32")
STD = 0.05  # layers move the logits enough that an unsummed row-parallel output changes the greedy tokens
PROMPTS = [[1, 2, 3, 4, 5], [7] * 11, [9, 8, 7], [(5 * i + 3) % 500 for i in range(9)]]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
LOGPROB_ATOL = 1e-4  # float32 partial sums added in another order


class CharTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def engine(fmt: str, tp: int, config: dict = TINY, **kw) -> Engine:
    ckpt = dummy_checkpoint(fmt, config, device="cpu", std=STD)
    # 8 blocks of 4 tokens for 4 prompts of up to 17 tokens: preemption; 8 tokens a step: chunked prefill
    cfg = dict(max_batch_size=4, max_num_tokens=8, num_kv_blocks=8, block_size=4, device="cpu", dtype="float32",
               tensor_parallel_size=tp) | kw
    return Engine(ckpt.path, EngineConfig(**cfg), ckpt=ckpt, tokenizer=CharTokenizer())


def generate(e: Engine) -> list:
    for i, prompt in enumerate(PROMPTS):
        e.add_request(str(i), prompt, PARAMS, stream=False)
    done = {}
    while e.has_unfinished():
        done |= {o.request_id: o.outputs[0] for o in e.step() if o.finished}
    return [done[str(i)] for i in range(len(PROMPTS))]


def assert_same(one: list, two: list) -> None:
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        for (lp_a, top_a), (lp_b, top_b) in zip(a.logprobs, b.logprobs):
            assert lp_a == pytest.approx(lp_b, abs=LOGPROB_ATOL)
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
            assert [p for _, p in top_a] == pytest.approx([p for _, p in top_b], abs=LOGPROB_ATOL)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4_awq", "w8a8_sq", "nvfp4"])
def test_tp2_equals_tp1(fmt):
    one = engine(fmt, 1)
    expected = generate(one)
    assert one.scheduler.num_preemptions > 0  # the pool is small enough to preempt
    two = engine(fmt, 2)
    try:
        got = generate(two)
        assert two.scheduler.num_preemptions == one.scheduler.num_preemptions
    finally:
        two.close()
    assert_same(expected, got)
    assert len({tuple(o.token_ids) for o in expected}) > 1  # the prompts matter: a degenerate model proves nothing


def test_fewer_kv_heads_than_ranks_and_an_uneven_vocabulary():
    config = dict(TINY, num_key_value_heads=1, vocab_size=501)  # the KV head on both ranks; a zero row padded
    expected = generate(engine("bf16", 1, config))
    two = engine("bf16", 2, config)
    try:
        assert_same(expected, generate(two))
    finally:
        two.close()


def test_a_tp_size_that_splits_a_group_is_refused_with_one_line():
    config = dict(TINY, num_attention_heads=2, head_dim=64, num_key_value_heads=2)  # o_proj: one 128-wide group
    with pytest.raises(ValueError, match=r"o_proj\.weight_scale into 2 equal parts.*never straddle") as e:
        engine("int4_awq", 2, config)
    assert "\n" not in str(e.value)


def test_sizes_the_ranks_cannot_share_are_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide num_attention_heads 4"):
        local_config(TINY, 3)
    with pytest.raises(ValueError, match="overlap_steps"):
        EngineConfig(tensor_parallel_size=2, overlap_steps=True)


def test_a_killed_rank_ends_the_engine_with_an_error_not_a_hang():
    two = engine("bf16", 2)
    try:
        two.add_request("a", PROMPTS[0], PARAMS, stream=False)
        two.step()
        two.runner._procs[0].kill()
        start = time.monotonic()
        with pytest.raises(RankFailure, match="tensor parallel rank 1 exited with code -9"):
            while two.has_unfinished():
                two.step()
        assert time.monotonic() - start < 10
    finally:
        two.close()


def _formats_tensors(algo: str, n: int, k: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = 0.05 * torch.randn(n, k, generator=g)
    smooth = 0.5 + torch.rand(k, generator=g)  # a non-trivial pre_quant_scale where the format stores one
    fmt = formats.get(algo)
    t = fmt.quantize(w, group=32, smooth=smooth if "pre_quant_scale" in fmt.tensors.required + fmt.tensors.optional
                     else None)
    t["bias"] = torch.randn(n, generator=g)
    return t


# W4A16_ZP / per-token FP8 are served formats too; per-token FP8 quantizes each rank's input slice with its own amax
EXACT = [None, formats.FP8.name, formats.W8A8_SQ_PER_CHANNEL.name, formats.W4A16_AWQ.name, formats.W4A16_ZP.name,
         formats.NVFP4.name, formats.W4A16_NVFP4.name]


@pytest.mark.parametrize("algo", EXACT + [formats.FP8_PER_CHANNEL_PER_TOKEN.name])
def test_every_format_shards_into_the_whole_linear(algo):
    """Column-parallel: the ranks' outputs side by side; row-parallel: their sum (bias once) = the whole linear."""
    fmt, n, k = formats.get(algo), 64, 128
    t = _formats_tensors(algo, n, k, seed=1)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    whole = fmt.reference_linear(x, {s: v for s, v in t.items() if s != "bias"}, t["bias"])
    shards = [Shard(r, 2) for r in range(2)]
    cols = [shard_linear("model.layers.0.mlp.gate_proj", algo, t, s, 1) for s in shards]
    rows = [shard_linear("model.layers.0.mlp.down_proj", algo, t, s, 1) for s in shards]
    col_out = torch.cat([fmt.reference_linear(x, {s: v for s, v in c.items() if s != "bias"}, c["bias"])
                         for c in cols], dim=-1)
    row_out = sum(fmt.reference_linear(x[:, r * k // 2:(r + 1) * k // 2], {s: v for s, v in p.items()
                                                                           if s != "bias"}, p["bias"])
                  for r, p in enumerate(rows))
    assert torch.allclose(col_out, whole, atol=1e-6)
    tol = 1e-5 if algo in EXACT else 0.05  # per-token amax over half the features: another activation rounding
    assert torch.allclose(row_out, whole, atol=tol * whole.abs().max())
    assert not torch.allclose(rows[0]["weight"].float().sum(), rows[1]["weight"].float().sum())  # real halves


def test_tp_size_option_sets_the_engine_field():
    import argparse

    from lowbit.errors import UserError
    from lowbit.serve.server.cli import add_arguments, engine_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_config(parser.parse_args(["m", "--tp-size", "2"])).tensor_parallel_size == 2
    with pytest.raises(UserError, match="tensor_parallel_size must be > 0, got 0"):
        engine_config(parser.parse_args(["m", "--tp-size", "0"]))
