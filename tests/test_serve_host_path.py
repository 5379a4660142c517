"""The engine's incremental host path (issue 7, host overhead): step inputs built from persistent block tables equal
those built from the sequences' lists, step by step through chunked prefill, prefix reuse and preemption; outputs
carry deltas until the final one, which is cumulative."""
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lowbit.serve.engine.config import EngineConfig
from lowbit.testing.dummy_weights import LLAMA_3_1_8B, dummy_checkpoint
from lowbit.serve.engine.engine import Engine
from lowbit.serve.runner.block_tables import BlockTables
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.engine.sequence import PENDING

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
    width = -(-max(len(s.block_table) for s in batch.seqs) // 16) * 16  # BlockTables' width multiple
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
    return dict(input_ids=ids, positions=positions, slot_mapping=slots, query_start_loc=qsl, context_lens=ctx_lens,
                block_tables=tables, logits_indices=logits_indices)


@pytest.mark.parametrize("overlap", [False, True])
def test_step_inputs_equal_the_list_built_ones_through_chunks_reuse_and_preemption(overlap):
    engine = tiny_engine(overlap_steps=overlap)
    runner, kinds, step = engine.runner, set(), {}
    host_inputs, device_inputs = runner.host_inputs, runner.device_inputs

    def recorded(batch, rows, pending=None):  # the step whose host arrays device_inputs then gets
        step.update(batch=batch, rows=rows)
        return host_inputs(batch, rows, pending)

    def checked(host, pending):
        input_ids, ctx = device_inputs(host, pending)
        batch, rows = step["batch"], step["rows"]
        expected = list_inputs(batch, rows, engine.config.block_size)
        if pending is not None:  # a token still on the device is read from the previous step's samples
            last = [sum(batch.num_new_tokens[:i + 1]) - 1 for i in range(len(batch.seqs))]
            for i, row in zip(last, pending.rows.tolist()):
                assert (expected["input_ids"][i] == PENDING) == (row >= 0)
                expected["input_ids"][i] = pending.tokens[row].item() if row >= 0 else expected["input_ids"][i]
            kinds.add("pending")
        got = dict(input_ids=input_ids, **{k: getattr(ctx, k) for k in expected if k != "input_ids"})
        for name, value in expected.items():
            assert got[name].tolist() == value, name
        assert ctx.context_lens_cpu == expected["context_lens"] and ctx.query_lens_cpu == batch.num_new_tokens
        assert [t.dtype for t in got.values()] == [torch.int64] * 3 + [torch.int32] * 3 + [torch.int64]
        kinds.add("decode" if batch.is_decode else "prefill")
        return input_ids, ctx

    runner.host_inputs, runner.device_inputs = recorded, checked
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 512, (9,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 20, 5, 30, 3, 12)]
    params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, prompt_logprobs=1)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i == 1])  # one with prompt logprobs: its steps cannot overlap
    while engine.has_unfinished():
        engine.step()
    assert kinds == {"decode", "prefill"} | ({"pending"} if overlap else set())
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.num_hit_tokens > 0
    assert engine.block_manager.num_used_blocks == 0


def test_block_tables_keep_rows_and_write_only_new_blocks():
    a, b, c = (SimpleNamespace(seq_id=i, block_table=[]) for i in range(3))
    t = BlockTables(rows=2, cols=2, multiple=1)
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


def test_block_table_width_is_a_multiple_of_16():
    """The row stride the attention kernels get keeps one Triton specialization as tables grow."""
    t = BlockTables(rows=2, cols=4)
    a = SimpleNamespace(seq_id=0, block_table=[5, 6])
    assert t.gather([a]).tolist() == [[5, 6] + [0] * 14]
    a.block_table += list(range(10, 25))  # 17 blocks
    got = t.gather([a])
    assert got.shape == (1, 32) and got[0, :17].tolist() == [5, 6] + list(range(10, 25)) and not got[0, 17:].any()


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


def run_streamed(engine, requests, abort_after_steps=None):
    """requests: (id, prompt, params) -> {id: (final output, concatenated delta ids, delta text, delta logprobs)}."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    deltas, finals, steps = {}, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            ids, text, logprobs = deltas.get(out.request_id, ([], "", []))
            deltas[out.request_id] = (ids + out.delta_token_ids, text + out.delta_text,
                                      logprobs + out.delta_logprobs)
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        if steps == abort_after_steps:
            engine.abort("aborted")
    return {i: (finals.get(i), *deltas.get(i, ([], "", []))) for i, _, _ in requests}


def same_logprobs(a, b, tol=1e-5) -> bool:
    """Logprob entries (logprob, [(id, logprob)]) with the same ids and values within tol."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        abs(x - y) <= tol and [i for i, _ in tx] == [i for i, _ in ty] and
        all(abs(u - v) <= tol for (_, u), (_, v) in zip(tx, ty)) for (x, tx), (y, ty) in zip(a, b))


