"""response_format and tool calling through a real `lowbit serve smollm2-135m` and the official openai client:
every output parses / validates against its schema, streamed and unstreamed, on a server with overlapped steps (the
GPU default, so constrained steps must leave the overlap); bad specs and a missing xgrammar are 400s."""
import json

import jsonschema
import openai
import pytest

from test_serve_api import KEY, http, serve
from test_serve_structured import SCHEMAS, TOOL

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {"name": TOOL["name"], "description": "Weather forecast for a city",
                                            "parameters": TOOL["parameters"]}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(MODEL, tmp_path_factory.mktemp("serve"), "--api-key", KEY, "--max-batch-size", "8",
               settings="overlap_steps: true\n") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def chat(client, content, stream=False, **kw):
    """-> (message content, tool calls [(name, arguments dict)], finish_reason), streamed or not."""
    messages = [{"role": "user", "content": content}]
    if not stream:
        c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=150, **kw).choices[0]
        calls = [(t.function.name, json.loads(t.function.arguments), t.id, t.type) for t in c.message.tool_calls or []]
        return c.message.content, calls, c.finish_reason
    text, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=150, stream=True, **kw):
        d = chunk.choices[0].delta
        text += d.content or ""
        for t in d.tool_calls or []:
            name, args, cid, kind = calls.get(t.index, ("", "", t.id, t.type))
            calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""), cid, kind)
        reason = chunk.choices[0].finish_reason or reason
    return text or None, [(n, json.loads(a), i, k) for n, a, i, k in calls.values()], reason


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
def test_json_schema_outputs_validate(client, stream):
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        for seed in (0, 1):
            text, _, reason = chat(client, f"Answer in JSON ({name}).", stream, response_format=fmt,
                                   temperature=0.7, seed=seed)
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
def test_json_object_outputs_parse(client, stream):
    """Prompts that name the keys: asked for open-ended JSON ("Describe a cat as JSON.") this 135M model repeats
    array items until max_tokens (8 of 20 such outputs ran to 300 tokens), which no grammar prevents."""
    prompts = ["Give a JSON object with the keys city and country for Paris.",
               "Return a JSON object with a user's name and age."]
    for seed, prompt in enumerate(prompts):
        text, _, reason = chat(client, prompt, stream, response_format={"type": "json_object"}, temperature=0.7,
                               seed=seed)
        assert reason == "stop" and isinstance(json.loads(text), dict), text


def test_completions_take_response_format_too(client):
    out = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=80, temperature=0,
                                    extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                        "name": "n", "schema": SCHEMAS["nested"]}}}).choices[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMAS["nested"])


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
def test_tool_calls_parse_and_their_arguments_validate(client, stream):
    asked = {"required": "required", "named": {"type": "function", "function": {"name": "get_time"}}}
    for how, choice in asked.items():  # one call each: this small model repeats calls until max_tokens otherwise
        content, calls, reason = chat(client, "What is the weather in Rome for 2 days?", stream,
                                      tools=[WEATHER, TIME], tool_choice=choice, temperature=0,
                                      parallel_tool_calls=False)
        assert reason == "tool_calls" and calls and content is None, how
        for name, args, call_id, kind in calls:
            assert call_id.startswith("call_") and kind == "function"
            jsonschema.validate(args, PARAMS[name])
        assert len(calls) == 1 and (how != "named" or calls[0][0] == "get_time")
    content, calls, reason = chat(client, "Hi!", stream, tools=[WEATHER], tool_choice="none", temperature=0)
    assert calls == [] and reason in ("stop", "length") and content


def test_auto_tool_choice_gives_valid_calls_or_text(client):
    """"auto": the model may answer or call; whatever it calls parses and validates (sampled, several seeds)."""
    for seed in range(4):
        content, calls, reason = chat(client, "Weather in Paris for 3 days, please.", tools=[WEATHER],
                                      temperature=1.0, seed=seed)
        assert reason in ("stop", "length", "tool_calls")
        assert (reason == "tool_calls") == bool(calls)
        for name, args, _, _ in calls:
            assert name == "get_weather"
            jsonschema.validate(args, PARAMS[name])


def test_bad_structured_requests_are_400(server):
    url = f"{server}/v1/chat/completions"
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
              "response_format", "cannot compile"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
             ({"response_format": {"type": "yaml"}}, "response_format", "json_object"),
             ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "tool_choice", "tool_choice"),
             ({"tool_choice": "required"}, "tool_choice", "needs tools"),
             ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
              "response_format", "cannot be combined")]
    for extra, param, words in cases:
        status, body = http("POST", url, base | extra, KEY)
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == param and words in error["message"], (extra, body)
    status, body = http("POST", f"{server}/v1/completions", {"model": MODEL, "prompt": "x", "tools": [WEATHER]}, KEY)
    assert status == 400 and json.loads(body)["error"]["param"] == "tools"


def test_without_xgrammar_structured_requests_are_a_clear_400(tmp_path, monkeypatch):
    """xgrammar made unimportable (a shadowing package that raises ImportError): plain requests still work."""
    shadow = tmp_path / "shadow" / "xgrammar"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))
    with serve(MODEL, tmp_path) as base:
        url = f"{base}/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        status, text = http("POST", url, body | {"response_format": {"type": "json_object"}})
        error = json.loads(text)["error"]
        assert status == 400 and "pip install 'lowbit[structured]'" in error["message"], text
        assert http("POST", url, body | {"tools": [WEATHER], "tool_choice": "required"})[0] == 400
        assert http("POST", url, body)[0] == 200
