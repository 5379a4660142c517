"""The engine's incremental host path (issue 7, host overhead): step inputs built from persistent block tables equal
those built from the sequences' lists, step by step through chunked prefill, prefix reuse and preemption; outputs
carry deltas until the final one, which is cumulative."""
from types import SimpleNamespace

import numpy as np
import torch

from lowbit.serve.config import EngineConfig
from lowbit.serve.dummy_weights import LLAMA_3_1_8B, dummy_checkpoint
from lowbit.serve.engine import Engine
from lowbit.serve.model_runner import BlockTables
from lowbit.serve.sampling_params import SamplingParams

TINY = dict(LLAMA_3_1_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, vocab_size=512, max_position_embeddings=256, dtype="float32")


class CharTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def tiny_engine(**config) -> Engine:
    ckpt = dummy_checkpoint("bf16", TINY, device="cpu")
    cfg = dict(max_batch_size=4, max_num_tokens=24, num_kv_blocks=24, block_size=4, device="cpu", dtype="float32")
    return Engine(ckpt.path, EngineConfig(**cfg | config), ckpt=ckpt, tokenizer=CharTokenizer())


def list_inputs(batch, rows, bs):
    """The step inputs as the runner built them before: Python lists from each sequence."""
    ids, positions, slots, qsl, ctx_lens, logits_indices = [], [], [], [0], [], []
    for seq, n, r in zip(batch.seqs, batch.num_new_tokens, rows):
        start = seq.num_computed_tokens
        logits_indices += [qsl[-1] + x for x in r]
        ids += seq.token_ids[start:start + n]
        positions += range(start, start + n)
        slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
        qsl.append(qsl[-1] + n)
        ctx_lens.append(start + n)
    width = max(len(s.block_table) for s in batch.seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
    return dict(input_ids=ids, positions=positions, slot_mapping=slots, query_start_loc=qsl, context_lens=ctx_lens,
                block_tables=tables, logits_indices=logits_indices)


def test_step_inputs_equal_the_list_built_ones_through_chunks_reuse_and_preemption():
    engine = tiny_engine()
    runner, prepare, kinds = engine.runner, engine.runner.prepare, set()

    def checked(batch, rows):
        input_ids, ctx = prepare(batch, rows)
        expected = list_inputs(batch, rows, engine.config.block_size)
        got = dict(input_ids=input_ids, **{k: getattr(ctx, k) for k in expected if k != "input_ids"})
        for name, value in expected.items():
            assert got[name].tolist() == value, name
        assert ctx.context_lens_cpu == expected["context_lens"] and ctx.query_lens_cpu == batch.num_new_tokens
        assert [t.dtype for t in got.values()] == [torch.int64] * 3 + [torch.int32] * 3 + [torch.int64]
        kinds.add("decode" if batch.is_decode else "prefill")
        return input_ids, ctx

    runner.prepare = checked
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 512, (9,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 20, 5, 30, 3, 12)]
    params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, prompt_logprobs=1)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i % 2])
    while engine.has_unfinished():
        engine.step()
    assert kinds == {"decode", "prefill"}
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.num_hit_tokens > 0
    assert engine.block_manager.num_used_blocks == 0


def test_block_tables_keep_rows_and_write_only_new_blocks():
    a, b, c = (SimpleNamespace(seq_id=i, block_table=[]) for i in range(3))
    t = BlockTables(rows=2, cols=2)
    a.block_table += [5]
    b.block_table += [7, 8]
    assert t.gather([a, b]).tolist() == [[5, 0], [7, 8]]
    a.block_table += [6, 9]  # grows past the columns
    assert t.gather([b, a]).tolist() == [[7, 8, 0], [5, 6, 9]]
    c.block_table += [3]  # b leaves: c takes its row, whose old blocks are cleared
    assert t.gather([a, c]).tolist() == [[5, 6, 9], [3, 0, 0]]
    a.block_table = [4]  # preempted and allocated anew: a new list
    b.block_table = [1, 2]
    assert t.gather([a, b, c]).tolist() == [[4, 0], [1, 2], [3, 0]]  # b needs a third row: the array grows
    assert isinstance(t.gather([c]), np.ndarray) and t.gather([c]).dtype == np.int32


def test_outputs_carry_deltas_until_the_final_cumulative_one():
    engine = tiny_engine(num_kv_blocks=64)
    prompt = list(range(40, 50))
    engine.add_request("r", prompt, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    *running, final = outs
    assert running and not any(o.finished for o in running) and final.finished
    for o in running:
        c = o.outputs[0]
        assert c.token_ids == o.delta_token_ids and c.text == o.delta_text and c.logprobs == o.delta_logprobs
        assert o.prompt_token_ids is final.prompt_token_ids and o.prompt_token_ids == prompt
    ids = [t for o in outs for t in o.delta_token_ids]
    assert final.outputs[0].token_ids == ids and len(ids) == 7
    assert final.outputs[0].text == "".join(o.delta_text for o in outs) == CharTokenizer().decode(ids)
    assert len(final.outputs[0].logprobs) == 7 == sum(len(o.delta_logprobs) for o in outs)
