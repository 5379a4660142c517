"""Structured output in the engine: the grammar's logits mask (unit), and every output of a tiny random model and of
the embedded smollm2-135m parses as JSON / validates against its schema, greedy and sampled, with and without
overlapped steps."""
import json
from functools import lru_cache

import jsonschema
import pytest
import torch

pytest.importorskip("xgrammar")

from lowbit.models import resolve  # noqa: E402
from lowbit.serve.engine.config import EngineConfig  # noqa: E402
from lowbit.serve.engine.engine import Engine  # noqa: E402
from lowbit.serve.engine.sampling_params import SamplingParams, StructuredSpec  # noqa: E402
from lowbit.serve.engine.structured import Grammars, apply_bitmask, batch_bitmask, tool_calls_schema  # noqa: E402
from lowbit.testing.dummy_weights import LLAMA_3_1_8B, dummy_checkpoint  # noqa: E402

VOCAB = 49152  # the embedded model's tokenizer
SCHEMAS = {
    "required_fields": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                         "ok": {"type": "boolean"}},
                        "required": ["name", "ok"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
             "required": ["color"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
              "maxItems": 4},
    "nested": {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                                   "y": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["point", "tags"], "additionalProperties": False},
    "integer_range": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}},
                      "required": ["age"], "additionalProperties": False},
}
TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}


@lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve("smollm2-135m"))


def tiny_engine(**config) -> Engine:
    """Random weights at tiny shapes with the embedded model's tokenizer and vocabulary."""
    shape = dict(LLAMA_3_1_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=VOCAB, max_position_embeddings=512,
                 dtype="float32")
    ckpt = dummy_checkpoint("bf16", shape, device="cpu")
    cfg = dict(max_batch_size=8, max_num_tokens=64, num_kv_blocks=512, block_size=4, device="cpu", dtype="float32")
    return Engine(ckpt.path, EngineConfig(**cfg | config), ckpt=ckpt, tokenizer=tokenizer())


