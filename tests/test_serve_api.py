"""The official openai client against a real `lowbit serve` subprocess on 127.0.0.1."""
import http.client as httpclient
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import openai
import pytest

from lowbit.models import DEFAULT_MODEL, resolve

KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@contextmanager
def serve(model: str, workdir, *args: str, settings: str = ""):
    """`lowbit serve MODEL` on a free loopback port; yields its base URL. settings: more engine settings (YAML)."""
    port = free_port()
    extra = workdir / "extra.yaml"
    extra.write_text("num_kv_blocks: 256\n" + settings)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    log_path = workdir / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lowbit.cli", "serve", model, "--port", str(port),
                                 "--config", str(extra), *args], stdout=log, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 120
            while True:
                assert proc.poll() is None, log_path.read_text()
                try:
                    if http("GET", f"{base}/health")[0] == 200:
                        break
                except OSError:
                    pass
                assert time.time() < deadline, "server did not come up"
                time.sleep(0.5)
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module", params=[False, True], ids=["steps", "overlapped_steps"])
def server(tmp_path_factory, request):
    """The server as a CPU serves (one step at a time) and as a GPU does (the host a step behind the device)."""
    with serve(DEFAULT_MODEL, tmp_path_factory.mktemp("serve"), "--api-key", KEY, "--max-batch-size", "8",
               settings=f"overlap_steps: {str(request.param).lower()}\n") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def metrics(server) -> dict[str, float]:
    out = {}
    for line in http("GET", f"{server}/metrics", key=KEY)[1].splitlines():  # the key guards /metrics too
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]
    assert json.loads(http("GET", f"{server}/health")[1]) == {"status": "ok"}


def test_completion_and_its_stream_agree(client):
    kw = dict(model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].text.startswith(" Paris") and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_token_prompts_with_echo_and_logprobs(client):
    """What lm-eval's local-completions sends for loglikelihood: batched token ids, echo, logprobs, max_tokens 1."""
    prompts = [[504, 3575, 282, 4649, 314], [19556, 905]]
    out = client.completions.create(model=DEFAULT_MODEL, prompt=prompts, max_tokens=1, temperature=0, echo=True,
                                    logprobs=1)
    for choice, ids in zip(sorted(out.choices, key=lambda c: c.index), prompts):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        greedy_next = lp.top_logprobs[-1]
        assert lp.token_logprobs[-1] == max(greedy_next.values())  # temperature 0 picks the top token
    assert out.choices[0].text.startswith("The capital of France is")


def test_several_prompts_stream_interleaved_and_chat_logprobs(client):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    kw = dict(model=DEFAULT_MODEL, prompt=prompts, max_tokens=5, temperature=0)
    full = sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
    texts = ["", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in full]
    out = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob == content[0].top_logprobs[0].logprob  # greedy takes the most likely token


def test_chat_and_its_stream_agree(client):
    kw = dict(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_errors_have_openai_shape(client, server):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert http("POST", f"{server}/v1/completions", {"model": DEFAULT_MODEL, "prompt": "a"})[0] == 401
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="a")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_MODEL, prompt=[7] * 9000, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "x"}], top_p=2)
    assert set(e.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_MODEL, prompt="a", logit_bias={"5": 10})
    assert e.value.body["param"] == "logit_bias"
    status, body = http("POST", f"{server}/v1/completions", {"model": DEFAULT_MODEL, "prompt": "a", "max_tokens": "x"},
                        KEY)
    assert status == 400 and json.loads(body)["error"]["param"] == "max_tokens"


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"model": DEFAULT_MODEL, "prompt": "Tell me a long story about a dragon.", "max_tokens": 500,
            "ignore_eos": True, "stream": True}
    host, port = server.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(6):
        assert response.readline().startswith((b"data: ", b"\n"))
    assert metrics(server)["lowbit_kv_blocks_used"] > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 20
    while (m := metrics(server))["lowbit_kv_blocks_used"] > 0 or m["lowbit_requests_running"] > 0:
        assert time.time() < deadline, m
        time.sleep(0.2)
    assert m['lowbit_requests_finished_total{reason="abort"}'] >= 1


def test_disconnect_while_waiting_for_a_completion_frees_blocks(server):
    body = {"model": DEFAULT_MODEL, "prompt": "Tell me a long story about a cat.", "max_tokens": 500, "ignore_eos": True}
    host, port = server.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    deadline = time.time() + 20
    while metrics(server)["lowbit_kv_blocks_used"] == 0:
        assert time.time() < deadline
        time.sleep(0.1)
    aborted = metrics(server).get('lowbit_requests_finished_total{reason="abort"}', 0)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    while (m := metrics(server))["lowbit_kv_blocks_used"] > 0 or m["lowbit_requests_running"] > 0:
        assert time.time() < deadline + 20, m
        time.sleep(0.2)
    assert m['lowbit_requests_finished_total{reason="abort"}'] == aborted + 1


def test_metrics_are_prometheus_text(client, server):
    client.completions.create(model=DEFAULT_MODEL, prompt="Hello", max_tokens=2)  # a request counted, run alone too
    m = metrics(server)
    for name in ["lowbit_time_to_first_token_seconds_count", "lowbit_inter_token_latency_seconds_count",
                 "lowbit_requests_waiting", "lowbit_requests_running", "lowbit_kv_blocks_used",
                 "lowbit_prefix_cache_hit_rate", "lowbit_generation_tokens_per_second"]:
        assert name in m
    assert m["lowbit_time_to_first_token_seconds_count"] > 0


def test_lm_eval_local_completions_scores_like_in_process(server, monkeypatch):
    """lm-eval's local-completions (echo + logprobs on token-id prompts) against HFLM on the same model."""
    pytest.importorskip("lm_eval")
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from lowbit.checkpoint import load_reference_model

    torch.set_num_threads(1)
    pairs = [("The capital of France is", " Paris"), ("Once upon a time", " there was a king"),
             ("Question: what is two plus two? Answer:", " four")]

    def instances():
        return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    path = resolve(DEFAULT_MODEL)
    remote = LocalCompletionsAPI(base_url=f"{server}/v1/completions", model=DEFAULT_MODEL,
                                 tokenizer_backend="huggingface", tokenizer=str(path), batch_size=2, max_retries=1)
    model, tokenizer = load_reference_model(path)
    local = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)
    served, in_process = remote.loglikelihood(instances()), local.loglikelihood(instances())
    for (ll, greedy), (ref_ll, ref_greedy) in zip(served, in_process):
        assert ll == pytest.approx(ref_ll, abs=1e-3) and greedy == ref_greedy


@pytest.mark.skipif(not (resolve(DEFAULT_MODEL).parent / f"{DEFAULT_MODEL}-fp8").is_dir(),
                    reason="run `lowbit quantize --recipe fp8 smollm2-135m` first")
def test_openai_client_against_the_fp8_checkpoint(tmp_path):
    name = f"{DEFAULT_MODEL}-fp8"
    with serve(name, tmp_path) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        text = client.completions.create(model=name, prompt="The capital of France is", max_tokens=6,
                                         temperature=0).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=name, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True))
        assert text and streamed == text
        chat = dict(model=name, messages=[{"role": "user", "content": "Hi!"}], max_tokens=6, temperature=0)
        full = client.chat.completions.create(**chat).choices[0].message.content
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat, stream=True)]
        assert full and "".join(parts) == full
