"""Data-parallel replicas (`--dp-size`) on the CPU: the router's load and prefix-affinity rules, /metrics summed over
the replicas, and two replicas behind the server answering concurrent openai clients with DP=1's greedy outputs, no
request lost; a replica that dies fails its request with a 500 in OpenAI's shape and the server refuses new work."""
import asyncio
import os
import shutil
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import uvicorn
from transformers import AutoModelForCausalLM, LlamaConfig

from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.server import dp_metrics
from lowbit.serve.server.api import build_app
from lowbit.serve.server.dp_engine import DataParallelEngine
from lowbit.serve.server.dp_router import Router

torch.set_num_threads(1)
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.2, tie_word_embeddings=True, max_position_embeddings=2048)
CONFIG = dict(device="cpu", dtype="float32", num_kv_blocks=256, max_batch_size=8)
PROMPTS = [f"Question {i}: what comes after {i * 7} apples and" + " pears" * (i % 4) for i in range(12)]
MAX_TOKENS = 12


# ---- routing
def test_router_prefers_the_prompt_home_while_its_load_allows():
    r = Router(2, block_size=4, slack=2)
    shared = [1, 2, 3, 4, 5, 6]
    assert r.pick(shared) == 0
    assert r.pick([9, 9, 9, 9, 9]) == 1  # another prefix: the least loaded
    assert r.pick(shared + [7]) == 0  # same leading block, home load 1 <= least 1 + 2
    assert r.pick(shared + [8]) == 0  # 2 <= 1 + 2
    assert r.pick(shared + [9]) == 0  # 3 <= 1 + 2
    assert r.pick(shared + [10]) == 1  # 4 > 1 + 2: the least loaded takes it, and becomes the prefix's home
    assert r.pick(shared) == 1
    assert r.load == [4, 3] and r.routed == [4, 3]
    r.done(0)
    assert r.load == [3, 3]


def test_router_short_prompts_by_load_and_dead_replicas_skipped():
    r = Router(3, block_size=4)
    assert [r.pick([1, 2]) for _ in range(3)] == [0, 1, 2]  # no full block: least loaded, lowest index first
    r.done(1)
    assert r.pick("text prompt") == 1
    r.dead(1)
    home = r.pick([5, 5, 5, 5, 5])
    r.done(home)
    assert home != 1 and r.pick([5, 5, 5, 5, 5]) == home
    r.dead(0), r.dead(2)
    assert r.pick([1]) is None


def test_metrics_sum_counters_gauges_and_histograms_and_average_ratios():
    one = ("# HELP lowbit_x_seconds h\n# TYPE lowbit_x_seconds histogram\nlowbit_x_seconds_bucket{le=\"0.1\"} 2\n"
           "lowbit_x_seconds_sum 0.25\nlowbit_x_seconds_count 2\n"
           "# TYPE lowbit_requests_finished_total counter\nlowbit_requests_finished_total{reason=\"stop\"} 3\n"
           "# TYPE lowbit_requests_running gauge\nlowbit_requests_running 1\n"
           "# TYPE lowbit_prefix_cache_hit_rate gauge\nlowbit_prefix_cache_hit_rate 0.5\n")
    two = one.replace("} 2\n", "} 5\n").replace("0.25", "0.5").replace("_count 2", "_count 5") \
        .replace("} 3\n", "} 4\n").replace("running 1", "running 2").replace("rate 0.5", "rate 0.25")
    text = dp_metrics.merge([one, two, None], load=[1, 2, 0], routed=[7, 9, 0], kv_used=[3, 4, None])
    lines = text.splitlines()
    assert 'lowbit_x_seconds_bucket{le="0.1"} 7' in lines and "lowbit_x_seconds_sum 0.75" in lines
    assert "lowbit_x_seconds_count 7" in lines and 'lowbit_requests_finished_total{reason="stop"} 7' in lines
    assert "lowbit_requests_running 3" in lines and "lowbit_prefix_cache_hit_rate 0.375" in lines
    assert lines.count("# TYPE lowbit_requests_running gauge") == 1
    assert {'lowbit_replica_up{replica="0"} 1', 'lowbit_replica_up{replica="2"} 0',
            'lowbit_replica_requests_total{replica="1"} 9', 'lowbit_replica_kv_blocks_used{replica="1"} 4'} \
        <= set(lines)
    assert not any(line.startswith('lowbit_replica_kv_blocks_used{replica="2"}') for line in lines)


