"""The mixed soak of `lowbit bench serve-load --mix` in a tiny configuration against a real `lowbit serve` of the
embedded model (subprocess, loopback, API key on): 0 lost, 0 corrupted greedy outputs, 0 5xx, no wrong status,
every KV block freed. The full-size run (>= 1,000 requests, 64 clients) is recorded in docs/performance.md."""
import json
import subprocess
import sys

import pytest

from lowbit.bench import serve_mix
from lowbit.models import DEFAULT_MODEL


def test_mixed_soak_small(tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "-m", "lowbit.cli", "bench", "serve-load", "--mix", "--model", DEFAULT_MODEL,
                        "--requests", "40", "--clients", "8", "--output-len", "8", "8", "--seed", "1",
                        "--api-key", "soak-key", "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert out.exists(), r.stderr[-2000:]
    s = json.loads(out.read_text())
    assert r.returncode == 0, s
    assert s["requests_done"] == s["requests_planned"] == 40
    assert (s["lost"], s["corrupted"], s["status_5xx"], s["unexpected_status"], s["stream_errors"]) == (0,) * 5, s
    assert s["kv_blocks_used_at_end"] == 0 and s["running_at_end"] == 0, s
    # the mix really mixed: normal streamed and unstreamed, disconnects, 413s and 400s all ran
    assert {"stream", "unary", "disconnect", "oversized"} <= set(s["kinds"]), s["kinds"]
    assert any(k.startswith("malformed:") for k in s["kinds"]), s["kinds"]


@pytest.mark.parametrize("key", ["lost", "corrupted", "status_5xx", "unexpected_status", "stream_errors",
                                 "kv_blocks_used_at_end", "running_at_end"])
def test_any_bad_counter_fails_the_soak(key):
    clean = dict.fromkeys(["lost", "corrupted", "status_5xx", "unexpected_status", "stream_errors",
                           "kv_blocks_used_at_end", "running_at_end"], 0)
    assert not serve_mix.failed(clean)
    assert serve_mix.failed(clean | {key: 1})


def test_plan_is_seeded_and_oversized_bodies_exceed_the_limit():
    a = serve_mix.plan(200, 3, "m", 8, 1000)
    assert a == serve_mix.plan(200, 3, "m", 8, 1000)
    assert all(len(body) > 1000 for kind, body, _ in a if kind == "oversized")
    assert all(len(body) < 1000 for kind, body, _ in a if kind != "oversized")
