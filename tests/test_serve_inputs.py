"""Input handling of a real `lowbit serve` (the embedded model, CPU): every malformed or oversized request is a
4xx in OpenAI's error shape, the greedy test holds for tiny temperatures, the published schema documents the real
responses, and a large prompt's tokenization does not stall another stream."""
import http.client as httpclient
import json
import math
import threading
import time

import openai
import pytest

from lowbit.models import DEFAULT_MODEL
from lowbit.serve.engine.sampling_params import SamplingParams
from tests.test_serve_api import http, serve

MAX_BYTES = 8 << 20  # the server's default --max-request-bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(DEFAULT_MODEL, tmp_path_factory.mktemp("serve_inputs"), "--max-batch-size", "8") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def raw(server: str, method: str, path: str, body: bytes | None, headers: dict | None = None,
        chunked: bool = False) -> tuple[int, dict, bytes]:
    host, port = server.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=120)
    try:
        if chunked:  # no Content-Length: 1 MiB chunks
            parts = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20))
            conn.request(method, path, parts, headers or {}, encode_chunked=True)
        else:
            conn.request(method, path, body, headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def assert_openai_error(status: int, body: bytes, expected: int, param: str | None = "any",
                        code: str | None = "any") -> dict:
    assert status == expected, body[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "any":
        assert error["param"] == param, error
    if code != "any":
        assert error["code"] == code, error
    return error


def post(server: str, path: str, body, **kw) -> tuple[int, dict, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps writes NaN, \ud800 escapes
    return raw(server, "POST", path, data, {"Content-Type": "application/json"}, **kw)


CMPL = {"model": DEFAULT_MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (endpoint, body, the param the 400 names)
MALFORMED = [
    ("completions", CMPL | {"prompt": "ok \ud800 lone surrogate"}, "prompt"),
    ("completions", CMPL | {"prompt": ["fine", "\udfff"]}, "prompt"),
    ("completions", CMPL | {"stop": ["\ud800"]}, "stop"),
    ("completions", CMPL | {"model": "\ud800"}, "model"),
    ("chat/completions", CHAT | {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
    ("chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages"),
    ("chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages"),
    ("completions", CMPL | {"temperature": math.nan}, "temperature"),
    ("completions", CMPL | {"top_p": math.inf}, "top_p"),
    ("chat/completions", CHAT | {"temperature": -math.inf}, "temperature"),
    ("completions", CMPL | {"temperature": 3.0}, "temperature"),
    ("completions", CMPL | {"temperature": -0.5}, "temperature"),
    ("completions", CMPL | {"top_p": 0}, "top_p"),
    ("completions", CMPL | {"presence_penalty": 7}, "presence_penalty"),
    ("completions", CMPL | {"frequency_penalty": math.nan}, "frequency_penalty"),
    ("completions", CMPL | {"max_tokens": 1e30}, "max_tokens"),
    ("completions", CMPL | {"max_tokens": 10 ** 40}, "max_tokens"),
    ("completions", CMPL | {"max_tokens": 5000}, "max_tokens"),  # more than the whole context (4096)
    ("completions", CMPL | {"max_tokens": -1}, "max_tokens"),
    ("chat/completions", CHAT | {"max_completion_tokens": 10 ** 9}, "max_completion_tokens"),
    ("completions", CMPL | {"n": 0}, "n"),
    ("completions", CMPL | {"n": 10 ** 9}, "n"),
    ("completions", CMPL | {"n": 8, "prompt": ["a"] * 200}, "prompt"),  # 1,600 choices > 1,024
    ("completions", CMPL | {"logprobs": 21}, "logprobs"),
    ("completions", CMPL | {"logprobs": 1e30}, "logprobs"),
    ("chat/completions", CHAT | {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("completions", CMPL | {"seed": 10 ** 30}, "seed"),
    ("completions", CMPL | {"top_k": -5}, "top_k"),
    ("completions", CMPL | {"stop": ["x"] * 17}, "stop"),
    ("completions", CMPL | {"stop": "y" * 5000}, "stop"),
    ("completions", CMPL | {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", CMPL | {"prompt": [[1, 2], []]}, "prompt"),
    ("completions", CMPL | {"prompt": [1, 2, 10 ** 12]}, "prompt"),
    ("completions", CMPL | {"prompt": [1.5, 2]}, "prompt"),
    ("completions", CMPL | {"prompt": ["a"] * 1025}, "prompt"),
    ("completions", CMPL | {"prompt": 5}, "prompt"),
    ("completions", CMPL | {"temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "no model"}, "model"),
    ("chat/completions", CHAT | {"messages": "hello"}, "messages"),
    ("chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat/completions", CHAT | {"messages": []}, "messages"),
    ("chat/completions", CHAT | {"stream_options": 3}, "stream_options"),
]


@pytest.mark.parametrize("endpoint,body,param", MALFORMED, ids=[f"{i}-{m[2]}" for i, m in enumerate(MALFORMED)])
def test_malformed_input_is_a_400_in_openai_shape(server, endpoint, body, param):
    status, _, data = post(server, f"/v1/{endpoint}", body)
    assert_openai_error(status, data, 400, param)


@pytest.mark.parametrize("data", [b"", b"not json", b"[]", b'"a string"', b"{\"model\": \"x\", \"prompt\": \"\xff\xfe\"}",
                                  b"{\"model\": 1e999999, \"prompt\": \"a\"}"],
                         ids=["empty", "not-json", "array", "string", "invalid-utf8", "huge-number"])
def test_bodies_that_are_no_request_are_a_400(server, data):
    status, _, body = post(server, "/v1/completions", data)
    assert_openai_error(status, body, 400)


def test_the_server_still_serves_after_them(client):
    out = client.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=3,
                                    temperature=0)
    assert out.choices[0].text.startswith(" Paris")


def test_tiny_temperature_is_greedy(client):
    """1e-45 is a float32 denormal: dividing logits by it overflows to inf, and the sampler returned garbage."""
    kw = dict(model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=8)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    for t in (1e-45, 1e-30, 1e-6):
        assert client.completions.create(**kw, temperature=t, seed=1).choices[0].text == greedy, t
    chat = dict(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6)
    assert client.chat.completions.create(**chat, temperature=1e-45).choices[0].message.content == \
        client.chat.completions.create(**chat, temperature=0).choices[0].message.content


def test_greedy_threshold_is_on_the_float32_value():
    assert SamplingParams(temperature=1e-45).greedy and SamplingParams(temperature=9.99e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy and not SamplingParams(temperature=1.0).greedy
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError):
            SamplingParams(temperature=bad)


def test_body_over_the_limit_is_a_413_from_the_header(server):
    body = json.dumps(CMPL | {"prompt": "a" * (MAX_BYTES + 10)}).encode()
    start = time.perf_counter()
    status, _, data = post(server, "/v1/completions", body)
    assert_openai_error(status, data, 413, None, "request_too_large")
    assert time.perf_counter() - start < 5


def test_chunked_body_over_the_limit_is_a_413(server):
    body = json.dumps(CMPL | {"prompt": "a" * (MAX_BYTES + 10)}).encode()
    status, _, data = post(server, "/v1/completions", body, chunked=True)
    assert_openai_error(status, data, 413, None, "request_too_large")
    small = json.dumps(CMPL | {"temperature": 0}).encode()  # a chunked body under the limit is served
    status, _, data = post(server, "/v1/completions", small, chunked=True)
    assert status == 200 and json.loads(data)["choices"][0]["text"]


def test_prompt_far_over_the_context_is_refused_before_tokenizing(server):
    """4 MB of text cannot fit 4,096 tokens of a vocabulary whose longest token has 81 characters: refused from
    its length (tokenizing it takes ~5 s on this machine)."""
    start = time.perf_counter()
    status, _, data = post(server, "/v1/completions", CMPL | {"prompt": "word " * 800_000})
    assert_openai_error(status, data, 400, "prompt", "context_length_exceeded")
    assert time.perf_counter() - start < 2
    status, _, data = post(server, "/v1/chat/completions",
                           CHAT | {"messages": [{"role": "user", "content": "word " * 800_000}]})
    assert_openai_error(status, data, 400, "messages", "context_length_exceeded")


def test_prompt_tokenized_over_the_context_is_a_400(server):
    status, _, data = post(server, "/v1/completions", CMPL | {"prompt": "word " * 5000})  # 5,001 tokens
    assert_openai_error(status, data, 400, "prompt", "context_length_exceeded")
    status, _, data = post(server, "/v1/completions", CMPL | {"prompt": list(range(5000))})
    assert_openai_error(status, data, 400, "prompt", "context_length_exceeded")


def test_openapi_documents_the_real_responses(server):
    status, text = http("GET", f"{server}/openapi.json")
    schema = json.loads(text)
    assert status == 200 and '"422"' not in text and "HTTPValidationError" not in schema["components"]["schemas"]
    error_ref = "#/components/schemas/ErrorResponse"
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413"}
        for code in ("400", "401", "404", "413"):
            assert responses[code]["content"]["application/json"]["schema"]["$ref"] == error_ref
        assert "text/event-stream" in responses["200"]["content"]
    error = schema["components"]["schemas"]["ErrorDetail"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}
    # what the server sends for a 404 and a 400 has that shape
    status, _, data = post(server, "/v1/completions", CMPL | {"model": "nope"})
    assert_openai_error(status, data, 404, "model", "model_not_found")
    status, _, data = raw(server, "GET", "/no/such/path", None)
    assert_openai_error(status, data, 404)


def test_openapi_states_exact_integer_bounds_and_non_empty_inputs(server):
    """Found by schemathesis: 2**64 served as the float 1.8446744073709552e+19 let schema-valid seeds above 2**64
    through to a 400; an empty prompt or message list was schema-valid yet refused."""
    _, text = http("GET", f"{server}/openapi.json")
    schemas = json.loads(text)["components"]["schemas"]
    seed = schemas["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert seed["exclusiveMaximum"] == 1 << 64 and '"exclusiveMaximum":18446744073709551616' in text
    assert seed["minimum"] == -(1 << 63) and "e+19" not in text and "e+18" not in text
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]
    assert prompt["minLength"] == 1 and prompt["minItems"] == 1
    assert schemas["ChatRequest"]["properties"]["messages"]["minItems"] == 1
    for path, body in (("/v1/completions", CMPL | {"prompt": ""}), ("/v1/completions", CMPL | {"prompt": []}),
                       ("/v1/chat/completions", {"model": DEFAULT_MODEL, "messages": []})):
        status, _, data = post(server, path, body)
        assert status == 400, (path, body, data)


def test_openapi_bounds_token_ids_by_the_vocabulary(server):
    """Found by schemathesis: token ids past the vocabulary were schema-valid yet refused."""
    _, text = http("GET", f"{server}/openapi.json")
    prompt = json.loads(text)["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    integers = [n for n in _walk(prompt) if n.get("type") == "integer"]
    assert len(integers) == 2 and all(n["minimum"] == 0 and n["maximum"] == 49151 for n in integers)
    for ids in ([49151], [[49151], [1]]):
        assert post(server, "/v1/completions", CMPL | {"prompt": ids, "max_tokens": 1})[0] == 200
    status, _, data = post(server, "/v1/completions", CMPL | {"prompt": [49152]})
    assert_openai_error(status, data, 400, "prompt")
    # also found: penalties and best_of the server refuses were schema-valid; the schema states what is served
    props = json.loads(text)["components"]["schemas"]["CompletionRequest"]["properties"]
    for name, served in (("presence_penalty", 0), ("frequency_penalty", 0), ("best_of", 1)):
        assert props[name]["minimum"] == props[name]["maximum"] == served, name
    schemas = json.loads(text)["components"]["schemas"]
    for body, field in (("CompletionRequest", "max_tokens"), ("ChatRequest", "max_completion_tokens")):
        bounds = [n["maximum"] for n in _walk(schemas[body]["properties"][field]) if n.get("type") == "integer"]
        assert bounds == [4096], (body, field, bounds)  # the served context (the fixture's pool)
    assert schemas["ContentPart"]["properties"]["type"]["enum"] == ["text"]


def _walk(node):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def test_n_choices_are_the_seeded_single_choices(client):
    """n > 1: choice j is what n=1 gives with seed + j; greedy choices are equal; streamed chunks carry each
    choice's index and add up to the unstreamed texts; usage counts the prompt once."""
    kw = dict(model=DEFAULT_MODEL, max_tokens=6, temperature=1.0, seed=7)
    prompt = "Once upon a time"
    many = client.completions.create(prompt=prompt, n=3, **kw)
    singles = [client.completions.create(prompt=prompt, **(kw | {"seed": 7 + j})) for j in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [s.choices[0].text for s in singles]
    assert [c.text for c in many.choices] == texts and len(set(texts)) > 1
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    two_prompts = client.completions.create(prompt=[prompt, "The sky"], n=2, max_tokens=4, temperature=0,
                                            model=DEFAULT_MODEL)
    texts = [c.text for c in sorted(two_prompts.choices, key=lambda c: c.index)]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]  # prompt-major, greedy copies
    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = client.chat.completions.create(messages=messages, n=2, **kw)
    streamed = ["", ""]
    for chunk in client.chat.completions.create(messages=messages, n=2, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in chat.choices] and streamed[0] != streamed[1]
    single = client.chat.completions.create(messages=messages, **(kw | {"seed": 8}))
    assert chat.choices[1].message.content == single.choices[0].message.content


def test_405_carries_allow(server):
    status, headers, data = raw(server, "GET", "/v1/completions", None)
    assert_openai_error(status, data, 405)
    assert headers.get("allow") == "POST"
    status, headers, _ = raw(server, "DELETE", "/v1/models", None)
    assert status == 405 and headers.get("allow") == "GET"


def test_large_prompts_do_not_stall_another_stream(server):
    """While prompts that take ~0.5 s each to tokenize (just under the length bound, over the context once
    tokenized) and a 4 MB one arrive, a concurrent stream's chunks keep coming: the largest gap < 1 s. With
    tokenization on the engine thread the stream stops for the sum of them (~4 s)."""
    body = CMPL | {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True,
                   "temperature": 0}
    host, port = server.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    arrivals = []
    for _ in range(5):  # the stream is running
        response.readline(), response.readline()
    big = [CMPL | {"prompt": "ab, " * 80_000}] * 8 + [CMPL | {"prompt": "word " * 800_000}]
    results = []

    def send(b):
        start = time.perf_counter()
        status, _, data = post(server, "/v1/completions", b)
        results.append((status, json.loads(data)["error"]["code"], time.perf_counter() - start))

    senders = [threading.Thread(target=send, args=(b,)) for b in big]
    start = time.perf_counter()
    for t in senders:
        t.start()
    while any(t.is_alive() for t in senders):
        line = response.readline()
        if line.startswith(b"data: [DONE]") or not line:
            break
        if line.startswith(b"data: "):
            arrivals.append(time.perf_counter())
    for t in senders:
        t.join()
    busy = time.perf_counter() - start
    conn.close()
    assert [(s, c) for s, c, _ in results] == [(400, "context_length_exceeded")] * len(big)
    assert max(r[2] for r in results) > 1.0, results  # the tokenization work was real (~0.5 s each, 2 at once)
    gaps = [b - a for a, b in zip([start] + arrivals, arrivals)]
    assert len(arrivals) > 5 and max(gaps) < 1.0, (max(gaps), len(arrivals), busy)


def test_sampler_takes_the_argmax_for_a_denormal_temperature():
    """On the sampler itself: a float32 denormal temperature used to divide the logits into inf (softmax NaN)."""
    import torch

    from lowbit.serve.runner.sampler import Sampler

    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 10
    params = [SamplingParams(temperature=t) for t in (1e-45, 1e-38, 1e-20, 0.0)]
    tokens = Sampler().sample(logits, params, seeds=[1, 2, 3, 4], positions=[5, 5, 5, 5])
    assert tokens.tolist() == logits.argmax(-1).tolist()