# ---- two replicas behind the server
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-dp")
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).save_pretrained(path)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def expected(model_dir):
    """DP=1: each prompt's greedy text from one engine."""
    e = Engine(model_dir, EngineConfig(**CONFIG))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), p, params, stream=False)
    done = {}
    while e.has_unfinished():
        done |= {o.request_id: o.outputs[0].text for o in e.step() if o.finished}
    assert len(set(done.values())) > 1  # the prompts matter: a degenerate model proves nothing
    return [done[str(i)] for i in range(len(PROMPTS))]


class Served:
    def __init__(self, model_dir):
        self.failures = []
        self.engine = DataParallelEngine(model_dir, EngineConfig(**CONFIG, data_parallel_size=2),
                                         on_failure=self.failures.append)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = build_app(self.engine, "tiny", access_log=False)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()


@pytest.fixture(scope="module")
def served(model_dir):
    """One server for the module: the dead-replica test, which kills replica 1, runs last."""
    s = Served(model_dir)
    yield s
    s.close()


def _complete(client, i: int) -> str:
    if i % 2:  # half streamed
        chunks = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks if c.choices)
    out = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def _wait(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metric(text: str, key: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.rsplit(" ", 1)[0] == key)


def test_two_replicas_serve_concurrent_clients_with_dp1_outputs(served, expected):
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda i: _complete(served.client, i), range(len(PROMPTS))))
    assert got == expected
    assert all(n > 0 for n in served.engine.router.routed) and served.engine.router.load == [0, 0]
    metrics = _get(f"{served.base}/metrics")[1]
    assert _metric(metrics, 'lowbit_requests_finished_total{reason="length"}') == len(PROMPTS)
    assert _metric(metrics, "lowbit_generation_tokens_total") == len(PROMPTS) * MAX_TOKENS
    per_replica = [_metric(metrics, f'lowbit_replica_requests_total{{replica="{i}"}}') for i in (0, 1)]
    assert sum(per_replica) == len(PROMPTS) and min(per_replica) > 0
    assert _metric(metrics, "lowbit_kv_blocks_total") == 2 * CONFIG["num_kv_blocks"]
    assert served.failures == []


def test_a_dead_replica_fails_its_request_with_a_500_and_new_work_is_refused(served):
    engine = served.engine
    long = dict(model="tiny", max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(served.client.completions.create, prompt="the first one", **long)
        _wait(lambda: engine.router.load[0] > 0)
        os.kill(engine._procs[1].pid, signal.SIGSTOP)  # replica 1 takes the next request and never answers
        second = pool.submit(served.client.completions.create, prompt="the second one", **long)
        _wait(lambda: engine.router.load[1] > 0)
        os.kill(engine._procs[1].pid, signal.SIGKILL)
        with pytest.raises(openai.InternalServerError) as e:
            second.result(timeout=60)
        assert e.value.status_code == 500 and e.value.body["type"] == "server_error"
        assert "data-parallel replica 1 exited with code -9" in e.value.body["message"]
        assert first.result(timeout=120).choices[0].finish_reason == "length"  # replica 0's request completes
    assert served.failures == ["data-parallel replica 1 exited with code -9"]
    with pytest.raises(openai.InternalServerError):
        served.client.completions.create(prompt="after", **long)
    assert _get(f"{served.base}/health")[0] == 503
    metrics = _get(f"{served.base}/metrics")[1]
    assert 'lowbit_replica_up{replica="1"} 0' in metrics and 'lowbit_replica_up{replica="0"} 1' in metrics


def test_llm_refuses_data_parallel_size():
    """Replicas live behind the server; an in-process LLM with data_parallel_size > 1 is refused, not run as one."""
    from lowbit.serve.llm import LLM

    with pytest.raises(ValueError, match="lowbit serve --dp-size"):
        LLM("no-such-model-needed", data_parallel_size=2)