def test_overlapped_steps_give_the_same_outputs():
    """The host running one step behind the device (PENDING tokens, stop decisions a step late) changes no output:
    greedy and seeded sampling, logprobs, stop tokens and strings, max_tokens, chunked prefill, prefix reuse,
    preemption, an abort and a request whose prompt logprobs force its prompt steps to run without overlap."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 512, (9,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 20, 5, 30, 3, 12, 7)]
    greedy = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    probe = run_streamed(tiny_engine(overlap_steps=False), [("p", prompts[0], greedy)])["p"][0].outputs[0]
    requests = [("greedy", prompts[0], greedy),
                ("sampled", prompts[1], SamplingParams(max_tokens=11, temperature=1.0, top_p=0.9, seed=3)),
                ("stop_id", prompts[0], SamplingParams(max_tokens=14, temperature=0,
                                                       stop_token_ids=[probe.token_ids[4]])),
                ("stop_text", prompts[0], SamplingParams(max_tokens=14, temperature=0, stop=[probe.text[5:7]])),
                ("one", prompts[3], SamplingParams(max_tokens=1, temperature=0)),
                ("aborted", prompts[4], greedy),
                ("late", prompts[6], SamplingParams(max_tokens=9, temperature=0.7, seed=5, logprobs=2)),
                ("logprobs", prompts[5], SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=1))]
    expected = run_streamed(tiny_engine(overlap_steps=False, num_kv_blocks=16), requests, abort_after_steps=6)
    overlapped = tiny_engine(overlap_steps=True, num_kv_blocks=16)
    got = run_streamed(overlapped, requests, abort_after_steps=6)
    assert overlapped.scheduler.num_preemptions > 0 and overlapped.block_manager.num_hit_tokens > 0
    assert overlapped.block_manager.num_used_blocks == 0 and not overlapped.has_unfinished()
    for request_id in ("greedy", "sampled", "stop_id", "stop_text", "one", "logprobs", "late"):
        final, ids, text, logprobs = got[request_id]
        want = expected[request_id][0].outputs[0]
        assert (final.outputs[0].token_ids, final.outputs[0].text, final.outputs[0].finish_reason) == \
            (want.token_ids, want.text, want.finish_reason), request_id
        assert ids == want.token_ids and text == want.text, request_id
        # tokens are exact; logprobs equal up to float rounding (a batch of another shape may round the last bit)
        assert same_logprobs(final.outputs[0].logprobs, want.logprobs), request_id
        assert same_logprobs(logprobs, want.logprobs or []), request_id
    assert len(got["late"][0].outputs[0].logprobs) == 9 and len(got["late"][0].outputs[0].logprobs[0][1]) == 2
    assert got["stop_id"][0].outputs[0].finish_reason == "stop" == got["stop_text"][0].outputs[0].finish_reason
    assert got["aborted"][0] is None and expected["aborted"][0] is None
    assert PENDING not in got["greedy"][0].outputs[0].token_ids


def test_overlapped_steps_stop_scheduling_a_sequence_whose_last_token_is_in_flight():
    engine = tiny_engine(overlap_steps=True)
    runs, run = [], engine.runner.run
    engine.runner.run = lambda batch, *args: runs.append(batch.num_new_tokens) or run(batch, *args)
    engine.add_request("r", list(range(40, 50)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert runs == [[10], [1], [1], [1]]  # the prompt, then 3 decodes: the 4th token needs no further step
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


def test_overlapped_steps_keep_overlapping_for_logprobs_and_after_prompt_scoring():
    """Only steps that score a prompt (prompt logprobs, max_tokens=0) need the logits on the host at once; sampled
    tokens' logprobs come back with the tokens."""
    engine = tiny_engine(overlap_steps=True, num_kv_blocks=64)
    kinds, launch, step_now = [], engine._launch, engine._step_now
    engine._launch = lambda batch: kinds.append("overlapped") or launch(batch)
    engine._step_now = lambda batch: kinds.append("at once") or step_now(batch)
    run_streamed(engine, [("lp", list(range(40, 50)), SamplingParams(max_tokens=5, temperature=0, logprobs=3))])
    assert kinds == ["overlapped"] * 5
    kinds.clear()
    params = SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=1)
    out = run_streamed(engine, [("plp", list(range(60, 70)), params)])["plp"][0]
    assert kinds == ["at once"] + ["overlapped"] * 4 and len(out.prompt_logprobs) == 10
    assert not engine.scoring


def test_serve_rejects_a_non_boolean_overlap_setting_in_one_line(tmp_path):
    config = tmp_path / "extra.yaml"
    config.write_text("overlap_steps: maybe\n")
    proc = subprocess.run([sys.executable, "-m", "lowbit.cli", "serve", "smollm2-135m", "--config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == ["error: overlap_steps must be true or false, got 'maybe'"]


@pytest.mark.parametrize("batch", [1, 2, 3, 5])
def test_uploaded_views_start_on_16_byte_boundaries(batch):
    """A step's arrays (int64 ids [B], int32 query_start_loc [B + 1], context lens [B], block tables) share one
    upload; each view starts on a 16-byte boundary whatever B is, so Triton's pointer-alignment specialization does
    not change with the batch (a new kernel variant compiled mid-serving, ~1 s)."""
    engine = tiny_engine()
    arrays = [np.arange(batch) + 2**40, np.arange(batch + 1, dtype=np.int32), np.arange(batch, dtype=np.int32) + 7,
              np.arange(batch * 16, dtype=np.int32).reshape(batch, 16)]
    views = engine.runner.upload(arrays)
    base = views[0].data_ptr()
    assert [(v.data_ptr() - base) % 16 for v in views] == [0, 0, 0, 0]
    for v, a in zip(views, arrays):
        assert v.dtype == (torch.int64 if a.dtype == np.int64 else torch.int32) and np.array_equal(v.numpy(), a)