def run(engine, requests) -> dict:
    """requests: (id, prompt ids, params) -> {id: final output}; streamed deltas must add up to it."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    finals, texts = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.delta_text
            if out.finished:
                finals[out.request_id] = out
    for rid, out in finals.items():
        assert texts[rid] == out.outputs[0].text
    assert engine.block_manager.num_used_blocks == 0 and not engine.constrained
    return finals


def test_the_mask_keeps_exactly_the_grammar_s_allowed_tokens():
    """After a prefix, the bitmask allows token t iff the matcher accepts t; applied, the allowed logits are
    unchanged and every other one is -inf; an unconstrained row of the same batch is untouched."""
    grammars = Grammars(tokenizer(), VOCAB, [tokenizer().eos_token_id])
    state = grammars.state(StructuredSpec("json_schema", schema=SCHEMAS["enum"]))
    for t in tokenizer().encode('{"color": "', add_special_tokens=False):
        assert state.accept(t)
    mask = batch_bitmask([None, state], VOCAB)
    bits = ((mask.view(2, -1, 1) >> torch.arange(32, dtype=torch.int32)) & 1).view(2, -1)[:, :VOCAB].bool()
    accepts = torch.tensor([state.matcher.fork().accept_token(t) for t in range(VOCAB)])
    assert bits[0].all() and torch.equal(bits[1], accepts)
    allowed = {tokenizer().decode([t]) for t in accepts.nonzero().view(-1).tolist()}
    assert "red" in allowed or "r" in allowed
    assert 0 < int(accepts.sum()) < 100  # only prefixes of red / green / blue
    logits = torch.randn(2, VOCAB)
    masked = logits.clone()
    apply_bitmask(masked, mask)
    assert torch.equal(masked[0], logits[0])
    assert torch.equal(masked[1][accepts], logits[1][accepts])
    assert torch.isneginf(masked[1][~accepts]).all()


def test_a_schema_the_compiler_refuses_is_a_value_error():
    grammars = Grammars(tokenizer(), VOCAB, [tokenizer().eos_token_id])
    with pytest.raises(ValueError, match="cannot compile the json_schema grammar"):
        grammars.compile(StructuredSpec("json_schema", schema={"type": "frob"}))


def structured_requests(prompts):
    requests = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        spec = StructuredSpec("json_schema", schema=schema)
        requests.append((f"{name}-greedy", prompts[i], SamplingParams(max_tokens=120, temperature=0, structured=spec)))
        requests.append((f"{name}-sampled", prompts[i + 1],
                         SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured=spec)))
    tools = StructuredSpec("tool_calls", tools=(TOOL,), single=True)  # the real model repeats calls when allowed
    requests += [("object", prompts[0], SamplingParams(max_tokens=200, temperature=0.8, seed=7,
                                                       structured=StructuredSpec("json_object"))),
                 ("tools", prompts[2], SamplingParams(max_tokens=120, temperature=1.0, seed=3, structured=tools)),
                 ("plain", prompts[3], SamplingParams(max_tokens=250, temperature=0, ignore_eos=True))]
    return requests


def check_outputs(finals, requests):
    for rid, _, params in requests:
        c = finals[rid].outputs[0]
        spec = params.structured
        if spec is None:
            continue
        assert c.finish_reason == "stop", (rid, c.text)
        value = json.loads(c.text)
        if spec.kind == "json_object":
            assert isinstance(value, dict), rid
        elif spec.kind == "json_schema":
            jsonschema.validate(value, spec.schema)
        else:
            jsonschema.validate(value, tool_calls_schema(list(spec.tools), spec.single))
            for call in value:
                jsonschema.validate(call["arguments"], TOOL["parameters"])


def test_tiny_model_outputs_follow_their_schemas_with_and_without_overlapped_steps():
    """A random model, left alone, writes no JSON; masked, all outputs validate, the same with overlapped steps
    (constrained sequences' steps run at once, the others' tokens resolved first) as one step at a time."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 8, 30, 5, 11, 9)]
    requests = structured_requests(prompts)
    expected = run(tiny_engine(overlap_steps=False), requests)
    check_outputs(expected, requests)
    assert expected["plain"].outputs[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(expected["plain"].outputs[0].text)
    overlapped = tiny_engine(overlap_steps=True)
    kinds, launch = [], overlapped._launch
    overlapped._launch = lambda batch: kinds.append([s.request_id for s in batch.seqs]) or launch(batch)
    got = run(overlapped, requests)
    assert kinds and all(ids == ["plain"] for ids in kinds)  # only the unconstrained one ever overlaps
    for rid, _, _ in requests:
        assert (got[rid].outputs[0].token_ids, got[rid].outputs[0].finish_reason) == \
            (expected[rid].outputs[0].token_ids, expected[rid].outputs[0].finish_reason), rid


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tiny_model_outputs_follow_their_schemas_on_the_gpu():
    """The GPU defaults (Triton kernels, CUDA graphs, overlapped steps), the bitmask applied to device logits: every
    constrained output is a token sequence its grammar accepts token by token, and those that stopped validate; the
    greedy ones equal the CPU engine's (float32 on both, tiny shapes). (A sampled json_object may still be inside a
    string at max_tokens: the random draws differ from the CPU's.)"""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 8, 30, 5, 11, 9)]
    requests = structured_requests(prompts)
    got = run(tiny_engine(device="cuda"), requests)
    grammars = Grammars(tokenizer(), VOCAB, [tokenizer().eos_token_id])
    stopped = []
    for rid, _, params in requests:
        if params.structured is None:
            continue
        state, c = grammars.state(params.structured), got[rid].outputs[0]
        assert all(state.accept(t) for t in c.token_ids), rid
        if c.finish_reason == "stop":
            stopped.append((rid, _, params))
    assert len(stopped) >= len([r for r in requests if r[2].structured is not None]) - 1
    check_outputs(got, stopped)
    cpu = run(tiny_engine(), [r for r in requests if r[2].greedy and r[2].structured is not None])
    agree = [got[rid].outputs[0].token_ids == out.outputs[0].token_ids for rid, out in cpu.items()]
    assert sum(agree) >= len(agree) - 1, agree  # float32 GEMMs on two devices: at most one near tie flips


@pytest.mark.slow
@pytest.mark.parametrize("device, dtype", [
    ("cpu", "float32"),
    pytest.param("cuda", "bfloat16", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
])
def test_embedded_model_outputs_follow_their_schemas(device, dtype):
    """On the GPU: bf16 kernels, CUDA graphs and overlapped steps (its defaults) with the mask on the device."""
    engine = Engine("smollm2-135m", EngineConfig(max_batch_size=16, num_kv_blocks=256, device=device,
                                                 dtype=dtype))
    tok = engine.tokenizer

    def chat(text):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
    prompts = [chat(t) for t in ("Describe a person as JSON.", "Pick a color.", "List some digits.",
                                 "Give a point and tags.", "How old is Ada?", "Weather in Paris for 3 days?",
                                 "Hello")]
    requests = structured_requests(prompts)
    check_outputs(run(engine, requests), requests)
